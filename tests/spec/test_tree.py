"""select_top_k / organize / build_tree semantics, and the topk=1 static specialization."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.spec import tree as T


def random_levels(B, K, S, seed):
    """Runs select_top_k_tokens for S steps on random draft outputs (as the draft loop does)."""
    rng = np.random.default_rng(seed)

    def probs(shape):
        p = rng.random(shape).astype(np.float32)
        return jnp.asarray(np.sort(p, axis=-1)[..., ::-1].copy())  # descending, like top-k output

    topk_p = probs((B, K))
    topk_index = jnp.asarray(rng.integers(0, 1000, (B, K)), jnp.int32)
    hidden = jnp.asarray(rng.standard_normal((B, 3)), jnp.float32)
    scores, levels = None, []
    for i in range(S):
        _, hidden, scores, _, level = T.select_top_k_tokens(i, K, topk_p, topk_index, hidden, scores)
        levels.append(level)
        topk_p = probs((B, K, K))
        topk_index = jnp.asarray(rng.integers(0, 1000, (B, K, K)), jnp.int32)
    return levels


@pytest.mark.parametrize("S", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_chain_fast_path_equals_slow_path(S, B):
    levels = random_levels(B, 1, S, seed=S * 10 + B)
    fast = T.organize_chain(levels)
    slow = T.organize_draft_results(levels, num_draft_tokens=S + 1)
    for f, s, name in zip(fast, slow, ["parent_list", "top_scores_index", "draft_tokens"]):
        assert f.shape == s.shape, name
        np.testing.assert_array_equal(np.asarray(f), np.asarray(s), err_msg=name)
    parents, indices, _ = fast
    assert parents.shape == (B, S if S > 1 else 0)
    np.testing.assert_array_equal(np.asarray(indices)[0], np.arange(S))


def _primitives(fn, *args):
    names = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else []:
                walk(sub)
            for p in eqn.params.values():
                if hasattr(p, "jaxpr"):
                    walk(p.jaxpr)
                elif hasattr(p, "eqns"):
                    walk(p)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


@pytest.mark.parametrize("S", [1, 3, 6])
def test_chain_organize_lowers_without_topk_sort_gather(S):
    levels = random_levels(4, 1, S, seed=S)
    fast = _primitives(lambda lv: T.organize(lv, 1, S + 1), levels)
    assert not fast & {"top_k", "sort", "gather"}, fast
    # The same check on the tree path finds them, so it can fail.
    tree_levels = random_levels(4, 2, S, seed=S)
    slow = _primitives(lambda lv: T.organize(lv, 2, 3), tree_levels)
    assert {"top_k", "sort", "gather"} <= slow


def test_select_top_k_tokens_layout():
    B, K = 2, 3
    topk_p = jnp.asarray([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]], jnp.float32)
    topk_index = jnp.asarray([[10, 11, 12], [20, 21, 22]], jnp.int32)
    hidden = jnp.arange(B * 4, dtype=jnp.float32).reshape(B, 4)
    ids, rows, scores, parent_row, lv0 = T.select_top_k_tokens(0, K, topk_p, topk_index, hidden, None)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(topk_index))
    np.testing.assert_array_equal(np.asarray(lv0.parents)[0], [-1, 0, 1, 2])
    assert rows.shape == (B, K, 4) and lv0.scores.shape == (B, 1, K)
    # Step 1: children probabilities per frontier row; frontier = top-K of path products.
    child_p = jnp.asarray(np.tile([[0.9, 0.05, 0.05], [0.5, 0.4, 0.1], [0.99, 0.01, 0.0]], (B, 1, 1)), jnp.float32)
    child_ix = jnp.asarray(np.arange(B * K * K).reshape(B, K, K) + 100, jnp.int32)
    ids1, rows1, scores1, parent_row1, lv1 = T.select_top_k_tokens(1, K, child_p, child_ix, rows, scores)
    expand = np.asarray(scores)[:, :, None] * np.asarray(child_p)
    for b in range(B):
        order = np.argsort(-expand[b].reshape(-1), kind="stable")[:K]
        np.testing.assert_allclose(np.asarray(scores1)[b], expand[b].reshape(-1)[order], rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(lv1.parents)[b], order + K)  # + K*K*(1-1) + K
        np.testing.assert_array_equal(np.asarray(ids1)[b], np.asarray(child_ix)[b].reshape(-1)[order])
        np.testing.assert_array_equal(np.asarray(parent_row1)[b], order // K)


def sglang_build_tree(parent_list, top_index, topk):
    """Loop re-statement of SGLang's build_tree kernel for one request."""
    m = len(top_index)
    n = m + 1
    parent = [-1] * n
    for i in range(1, n):
        cand = top_index[i - 1]
        tb = cand // topk
        if tb > 0:
            pc = parent_list[tb]
            parent[i] = 1 + list(top_index).index(pc)
        else:
            parent[i] = 0
    depth = [0] * n
    mask = np.eye(n, dtype=bool)
    for i in range(1, n):
        j = parent[i]
        while j >= 0:
            mask[i, j] = True
            depth[i] += 1
            j = parent[j]
    first = [-1] * n
    sib = [-1] * n
    for i in range(1, n):
        p = parent[i]
        if first[p] == -1:
            first[p] = i
        else:
            c = first[p]
            while sib[c] != -1:
                c = sib[c]
            sib[c] = i
    return parent, depth, mask, first, sib


@pytest.mark.parametrize("K,S,n", [(2, 3, 6), (4, 5, 8), (4, 5, 16), (2, 4, 4), (3, 1, 4)])
def test_build_tree_matches_kernel_semantics(K, S, n):
    B = 3
    levels = random_levels(B, K, S, seed=K * 100 + n)
    parent_list, top_index, draft_tokens = T.organize_draft_results(levels, n)
    bonus = jnp.asarray([7, 8, 9], jnp.int32)
    tree = T.build_tree(bonus, parent_list, top_index, draft_tokens, K, S)
    for b in range(B):
        parent, depth, mask, first, sib = sglang_build_tree(
            np.asarray(parent_list)[b], np.asarray(top_index)[b], K
        )
        np.testing.assert_array_equal(np.asarray(tree.parent)[b], parent)
        np.testing.assert_array_equal(np.asarray(tree.depth)[b], depth)
        np.testing.assert_array_equal(np.asarray(tree.mask)[b], mask)
        np.testing.assert_array_equal(np.asarray(tree.next_token)[b], first)
        np.testing.assert_array_equal(np.asarray(tree.next_sibling)[b], sib)
        np.testing.assert_array_equal(np.asarray(tree.retrieve_index)[b], b * n + np.arange(n))
        assert int(tree.tokens[b, 0]) == int(bonus[b])
        assert max(depth) <= S


@pytest.mark.parametrize("S", [1, 2, 5])
def test_chain_tree_equals_generic_build(S):
    B = 2
    levels = random_levels(B, 1, S, seed=S)
    parents, indices, tokens = T.organize_chain(levels)
    bonus = jnp.asarray([3, 4], jnp.int32)
    generic = T.build_tree(bonus, parents, indices, tokens, 1, S)
    static = T.chain_tree(bonus, tokens)
    for name in ["tokens", "depth", "parent", "mask", "retrieve_index", "next_token", "next_sibling"]:
        np.testing.assert_array_equal(np.asarray(getattr(generic, name)), np.asarray(getattr(static, name)), name)
