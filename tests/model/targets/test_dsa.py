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
from tests.model.targets.test_golden_deepseek import v32_model

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


PREFIX = 10
PARENT = [-1, 0, 0, 1, 2]  # tree block after the prefix: 0 root; 1, 2 its children; 3 under 1; 4 under 2
DEPTH = [0, 1, 1, 2, 2]


@functools.partial(jax.jit, static_argnums=(0,))
def prefix_then_block(cfg, lp, h_prefix, h_block, block_pos, block_mask):
    """Layer 0's attention over a causal prefix, then over a block after it (rows at ``block_pos``,
    visibility ``block_mask`` or causal when None); returns the block's output [1, Tb, H]."""
    table = jnp.arange(1, W + 1, dtype=jnp.int32)[None, ::-1]  # [1, W], 16 positions
    pool = create_mla_pool(cfg, num_pages=W + 1, page_size=PAGE, dtype=jnp.float32)
    pos = jnp.arange(PREFIX, dtype=jnp.int32)[None]
    _, pool = mla_attention_block(lp, cfg, h_prefix, pos, pool, jnp.int32(0),
                                  AttentionInputs.build(table, jnp.zeros(1, jnp.int32), pos, PAGE), implementation=None)
    Tb = h_block.shape[1]
    write = PREFIX + jnp.arange(Tb, dtype=jnp.int32)[None]  # block rows take the slots after the prefix
    attn = AttentionInputs.build(table, jnp.full((1,), PREFIX, jnp.int32), write, PAGE, block_mask=block_mask)
    return mla_attention_block(lp, cfg, h_block, block_pos, pool, jnp.int32(0), attn, implementation=None)[0]


def test_tree_rows_select_among_prefix_and_own_ancestors():
    """A tree block attended sparsely (index_topk 5 < the 10 prefix positions) gives each node the
    output of the causal chain prefix + its own root path: siblings are never selected."""
    cfg, params = v32_model()
    cfg = dataclasses.replace(cfg, index_topk=5)
    lp = {k: v[0] for k, v in params["dense"].items()}
    rng = np.random.default_rng(9)
    h_prefix = jnp.asarray(rng.standard_normal((1, PREFIX, cfg.hidden_size)), jnp.float32)
    h_tree = jnp.asarray(rng.standard_normal((1, len(PARENT), cfg.hidden_size)), jnp.float32)
    mask = np.eye(len(PARENT), dtype=bool)
    for i, p in enumerate(PARENT):
        while p >= 0:
            mask[i, p], p = True, PARENT[p]
    tree_pos = jnp.asarray(PREFIX + np.array(DEPTH, np.int32))[None]
    tree = np.asarray(prefix_then_block(cfg, lp, h_prefix, h_tree, tree_pos, jnp.asarray(mask)[None]))
    for path in ([0, 1, 3], [0, 2, 4]):
        chain = np.asarray(prefix_then_block(cfg, lp, h_prefix, h_tree[:, path], tree_pos[:, path], None))
        np.testing.assert_allclose(tree[0, path], chain[0], atol=2e-5, rtol=2e-5)
