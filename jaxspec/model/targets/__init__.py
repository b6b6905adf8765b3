"""Target models: one entry point per operation, whatever the family.

Each family (``llama``, ``deepseek``, ``deepseek_v4``, ``gemma4``, ``hybrid``) is one module with its
config next to it; this module maps a config type to its family, so callers never branch on the
architecture.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kvcache.paging import AttentionInputs, PageTables, WindowTable
from jaxspec.model.layers import lm_head, mask_padded_vocab
from jaxspec.pallas.exact import exact_mode
from jaxspec.xla_options import compiler_options, program_backend
from jaxspec.model.targets.base import ForwardOutput, KVLayout, Model
from jaxspec.model.targets.deepseek import create_mla_pool, deepseek_forward
from jaxspec.model.targets.deepseek_config import DeepseekConfig
from jaxspec.model.targets.deepseek_v4 import commit_accepted as v4_commit
from jaxspec.model.targets.deepseek_v4 import create_v4_pool, deepseek_v4_forward
from jaxspec.model.targets.deepseek_v4_config import DeepseekV4Config
from jaxspec.model.targets.gemma4 import create_gemma4_pool, gemma4_forward, gemma4_logits
from jaxspec.model.targets.gemma4_config import Gemma4Config
from jaxspec.model.targets.llama import create_llama_pool, llama_forward
from jaxspec.model.targets.llama_config import LlamaConfig
from jaxspec.model.targets.hybrid import commit_accepted, create_hybrid_pool, hybrid_forward
from jaxspec.model.targets.hybrid_config import HybridConfig

__all__ = ["ForwardOutput", "KVLayout", "Model", "create_target_pool", "forward_fresh", "forward_sequence",
           "exact_support", "has_recurrent_state", "kv_layout", "kv_window", "target_commit", "target_forward",
           "target_logits"]


@dataclasses.dataclass(frozen=True)
class _Family:
    forward: Callable  # (params, cfg, tokens, positions, pool, attn, *, aux_layers, implementation) -> ForwardOutput
    create_pool: Callable  # (cfg, *, num_pages, page_size, dtype, window_pages, rows) -> pool
    logits: Callable = lambda cfg, params, hidden: lm_head(params, hidden)  # noqa: E731
    # (cfg, pool, pending, accept_index, accept_lens, active) -> pool: a verify's recurrent state committed
    commit: Callable = lambda cfg, pool, pending, accept_index, accept_lens, active: pool  # noqa: E731
    layout: Callable = lambda cfg: KVLayout()  # noqa: E731  (cfg) -> KVLayout: what sizing its pools needs
    # (cfg) -> why the exact mode cannot compute it, or None (docs/architecture.md#the-exact-mode)
    inexact: Callable = lambda cfg: "its layers are not built from the exact mode's kernels yet"  # noqa: E731


def _mla_pool(cfg, *, num_pages, page_size, dtype, window_pages=None, rows=1):
    return create_mla_pool(cfg, num_pages=num_pages, page_size=page_size, dtype=dtype)


def _paged_only(create):  # families whose pools hold no per-row state
    return lambda cfg, *, rows=1, **kw: create(cfg, **kw)


def _v4_pool(cfg, *, num_pages, page_size, dtype, window_pages=None, rows=1, entry_pages=None):
    return create_v4_pool(cfg, num_pages=num_pages, page_size=page_size, dtype=dtype, window_pages=window_pages,
                          rows=rows, entry_pages=entry_pages)


def _hybrid_pool(cfg, *, num_pages, page_size, dtype, window_pages=None, rows=1, snapshot_rows=0):
    return create_hybrid_pool(cfg, num_pages=num_pages, page_size=page_size, dtype=dtype, rows=rows,
                              snapshot_rows=snapshot_rows)


_FAMILIES: dict[type, _Family] = {
    LlamaConfig: _Family(llama_forward, _paged_only(create_llama_pool),
                         layout=lambda cfg: KVLayout(window=cfg.sliding_window),
                         inexact=lambda cfg: "its sliding-window layers attend through the window pool"
                         if cfg.sliding_window else None),
    DeepseekConfig: _Family(deepseek_forward, _mla_pool),
    Gemma4Config: _Family(gemma4_forward, _paged_only(create_gemma4_pool), logits=gemma4_logits,
                          layout=lambda cfg: KVLayout(window=cfg.sliding_window if cfg.num_sliding_layers else None)),
    HybridConfig: _Family(hybrid_forward, _hybrid_pool, commit=commit_accepted,
                          layout=lambda cfg: KVLayout(recurrent=cfg.num_linear_layers > 0)),
    DeepseekV4Config: _Family(deepseek_v4_forward, _v4_pool, commit=v4_commit, layout=lambda cfg: KVLayout(
        window=cfg.sliding_window, span=cfg.window_span, entry_rates=tuple(cfg.entry_rates))),
}


def _family(cfg) -> _Family:
    try:
        return _FAMILIES[type(cfg)]
    except KeyError:
        raise TypeError(f"unsupported target config {type(cfg).__name__}") from None


def target_forward(
    cfg,
    params: dict,
    tokens: jax.Array,  # i32[B, T]
    positions: jax.Array,  # i32[B, T]
    pool,
    attn: AttentionInputs,
    *,
    aux_layers: tuple[int, ...] = (),
    implementation=None,
    exact: bool = False,
) -> ForwardOutput:
    """Runs the target over T new tokens per row, writing their KV into ``pool``. ``exact``: every
    row's reductions in a fixed order (``exact_support`` says whether the family can)."""
    with exact_mode(exact):
        return _family(cfg).forward(params, cfg, tokens, positions, pool, attn, aux_layers=aux_layers,
                                    implementation=implementation)


