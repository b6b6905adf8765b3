"""The gated delta rule in block form (``jaxspec.model.gated_delta``) against the rule applied token by
token along each path (``delta_reference``): trees, chains in chunks, a draft step's frontier over its
scratch, the state at any node, and the causal conv over chains and trees."""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp
from jaxspec.spec import tree as tree_lib
from jaxspec.model.gated_delta import (conv_chain, conv_state_after, conv_tree, delta_block, delta_chain, delta_reference,
                                       delta_rows, l2norm, state_at)

B, H, Dk, Dv = 2, 3, 8, 5


def inputs(rng, T, decay=(0.01, 1.0)):
    q = l2norm(jnp.asarray(rng.normal(size=(B, T, H, Dk)))) * Dk**-0.5
    k = l2norm(jnp.asarray(rng.normal(size=(B, T, H, Dk))))
    v = jnp.asarray(rng.normal(size=(B, T, H, Dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(*decay, (B, T, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, H)), jnp.float32)
    s0 = jnp.asarray(rng.normal(size=(B, H, Dk, Dv)), jnp.float32)
    return q, k, v, g, beta, s0


def random_parents(rng, T):
    parent = np.full((B, T), -1)
    for b in range(B):
        for t in range(1, T):
            parent[b, t] = rng.integers(0, t)
    return parent


@pytest.mark.parametrize("T", [1, 2, 9, 17])
def test_block_equals_the_rule_along_every_path_of_a_tree(T):
    rng = np.random.default_rng(T)
    q, k, v, g, beta, s0 = inputs(rng, T)
    parent = random_parents(rng, T)
    tree = tree_lib.link_tree(jnp.zeros((B, T), jnp.int32), jnp.asarray(parent, jnp.int32), max_depth=T)
    want_o, want_s = delta_reference(q, k, v, g, beta, s0, jnp.asarray(parent))
    o, u, G = delta_block(q, k, v, g, beta, s0, tree.mask)
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), atol=2e-5)
    for t in range(T):  # the state at any node, from the block's vectors alone
        s = state_at(s0, k, u, G, tree.mask[:, t], jnp.full((B,), t, jnp.int32))
        np.testing.assert_allclose(np.asarray(s), np.asarray(want_s[:, t]), atol=2e-5, err_msg=f"node {t}")


@pytest.mark.parametrize("T,chunk", [(64, 64), (150, 32), (7, 64)])
def test_chunked_chain_equals_the_rule(T, chunk):
    rng = np.random.default_rng(T)
    q, k, v, g, beta, s0 = inputs(rng, T, decay=(0.001, 0.2))
    want_o, want_s = delta_reference(q, k, v, g, beta, s0, jnp.asarray(np.broadcast_to(np.arange(T) - 1, (B, T))))
    o, s = delta_chain(q, k, v, g, beta, s0, chunk=chunk)
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), atol=5e-5)
    np.testing.assert_allclose(np.asarray(s), np.asarray(want_s[:, -1]), atol=5e-5)


def test_a_chunked_chain_also_gives_the_state_after_marked_tokens():
    """The prefix cache's snapshots: the state after any token of the chain (a chunk's first, middle
    and last token, the chain's last), per row, wherever it falls in the chunk grid; -1 and a token past
    the chain give zeros."""
    rng = np.random.default_rng(5)
    T, chunk = 40, 16
    q, k, v, g, beta, s0 = inputs(rng, T, decay=(0.001, 0.2))
    _, want_s = delta_reference(q, k, v, g, beta, s0, jnp.asarray(np.broadcast_to(np.arange(T) - 1, (B, T))))
    marks = np.array([[0, 15, 39, 2], [21, -1, 32, 60]], np.int32)
    _, s, kept = delta_chain(q, k, v, g, beta, s0, chunk=chunk, marks=jnp.asarray(marks))
    np.testing.assert_allclose(np.asarray(s), np.asarray(want_s[:, -1]), atol=5e-5)
    for b in range(B):
        for m, t in enumerate(marks[b]):
            want = np.zeros_like(want_s[b, 0]) if not 0 <= t < T else want_s[b, t]
            np.testing.assert_allclose(np.asarray(kept[b, m]), np.asarray(want), atol=5e-5, err_msg=f"row {b} mark {t}")


