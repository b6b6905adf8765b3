"""DeepSeek-V3.2 sparse attention (DSA) in the MLA attention block: the sparse path equals dense
attention while every row sees at most ``index_topk`` positions and changes the output beyond."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.targets.deepseek import create_mla_pool, mla_attention_block, uses_sparse_attention
from tests.model.test_golden_deepseek import v32_model

T, PAGE, W = 12, 4, 4  # 12 tokens on a page table covering 16 positions


@functools.partial(jax.jit, static_argnums=0)
def attention(cfg, lp, h):  # [2, T, H] -> [2, T, H]: layer 0's attention over a prompt
    table = jnp.arange(1, 2 * W + 1, dtype=jnp.int32).reshape(2, W)[:, ::-1]  # scrambled pages
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    pool = create_mla_pool(cfg, num_pages=2 * W + 1, page_size=PAGE, dtype=jnp.float32)
    attn = AttentionInputs.build(table, jnp.zeros(2, jnp.int32), pos, PAGE)
    return mla_attention_block(lp, cfg, h, pos, pool, jnp.int32(0), attn, implementation=None)[0]


def test_sparse_equals_dense_within_topk_and_differs_beyond():
    cfg, params = v32_model()  # index_topk 64: the 16 covered positions attend densely
    h = jnp.asarray(np.random.default_rng(5).standard_normal((2, T, cfg.hidden_size)), jnp.float32)
    attn = AttentionInputs.build(jnp.ones((2, W), jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros((2, T), jnp.int32),
                                 PAGE)
    lp = {k: v[0] for k, v in params["dense"].items()}
    assert not uses_sparse_attention(cfg, lp, attn, PAGE)
    dense = np.asarray(attention(cfg, lp, h))
    topk = 5
    sparse_cfg = dataclasses.replace(cfg, index_topk=topk)
    assert uses_sparse_attention(sparse_cfg, lp, attn, PAGE)  # 16 covered positions > topk
    sparse = np.asarray(attention(sparse_cfg, lp, h))
    # Rows seeing <= topk positions select all of them: dense attention, whatever the scores.
    np.testing.assert_allclose(sparse[:, :topk], dense[:, :topk], atol=2e-5, rtol=2e-5)
    # Rows seeing more attend to topk of them: the output changes.
    diff = np.abs(sparse[:, topk:] - dense[:, topk:]).max(axis=-1)  # [2, T - topk]
    assert diff.min() > 1e-3, diff
