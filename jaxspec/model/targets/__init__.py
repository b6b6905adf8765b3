"""Target models: one entry point per operation, whatever the family.

Each family (``llama``, ``deepseek``) is one module with its config next to it; this module
maps a config type to its family, so callers never branch on the architecture.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.layers import lm_head
from jaxspec.model.targets.base import ForwardOutput, Model
from jaxspec.model.targets.deepseek import create_mla_pool, deepseek_forward
from jaxspec.model.targets.deepseek_config import DeepseekConfig
from jaxspec.model.targets.llama import create_llama_pool, llama_forward
from jaxspec.model.targets.llama_config import LlamaConfig

__all__ = ["ForwardOutput", "Model", "create_target_pool", "forward_sequence", "target_forward", "target_logits"]


@dataclasses.dataclass(frozen=True)
class _Family:
    forward: Callable  # (params, cfg, tokens, positions, pool, attn, *, aux_layers, implementation) -> ForwardOutput
    create_pool: Callable  # (cfg, *, num_pages, page_size, dtype) -> pool


_FAMILIES: dict[type, _Family] = {
    LlamaConfig: _Family(llama_forward, create_llama_pool),
    DeepseekConfig: _Family(deepseek_forward, create_mla_pool),
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
) -> ForwardOutput:
    """Runs the target over T new tokens per row, writing their KV into ``pool``."""
    return _family(cfg).forward(params, cfg, tokens, positions, pool, attn, aux_layers=aux_layers,
                                implementation=implementation)


def target_logits(cfg, params: dict, hidden: jax.Array) -> jax.Array:  # [..., H] -> f32[..., V]
    return lm_head(params, hidden)


def create_target_pool(cfg, *, num_pages: int, page_size: int, dtype):
    """The target's KV pool: MHA ``[L, slots, Hkv, D]`` or MLA latent (+ indexer keys)."""
    return _family(cfg).create_pool(cfg, num_pages=num_pages, page_size=page_size, dtype=dtype)


def forward_sequence(model: Model, tokens, *, aux_layers: tuple[int, ...] = (), implementation=None):
    """Scores whole sequences with a fresh KV pool (no engine): returns
    (logits f32[B, T, V], hidden [B, T, H], aux [B, T, nA*H] | None) for ``tokens: [B, T]``.
    Handy for evaluation and as a test oracle."""
    tokens = jnp.asarray(tokens, jnp.int32)
    B, T = tokens.shape
    cfg = model.config
    pool = create_target_pool(cfg, num_pages=B + 1, page_size=T, dtype=jnp.dtype(model.dtype))
    page_table = jnp.arange(1, B + 1, dtype=jnp.int32)[:, None]
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    attn = AttentionInputs.build(page_table, jnp.zeros((B,), jnp.int32), positions, T)
    out = target_forward(cfg, model.params, tokens, positions, pool, attn,
                         aux_layers=aux_layers, implementation=implementation)
    return target_logits(cfg, model.params, out.hidden), out.hidden, out.aux