def test_padding_tokens_leave_the_state_alone():
    rng = np.random.default_rng(1)
    q, k, v, g, beta, s0 = inputs(rng, 12)
    keep = np.arange(12) < 7
    o, s = delta_chain(q, k, v, jnp.where(keep[None, :, None], g, 0), jnp.where(keep[None, :, None], beta, 0), s0,
                       chunk=4)
    _, s7 = delta_chain(q[:, :7], k[:, :7], v[:, :7], g[:, :7], beta[:, :7], s0, chunk=4)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s7), atol=1e-5)


def test_a_draft_frontier_continues_its_paths_from_the_scratch():
    """Step by step, as a draft loop runs it: each step's K rows read their ancestors' u from the
    scratch columns written by earlier steps."""
    rng = np.random.default_rng(3)
    K, S = 2, 3
    q, k, v, g, beta, s0 = inputs(rng, K * S)  # column j * S + i: branch j, step i
    # Branch j at step i descends from branch parent_branch[i][j] at step i - 1.
    parent_branch = [None, [1, 0], [0, 0]]
    col = lambda j, i: j * S + i  # noqa: E731
    parent = np.full((B, K * S), -1)
    for i in range(1, S):
        for j in range(K):
            parent[:, col(j, i)] = col(parent_branch[i][j], i - 1)
    # The reference runs parents first: renumber the nodes step-major, run, and number them back.
    order = np.asarray([col(j, i) for i in range(S) for j in range(K)])
    rank = np.argsort(order)
    parent_sm = np.where(parent[:, order] >= 0, rank[np.maximum(parent[:, order], 0)], -1)
    perm = lambda x: x[:, order]  # noqa: E731
    o_sm, _ = delta_reference(*(perm(x) for x in (q, k, v, g, beta)), s0, jnp.asarray(parent_sm))
    want_o = o_sm[:, rank]
    ks, us, Gs = (jnp.zeros((B, K * S) + x.shape[2:]) for x in (k, v, g))
    for i in range(S):
        rows = [col(j, i) for j in range(K)]
        anc = np.zeros((B, K, K * S), bool)
        g_parent = jnp.zeros((B, K, H))
        for j in range(K):
            c = parent[0, col(j, i)]
            if c >= 0:
                g_parent = g_parent.at[:, j].set(Gs[:, c])
            while c >= 0:
                anc[:, j, c] = True
                c = parent[0, c]
        pick = lambda x: x[:, rows]  # noqa: E731
        o, u, G = delta_rows(pick(q), pick(k), pick(v), pick(g), pick(beta), s0, ks, us, Gs, jnp.asarray(anc),
                             g_parent)
        np.testing.assert_allclose(np.asarray(o), np.asarray(want_o[:, rows]), atol=2e-5, err_msg=f"step {i}")
        ks, us, Gs = ks.at[:, rows].set(pick(k)), us.at[:, rows].set(u), Gs.at[:, rows].set(G)


def test_conv_over_trees_chains_and_the_state_after_a_path():
    rng = np.random.default_rng(4)
    T, C, K = 9, 6, 4
    x = jnp.asarray(rng.normal(size=(B, T, C)), jnp.float32)
    conv0 = jnp.asarray(rng.normal(size=(B, C, K - 1)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(C, K)), jnp.float32)
    parent = random_parents(rng, T)
    tree = tree_lib.link_tree(jnp.zeros((B, T), jnp.int32), jnp.asarray(parent, jnp.int32), max_depth=T)
    got = np.asarray(conv_tree(x, conv0, w, tree.mask))
    for b in range(B):
        for t in range(T):
            path, n = [], t
            while n >= 0:
                path.append(n)
                n = parent[b, n]
            seq = [np.asarray(conv0[b, :, i]) for i in range(K - 1)] + [np.asarray(x[b, n]) for n in path[::-1]]
            want = sum(seq[-1 - j] * np.asarray(w[:, K - 1 - j]) for j in range(K))
            np.testing.assert_allclose(got[b, t], want, atol=1e-5)
            # The conv state after this node's path: its last K - 1 inputs.
            nodes = jnp.asarray(np.pad(path[::-1], (0, T - len(path)), constant_values=-1))[None].repeat(B, 0)
            state = conv_state_after(x, conv0, nodes, jnp.full((B,), len(path), jnp.int32))
            np.testing.assert_allclose(np.asarray(state[b]).T, np.stack(seq[-(K - 1):]), atol=1e-6)
    chain = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    np.testing.assert_allclose(np.asarray(conv_chain(x, conv0, w)), np.asarray(conv_tree(x, conv0, w, chain)), atol=1e-6)