def target_logits(cfg, params: dict, hidden: jax.Array, *, exact: bool = False) -> jax.Array:  # [..., H] -> f32[..., V']
    """Logits over the padded vocabulary (``padded_vocab_size``), -inf in the padding."""
    with exact_mode(exact):
        return mask_padded_vocab(_family(cfg).logits(cfg, params, hidden), cfg.vocab_size)


def exact_support(cfg) -> str | None:
    """Why the exact mode cannot compute this target (refused by name), or None when it can."""
    return _family(cfg).inexact(cfg)


def kv_layout(cfg) -> KVLayout:
    """What sizing a target's pools needs (its window, retained span, compressed-KV rates, and why
    its prompts cannot be cached), in one value."""
    return _family(cfg).layout(cfg)


def kv_window(cfg) -> int | None:
    """The sliding window W of a target with sliding-window layers (their K/V live in a window
    pool of their own), else None."""
    return kv_layout(cfg).window


def create_target_pool(cfg, *, num_pages: int, page_size: int, dtype, window_pages: int | None = None,
                       rows: int = 1, entry_pages: tuple[int, ...] | None = None, snapshot_rows: int = 0):
    """The target's KV pool: MHA ``[L, slots, Hkv, D]``, MLA latent (+ indexer keys), for a
    model with sliding-window layers a ``SplitPool`` whose window part has ``window_pages``
    pages (default: ``num_pages``), for a hybrid model a ``HybridPool`` with the recurrent
    state of ``rows`` requests (one per batch row) and ``snapshot_rows`` prefix-cache snapshot
    slots, for DeepSeek-V4 a ``CompressedPool`` (ring part of ``window_pages`` pages, entry parts
    of ``entry_pages`` pages per compression rate)."""
    kw = {} if entry_pages is None else {"entry_pages": entry_pages}
    if snapshot_rows:
        kw["snapshot_rows"] = snapshot_rows
    return _family(cfg).create_pool(cfg, num_pages=num_pages, page_size=page_size, dtype=dtype,
                                    window_pages=window_pages, rows=rows, **kw)


def target_commit(cfg, pool, pending, accept_index: jax.Array, accept_lens: jax.Array, active: jax.Array):
    """After a verify step: the recurrent state of the accepted path written (models with linear
    attention); any other pool is returned as is."""
    return _family(cfg).commit(cfg, pool, pending, accept_index, accept_lens, active)


def has_recurrent_state(cfg) -> bool:
    """The target keeps per-request state besides paged KV (linear-attention layers)."""
    return isinstance(cfg, HybridConfig) and cfg.num_linear_layers > 0


def forward_sequence(model: Model, tokens, *, aux_layers: tuple[int, ...] = (), implementation=None):
    """Scores whole sequences with a fresh KV pool (no engine): returns
    (logits f32[B, T, V], hidden [B, T, H], aux [B, T, nA*H] | None) for ``tokens: [B, T]``.
    Handy for evaluation and as a test oracle. A model placed on a mesh runs as one compiled
    program under it (its per-shard layers are shard_maps over the model axis, which run only
    inside a jit); on one device, op by op."""
    if model.mesh is None:
        return forward_fresh(model.config, model.params, tokens, dtype=model.dtype, aux_layers=aux_layers,
                             implementation=implementation)
    with jax.set_mesh(model.mesh):
        return _forward_fresh_jit(program_backend(model.mesh))(
            model.config, model.params, jnp.asarray(tokens, jnp.int32), dtype=np.dtype(model.dtype),
            aux_layers=tuple(aux_layers), implementation=implementation)


def forward_fresh(cfg, params: dict, tokens, *, dtype, aux_layers: tuple[int, ...] = (), implementation=None):
    """``forward_sequence`` from a config and params (traceable: draft training computes a frozen
    target's features with it for families without a dense training forward)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    B, T = tokens.shape
    pool = create_target_pool(cfg, num_pages=B + 1, page_size=T, dtype=jnp.dtype(dtype), rows=B)
    pages = jnp.arange(1, B + 1, dtype=jnp.int32)[:, None]  # one page of T slots per row, in every pool
    tables = PageTables(full=pages, window=WindowTable(pages=pages, first=jnp.zeros((B,), jnp.int32)),
                        compressed=tuple(pages for _ in kv_layout(cfg).entry_rates))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    attn = AttentionInputs.build(tables, jnp.zeros((B,), jnp.int32), positions, T)
    out = target_forward(cfg, params, tokens, positions, pool, attn, aux_layers=aux_layers,
                         implementation=implementation)
    return target_logits(cfg, params, out.hidden), out.hidden, out.aux


@functools.cache
def _forward_fresh_jit(backend: str):
    """``forward_fresh`` jitted with the XLA options of jaxspec's table for ``backend``."""
    return jax.jit(forward_fresh, static_argnames=("cfg", "dtype", "aux_layers", "implementation"),
                   compiler_options=compiler_options(backend))
