"""The sliding-window pool on its own: ring slot math, compaction through both parts of a
SplitPool (a zero-layer part untouched), and sliding-window attention against a dense
reference over the whole history (prefix in the ring, a causal block longer than the window,
a tree-masked block read back from the pool)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.spec.compact import compact_pool
from jaxspec.kvcache.paging import AttentionInputs, PageTables, WindowTable
from jaxspec.kvcache.pool import KVPool, SplitPool
from jaxspec.model.layers import window_write_and_attend

P, R = 4, 3  # page size, ring columns


def ring_slot(pages, first, pos):
    """The documented map: logical page j at column j % R while first <= j < first + R."""
    j = pos // P
    if pos < 0 or not first <= j < first + R:
        return 0
    return pages[j % R] * P + pos % P


def test_ring_slots_follow_the_documented_map():
    pages = np.array([[7, 5, 6], [2, 3, 4]], np.int32)
    first = np.array([4, 0], np.int32)  # row 0 has wrapped: logical pages 4, 5, 6 sit in columns 1, 2, 0
    pos = np.arange(-2, 32, dtype=np.int32)[None].repeat(2, 0)
    got = np.asarray(WindowTable(jnp.asarray(pages), jnp.asarray(first)).slots(jnp.asarray(pos), P))
    want = np.array([[ring_slot(pages[b], first[b], p) for p in pos[b]] for b in range(2)])
    np.testing.assert_array_equal(got, want)
    assert got[0, 2 + 16] == 5 * P and got[0, 2 + 24] == 7 * P  # positions 16 (page 4) and 24 (page 6)


def test_compaction_moves_kv_in_both_pools_through_their_own_tables():
    rng = np.random.default_rng(0)
    pool = SplitPool(
        full=KVPool(k=jnp.asarray(rng.normal(size=(2, 40, 1, 3)), jnp.float32),
                    v=jnp.asarray(rng.normal(size=(2, 40, 1, 3)), jnp.float32), page_size=P),
        window=KVPool(k=jnp.asarray(rng.normal(size=(3, 28, 2, 2)), jnp.float32),
                      v=jnp.asarray(rng.normal(size=(3, 28, 2, 2)), jnp.float32), page_size=P),
    )
    full_pages = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]], np.int32)
    ring_pages, first = np.array([[3, 1, 2], [4, 5, 6]], np.int32), np.array([2, 1], np.int32)
    tables = PageTables(full=jnp.asarray(full_pages), window=WindowTable(jnp.asarray(ring_pages), jnp.asarray(first)))
    seq_lens = np.array([9, 5], np.int32)
    accept_index = np.array([[0, 2, 3, 5], [0, 1, 4, -1]], np.int32)
    accept_lens = np.array([4, 3], np.int32)
    out = compact_pool(pool, tables, jnp.asarray(seq_lens), jnp.asarray(accept_index), jnp.asarray(accept_lens),
                       jnp.ones(2, bool), implementation="xla")

    def expect(part, slot_of):
        k, v = np.array(part.k), np.array(part.v)
        for b in range(2):
            for j in range(1, accept_lens[b]):
                src, dst = slot_of(b, seq_lens[b] + accept_index[b, j]), slot_of(b, seq_lens[b] + j)
                k[:, dst], v[:, dst] = np.array(part.k)[:, src], np.array(part.v)[:, src]
        return k, v

    for got, (k, v) in ((out.full, expect(pool.full, lambda b, p: full_pages[b, p // P] * P + p % P)),
                        (out.window, expect(pool.window, lambda b, p: ring_slot(ring_pages[b], first[b], p)))):
        np.testing.assert_array_equal(np.asarray(got.k), k)
        np.testing.assert_array_equal(np.asarray(got.v), v)
    assert not np.array_equal(np.asarray(out.window.k), np.asarray(pool.window.k))
    # A zero-layer part (Mistral's full part) is untouched, and so is a pool without window layers.
    empty = SplitPool(full=KVPool.create(num_layers=0, num_pages=1, page_size=P, num_kv_heads=1, head_dim=1,
                                         dtype=jnp.float32), window=pool.window)
    again = compact_pool(empty, tables, jnp.asarray(seq_lens), jnp.asarray(accept_index), jnp.asarray(accept_lens),
                         jnp.ones(2, bool), implementation="xla")
    assert again.full.k.shape == (0, 4, 1, 1)
    np.testing.assert_array_equal(np.asarray(again.window.k), np.asarray(out.window.k))


def dense_reference(q, k_all, v_all, q_pos, k_pos, window, extra=None):
    """Row t at q_pos[t] sees history keys at k_pos in (q_pos - window, q_pos] (and extra[t] among them)."""
    s = np.einsum("thd,khd->htk", q, k_all)
    ok = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
    if extra is not None:
        ok &= extra
    s = np.where(ok[None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("htk,khd->thd", w, v_all)


@pytest.mark.parametrize("mode", ["causal_block_longer_than_window", "tree_block"])
def test_window_attention_equals_dense_attention_over_the_history(mode):
    """One request, one KV head, window 5, a ring of 4 pages; the pool holds the history
    [0, prefix) of which only the resident tail survives (the host keeps the last W + 1
    committed positions); a prompt of 19 writes only its resident tail."""
    W, D = 5, 4
    rng = np.random.default_rng(1)
    causal = mode != "tree_block"
    prefix, T = (0, 19) if causal else (13, 4)
    hist_k, hist_v = rng.normal(size=(prefix + T, 1, D)), rng.normal(size=(prefix + T, 1, D))
    first = max(0, prefix + (T if causal else 0) - W - 1) // P
    ring = WindowTable(jnp.asarray([[1, 2, 3, 4]], jnp.int32), jnp.asarray([first], jnp.int32))
    pool = KVPool.create(num_layers=1, num_pages=6, page_size=P, num_kv_heads=1, head_dim=D, dtype=jnp.float32)
    old = jnp.arange(prefix, dtype=jnp.int32)[None]
    pool = pool.write(0, ring.slots(old, P)[0], jnp.asarray(hist_k[:prefix], jnp.float32),
                      jnp.asarray(hist_v[:prefix], jnp.float32))
    write = prefix + jnp.arange(T, dtype=jnp.int32)[None]
    if mode == "tree_block":  # nodes 0..3: 1 and 2 are children of 0, 3 a child of 1
        parent_mask = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
        depth = np.array([0, 1, 1, 2])
        block_mask = jnp.asarray(parent_mask)[None]
    else:
        depth, block_mask, parent_mask = np.arange(T), None, None
    attn = AttentionInputs(page_table=jnp.zeros((1, 1), jnp.int32), prefix_lens=jnp.asarray([prefix], jnp.int32),
                           write_slots=jnp.zeros((1, T), jnp.int32), block_mask=block_mask, write_positions=write,
                           window=ring)
    q = rng.normal(size=(T, 2, D))  # 2 query heads share the KV head
    q_pos = prefix + depth
    o, _ = window_write_and_attend(jnp.asarray(q[None], jnp.float32), jnp.asarray(hist_k[None, prefix:], jnp.float32),
                                   jnp.asarray(hist_v[None, prefix:], jnp.float32), pool, jnp.int32(0), attn,
                                   jnp.asarray(q_pos[None], jnp.int32), window=W, sm_scale=1.0)
    k_pos = np.arange(prefix + T)
    extra = None
    if parent_mask is not None:  # history keys: every prefix key; block keys: the ancestors
        extra = np.concatenate([np.ones((T, prefix), bool), parent_mask], axis=1)
        k_pos = np.concatenate([np.arange(prefix), prefix + depth])  # block keys sit at their tree positions
    want = dense_reference(q, np.repeat(hist_k, 2, axis=1), np.repeat(hist_v, 2, axis=1), q_pos, k_pos, W, extra)
    np.testing.assert_allclose(np.asarray(o[0]), want, atol=1e-5, rtol=1e-5)


def test_a_layer_without_a_window_table_is_refused():
    pool = SplitPool.create(full_layers=1, window_layers=1, num_pages=2, window_pages=2, page_size=P, full_heads=1,
                            full_dim=2, window_heads=1, window_dim=2, dtype=jnp.float32)
    with pytest.raises(ValueError, match="needs PageTables with a window table"):
        compact_pool(pool, jnp.zeros((1, 1), jnp.int32), jnp.zeros(1, jnp.int32), jnp.zeros((1, 2), jnp.int32),
                     jnp.ones(1, jnp.int32), jnp.ones(1, bool))
