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
    """hidden: [B, T, H] final normed state; aux: [B, T, nA * H] or None (pre-norm residual
    streams entering the tapped layers, concatenated low to high); pool: the KV pool with
    this forward's K/V written."""

    hidden: jax.Array
    aux: jax.Array | None
    pool: Any


class AuxTaps:
    """Collects the residual stream entering each tapped layer inside a ``lax.scan`` over
    layers: layer ``l`` writes slot ``tap[l]`` (untapped layers write a dummy slot)."""

    def __init__(self, num_layers: int, aux_layers: tuple[int, ...]):
        self.num_aux = len(aux_layers)
        tap = np.full((num_layers,), self.num_aux, np.int32)
        for i, layer in enumerate(aux_layers):
            tap[layer] = i
        self.tap = tap

    def empty(self, x: jax.Array) -> jax.Array | None:  # x [B, T, H] -> [nA + 1, B, T, H]
        return jnp.zeros((self.num_aux + 1,) + x.shape, x.dtype) if self.num_aux else None

    def record(self, aux: jax.Array | None, layer: jax.Array, x: jax.Array) -> jax.Array | None:
        if aux is None:
            return None
        return jax.lax.dynamic_update_index_in_dim(aux, x, jnp.asarray(self.tap)[layer], axis=0)

    def features(self, aux: jax.Array | None) -> jax.Array | None:  # -> [B, T, nA * H]
        if aux is None:
            return None
        return jnp.concatenate([aux[i] for i in range(self.num_aux)], axis=-1)


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
