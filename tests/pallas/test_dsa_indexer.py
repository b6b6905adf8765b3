"""DSA lightning indexer: index scores (jnp reference, the XLA path and the Pallas kernel in
interpret mode) against a float64 numpy oracle, and the top-k selection over the positions each row may see (causal prefill rows, tree
rows that see the prefix and their own ancestors, never siblings), on fresh random problems."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas import dsa_indexer

# Jitted: one compile each instead of op-by-op dispatch (keeps the test short).
index_scores_reference = jax.jit(dsa_indexer.index_scores_reference, static_argnames="page_size")
index_scores_xla = jax.jit(dsa_indexer.index_scores_xla, static_argnames="page_size")
index_scores_pallas = jax.jit(functools.partial(dsa_indexer.index_scores_pallas, interpret=True),
                              static_argnames=("page_size", "blocks"))
indexer_top_k = jax.jit(dsa_indexer.indexer_top_k, static_argnames=("page_size", "topk"))

B, Hi, Di, L, P = 2, 3, 8, 2, 4
# Tree of 5 rows: 0 root; 1, 2 children of 0; 3 child of 1; 4 child of 2 (ancestor-or-self mask).
PARENT = [-1, 0, 0, 1, 2]


def tree_mask() -> np.ndarray:  # bool[5, 5]
    m = np.eye(5, dtype=bool)
    for i, p in enumerate(PARENT):
        while p >= 0:
            m[i, p] = True
            p = PARENT[p]
    return m


def problem(seed: int, T: int, prefix: list[int], W: int):
    rng = np.random.default_rng(seed)
    N = (B * W + 1) * P
    table = (1 + rng.permutation(B * W)).reshape(B, W).astype(np.int32)
    q = rng.standard_normal((B, T, Hi, Di)).astype(np.float32)
    w = rng.standard_normal((B, T, Hi)).astype(np.float32)  # signed, like weights_proj
    k = rng.standard_normal((L, N, Di)).astype(np.float32)
    return q, w, k, table, np.asarray(prefix, np.int32)


def oracle_scores(q, w, k, layer, table, prefix, visible_rows):
    """float64 numpy: score[b, t, pos] = sum_h w relu(q.k), -inf where row t may not see pos."""
    T = q.shape[1]
    K = table.shape[1] * P
    pos = np.arange(K)
    slots = table[:, pos // P] * P + pos % P  # [B, K]
    kk = k[layer][slots].astype(np.float64)  # [B, K, Di]
    s = np.maximum(np.einsum("bthd,bkd->bthk", q.astype(np.float64), kk), 0)
    score = np.einsum("bthk,bth->btk", s, w.astype(np.float64))
    vis = np.zeros((B, T, K), bool)
    for b in range(B):
        for t in range(T):
            vis[b, t, : prefix[b]] = True
            for j in visible_rows(t):
                vis[b, t, prefix[b] + j] = True
    return np.where(vis, score, -np.inf), slots


def check_selection(picked, score, slots, topk):
    """Each row picks distinct visible slots whose scores are the row's top-k scores (ties at the
    boundary may pick either slot); rows seeing fewer than topk positions pick all of them, -1 after."""
    picked = np.asarray(picked)
    for b in range(picked.shape[0]):
        slot_score = dict(zip(slots[b].tolist(), score[b].T.tolist()))  # slot -> [T] scores
        for t in range(picked.shape[1]):
            row = score[b, t]
            n_vis = int(np.isfinite(row).sum())
            real = [s for s in picked[b, t].tolist() if s >= 0]
            assert len(real) == len(set(real)) == min(topk, n_vis), (b, t, picked[b, t])
            assert all(s == -1 for s in picked[b, t, len(real):])
            got = np.sort([slot_score[s][t] for s in real])[::-1]
            want = np.sort(row[np.isfinite(row)])[::-1][: len(real)]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["causal", "tree"])
def test_index_scores_and_top_k_over_visible_positions(kind):
    if kind == "causal":  # a prefill chunk after ragged prefixes (one empty)
        T, prefix, block = 6, [0, 5], None
        rows = lambda t: range(t + 1)  # noqa: E731
    else:  # tree verify: prefix + own ancestors
        T, prefix = 5, [9, 3]
        block = np.broadcast_to(tree_mask(), (B, T, T))
        rows = lambda t: np.nonzero(tree_mask()[t])[0]  # noqa: E731
    W = 4
    q, w, k, table, pre = problem(7 if kind == "causal" else 8, T, prefix, W)
    args = (jnp.asarray(q), jnp.asarray(w), jnp.asarray(k), jnp.int32(1), jnp.asarray(table), jnp.asarray(pre),
            None if block is None else jnp.asarray(block))
    score, slots = oracle_scores(q, w, k, 1, table, pre, rows)
    for fn in (index_scores_reference, index_scores_xla, index_scores_pallas):
        got = np.asarray(fn(*args, page_size=P))
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(score), fn.__name__)
        np.testing.assert_allclose(got[np.isfinite(got)], score[np.isfinite(score)], rtol=1e-5, atol=1e-5)
    for topk in (4, 16):  # some rows see more than topk positions, some fewer
        picked = indexer_top_k(*args, page_size=P, topk=topk)
        assert picked.shape == (B, T, topk) and picked.dtype == jnp.int32
        check_selection(picked, score, slots, topk)
    if kind == "tree":  # a sibling is never selected, even when it would score best
        picked = np.asarray(picked)
        for b in range(B):
            sibling_slot = table[b, (pre[b] + 2) // P] * P + (pre[b] + 2) % P
            assert sibling_slot not in picked[b, 1] and sibling_slot not in picked[b, 3]


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("kind", ["causal", "tree"])
def test_exact_ties_go_to_the_lower_position(kind, implementation):
    """Scores tying exactly at 0 (every head's ReLU zero, as random checkpoints often give) are
    picked lowest position first, the rule plain decode, prefill and tree verify rows share (tree
    nodes sit after the prefix with ancestors before descendants), so speculative output equals
    plain output under ties. Here every weight is negative and a random half of the keys is zero:
    each row's best score is an exact 0, shared by more positions than it picks."""
    if kind == "causal":
        T, prefix, block, rows = 6, [11, 5], None, (lambda t: range(t + 1))
    else:
        T, prefix, block = 5, [13, 9], np.broadcast_to(tree_mask(), (B, 5, 5))
        rows = lambda t: np.nonzero(tree_mask()[t])[0]  # noqa: E731
    W, layer, topk = 5, 1, 4
    q, w, k, table, pre = problem(21 if kind == "causal" else 22, T, prefix, W)
    w = -np.abs(w)
    rng = np.random.default_rng(23)
    pos = np.arange(W * P)
    slots = table[:, pos // P] * P + pos % P  # [B, K]
    for b in range(B):
        k[layer, slots[b, rng.random(W * P) < 0.5]] = 0.0
    score, slots = oracle_scores(q, w, k, layer, table, pre, rows)
    args = (jnp.asarray(q), jnp.asarray(w), jnp.asarray(k), jnp.int32(layer), jnp.asarray(table), jnp.asarray(pre),
            None if block is None else jnp.asarray(block))
    picked = np.asarray(jax.jit(dsa_indexer.indexer_top_k, static_argnames=("page_size", "topk", "implementation"))(
        *args, page_size=P, topk=topk, implementation=implementation))
    tied_rows = 0
    for b in range(B):
        for t in range(T):
            row = score[b, t]
            assert row.max() == 0
            tied_rows += (row == 0).sum() > topk
            best = np.argsort(-row, kind="stable")[: min(topk, np.isfinite(row).sum())]  # ties: position order
            want = np.full(topk, -1)
            want[: len(best)] = slots[b, best]
            np.testing.assert_array_equal(np.sort(picked[b, t]), np.sort(want), f"row {b}, {t}")
    assert tied_rows >= B * T // 2  # the ties are real: more zero-score positions than picks


def test_bad_inputs_are_clear_errors():
    q, w, k, table, pre = problem(0, 2, [1, 1], 2)
    args = [jnp.asarray(a) for a in (q, w, k)] + [jnp.int32(0), jnp.asarray(table), jnp.asarray(pre), None]
    with pytest.raises(ValueError, match="topk"):
        dsa_indexer.indexer_top_k(*args, page_size=P, topk=2 * P + 1)
    with pytest.raises(ValueError, match="weights"):
        dsa_indexer.indexer_top_k(args[0], args[1][:, :, :1], *args[2:], page_size=P, topk=2)


@pytest.mark.parametrize("case", [
    # B, T, Hi, Di, page, W, prefix, block kind, pool dtype, block_k
    (2, 1, 64, 128, 16, 5, [37, 80], "causal", jnp.bfloat16, 32),  # decode, V3.2's head layout, ragged
    (1, 4, 5, 24, 4, 6, [9], "tree", jnp.float32, 16),  # padded heads and width, a tile past K
    (3, 3, 8, 16, 1, 20, [0, 7, 16], "causal", jnp.float32, 8),  # page 1, an empty prefix
], ids=["decode-h64d128-bf16", "tree-padded", "page1-causal"])
def test_pallas_index_scores_equal_the_reference(case):
    """The kernel (interpret mode) on fresh random problems: scores within f32 / bf16 rounding of
    the reference, -inf exactly where the reference has it, and the same top-k picks."""
    Bc, T, H, D, page, W, prefix, kind, dtype, bk = case
    rng = np.random.default_rng(1000 * Bc + 100 * T + H)
    N = (Bc * W + 1) * page
    table = (1 + rng.permutation(Bc * W)).reshape(Bc, W).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((Bc, T, H, D)), dtype)
    w = jnp.asarray(rng.standard_normal((Bc, T, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, N, D)), dtype)
    mask = None
    if kind == "tree":
        mask = jnp.asarray(np.broadcast_to(tree_mask()[:T, :T], (Bc, T, T)))
    args = (q, w, k, jnp.int32(1), jnp.asarray(table), jnp.asarray(prefix, jnp.int32), mask)
    want = np.asarray(index_scores_reference(*args, page_size=page))
    got = np.asarray(index_scores_pallas(*args, page_size=page, blocks=dsa_indexer.IndexerBlocks(block_k=bk)))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=tol, atol=tol * np.abs(want[np.isfinite(want)]).max())
    if dtype == jnp.float32:
        topk = 6
        picked = dsa_indexer.indexer_top_k(*args, page_size=page, topk=topk, implementation="pallas")
        slots = table[:, np.arange(W * page) // page] * page + np.arange(W * page) % page
        check_selection(picked, want, slots, topk)
