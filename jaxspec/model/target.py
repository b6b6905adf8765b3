"""Target-model dispatch: one entry point per operation, whatever the architecture."""

from __future__ import annotations

import jax

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import KVPool
from jaxspec.model.config import LlamaConfig
from jaxspec.model.llama import ForwardOutput, llama_forward, lm_logits


def target_forward(
    cfg,
    params: dict,
    tokens: jax.Array,  # i32[B, T]
    positions: jax.Array,  # i32[B, T]
    pool,
    attn: AttentionInputs,
    *,
    aux_layers: tuple[int, ...] = (),
    implementation: str | None = None,
) -> ForwardOutput:
    if isinstance(cfg, LlamaConfig):
        return llama_forward(
            params, cfg, tokens, positions, pool, attn, aux_layers=aux_layers, implementation=implementation
        )
    from jaxspec.model.deepseek import DeepseekConfig, deepseek_forward

    if isinstance(cfg, DeepseekConfig):
        return deepseek_forward(
            params, cfg, tokens, positions, pool, attn, aux_layers=aux_layers, implementation=implementation
        )
    raise TypeError(f"unsupported target config {type(cfg).__name__}")


def target_logits(cfg, params: dict, hidden: jax.Array) -> jax.Array:  # f32[..., V]
    return lm_logits(params, hidden)


def create_target_pool(cfg, *, num_pages: int, page_size: int, dtype):
    if isinstance(cfg, LlamaConfig):
        return KVPool.create(
            num_layers=cfg.num_layers, num_pages=num_pages, page_size=page_size,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype,
        )
    from jaxspec.model.deepseek import DeepseekConfig, create_mla_pool

    if isinstance(cfg, DeepseekConfig):
        return create_mla_pool(cfg, num_pages=num_pages, page_size=page_size, dtype=dtype)
    raise TypeError(f"unsupported target config {type(cfg).__name__}")


def forward_sequence(model, tokens, *, aux_layers: tuple[int, ...] = (), implementation: str | None = None):
    """Scores whole sequences with a fresh KV pool (no engine): returns
    (logits f32[B, T, V], hidden [B, T, H], aux [B, T, nA*H] | None) for ``tokens: [B, T]``.
    Handy for evaluation and as a test oracle."""
    import jax.numpy as jnp

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
