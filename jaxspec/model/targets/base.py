"""What every target forward returns, and the EAGLE-3 feature taps they share.

Glossary: B rows, T positions per row, H hidden width, L layers, nA tapped layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOutput:
    """hidden: [B, T, H] final normed state; aux: [B, T, nA * H] or None (the residual streams
    entering the tapped layers, concatenated in ``aux_layers`` order; tap ``L`` is the final
    normed state, as HF's ``hidden_states[L]``); pool: the KV pool with this forward's K/V
    written; pending: what a verify forward of a model with recurrent state leaves for
    ``target_commit`` (None otherwise)."""

    hidden: jax.Array
    aux: jax.Array | None
    pool: Any
    pending: Any = None  # a verify forward's uncommitted recurrent state (hybrid models), else None


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What sizing a model's pools takes from the model, in one value (``kv_layout``).

    window: the sliding window of its sliding-window layers, whose K/V live in a window pool of
      their own (None: it has none).
    span: committed positions behind a request's length its window pool keeps resident, when
      more than the window (DeepSeek-V4's open compressor windows); None: the window.
    entry_rates: compression rates of its compressed-KV pools, one page table each (DeepSeek-V4).
    uncacheable: why its prompts cannot be prefix-cached (state not paged by position), or None.
    recurrent: it has recurrent state (linear-attention layers), one per request: the prefix cache
      keeps snapshots of it (``jaxspec.engine.snapshots``).
    """

    window: int | None = None
    span: int | None = None
    entry_rates: tuple[int, ...] = ()
    uncacheable: str | None = None
    recurrent: bool = False

    @property
    def retained(self) -> int | None:
        """Committed positions its window pool keeps behind a request's length (None: no window pool)."""
        if self.window is None:
            return None
        return self.window if self.span is None else self.span


class AuxTaps:
    """Collects the residual stream entering each tapped layer inside a ``lax.scan`` over
    layers: layer ``l`` writes slot ``tap[l]`` (untapped layers write a dummy slot).

    Tap ``l`` is HF's ``hidden_states[l]``: the stream entering layer ``l``, i.e. the output of
    layer ``l - 1``, for ``l < L``; tap ``L`` is the last entry of HF's ``hidden_states``, the
    final *normed* state (transformers returns it there, so drafts trained on HF hidden states,
    e.g. DFlash's ``target_layer_ids`` containing ``L - 1``, read exactly that), which
    ``features`` takes after the scan. EAGLE-3 (inputs of layers 2, L//2, L-3) and DFlash
    (outputs of any layers, ``l + 1``) read the same taps.
    """

    def __init__(self, num_layers: int, aux_layers: tuple[int, ...]):
        if any(not 0 <= a <= num_layers for a in aux_layers):
            raise ValueError(f"aux taps {aux_layers} must be layers in [0, {num_layers}]")
        # A layer may be tapped twice (EAGLE-3's 2, L//2, L-3 on a tiny target): it is recorded
        # once, in one slot per distinct layer, and repeated when the features are concatenated.
        distinct = sorted(set(aux_layers))
        self.num_aux = len(distinct)
        self.num_layers = num_layers
        tap = np.full((num_layers + 1,), self.num_aux, np.int32)
        for i, layer in enumerate(distinct):
            tap[layer] = i
        self.tap = tap
        self.order = tuple(int(tap[a]) for a in aux_layers)  # slot of every requested tap, in order

    def empty(self, x: jax.Array) -> jax.Array | None:  # x [B, T, H] -> [nA + 1, B, T, H]
        return jnp.zeros((self.num_aux + 1,) + x.shape, x.dtype) if self.num_aux else None

    def record(self, aux: jax.Array | None, layer: jax.Array, x: jax.Array) -> jax.Array | None:
        if aux is None:
            return None
        return jax.lax.dynamic_update_index_in_dim(aux, x, jnp.asarray(self.tap)[layer], axis=0)

    def features(self, aux: jax.Array | None, final: jax.Array) -> jax.Array | None:  # -> [B, T, len(aux_layers) * H]
        """The taps, concatenated in the requested order; ``final`` [B, T, H] is the final normed
        state (tap ``L``). Taps recorded over padding rows after the T real ones drop them here."""
        if aux is None:
            return None
        last = int(self.tap[self.num_layers])
        T = final.shape[1]
        return jnp.concatenate([final if i == last else aux[i][:, :T] for i in self.order], axis=-1)


@dataclasses.dataclass(eq=False)
class Model:
    """A loaded causal LM: a static ``config``, a ``params`` pytree, and (when the checkpoint
    has ``tokenizer.json``) a tokenizer so ``generate`` accepts strings."""

    config: Any
    params: dict
    dtype: np.dtype
    tokenizer: Any = None
    eos_token_ids: tuple[int, ...] = ()
    path: str | None = None
    mesh: Any = None  # the jax.sharding.Mesh its params are placed on (None: one device)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def __repr__(self) -> str:
        return f"Model({type(self.config).__name__}, path={self.path!r}, dtype={np.dtype(self.dtype).name})"
