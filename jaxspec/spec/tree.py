"""Draft-tree bookkeeping with SGLang's semantics: select_top_k_tokens, organize_draft_results,
build_tree. Glossary: B requests, K = topk, S = num_steps, n = num_draft_tokens,
C = K + (S - 1) * K**2 candidates.

Candidates are numbered in the order they are drafted: step 0 records K candidates (the
children of the root), every later step records K**2 (K children for each of the K frontier
rows). Candidate ``s`` has parent ``parent_list[s // K]`` (-1 = the root). The topk=1 chain
is a static specialization whose parents, indices and tokens are constants or concatenations.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftLevel:
    """What one draft step records (one entry of SGLang's score/token/parents lists).

    scores: f32[B, r, K] cumulative path probabilities (r = 1 at step 0, K after).
    tokens: i32[B, r * K] candidate tokens.
    parents: i32[B, K + 1] at step 0, i32[B, K] after: flat candidate index of each frontier
      row's node (the entry used by the *next* level's candidates).
    """

    scores: jax.Array
    tokens: jax.Array
    parents: jax.Array


def select_top_k_tokens(
    step: int,
    topk: int,
    topk_p: jax.Array,  # f32[B, K] (step 0) or f32[B, K, K] (rows x children)
    topk_index: jax.Array,  # i32[B, K] or i32[B, K, K]
    hidden: jax.Array,  # [B, Hd] (step 0) or [B, K, Hd] (per frontier row)
    scores: jax.Array | None,  # f32[B, K] path scores of the frontier rows (None at step 0)
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, DraftLevel]:
    """Chooses the next frontier.

    Returns (input_ids i32[B, K], hidden [B, K, Hd], scores f32[B, K],
    parent_row i32[B, K] (the previous frontier row each new row descends from; -1 at
    step 0), level).
    """
    B = topk_p.shape[0]
    if step == 0:
        level = DraftLevel(
            scores=topk_p[:, None, :],
            tokens=topk_index,
            parents=jnp.broadcast_to(jnp.arange(-1, topk, dtype=jnp.int32), (B, topk + 1)),
        )
        rows = jnp.repeat(hidden[:, None, :], topk, axis=1)
        return topk_index, rows, topk_p, jnp.full((B, topk), -1, jnp.int32), level
    expand = scores[:, :, None] * topk_p  # [B, K, K]
    flat_tokens = topk_index.reshape(B, topk * topk)
    if topk == 1:  # a chain: the one child of the one row, chosen without a top-k or gathers
        cs_p, cs_index = expand.reshape(B, 1), jnp.zeros((B, 1), jnp.int32)
        parent_row, input_ids, rows = cs_index, flat_tokens, hidden
    else:
        cs_p, cs_index = jax.lax.top_k(expand.reshape(B, topk * topk), topk)  # [B, K]
        parent_row = cs_index // topk
        input_ids = jnp.take_along_axis(flat_tokens, cs_index, axis=1)
        rows = jnp.take_along_axis(hidden, parent_row[:, :, None], axis=1)
    level = DraftLevel(
        scores=expand,
        tokens=flat_tokens,
        parents=(cs_index + topk * topk * (step - 1) + topk).astype(jnp.int32),
    )
    return input_ids, rows, cs_p, parent_row.astype(jnp.int32), level


def organize_draft_results(
    levels: list[DraftLevel],
    num_draft_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Keeps the best n-1 candidates (the tree path, SGLang's slow path).

    Returns parent_list i32[B, K*(S-1)+1] (empty [B, 0] when S = 1), top_scores_index
    i32[B, n-1] (ascending), draft_tokens i32[B, n-1].
    """
    B = levels[0].scores.shape[0]
    scores = jnp.concatenate([lv.scores.reshape(B, -1) for lv in levels], axis=1)  # [B, C]
    tokens = jnp.concatenate([lv.tokens for lv in levels], axis=1)  # [B, C]
    _, top_index = jax.lax.top_k(scores, num_draft_tokens - 1)
    top_index = jnp.sort(top_index, axis=-1).astype(jnp.int32)
    draft_tokens = jnp.take_along_axis(tokens, top_index, axis=1)
    if len(levels) > 1:
        parent_list = jnp.concatenate([lv.parents for lv in levels[:-1]], axis=1)
    else:
        parent_list = jnp.zeros((B, 0), jnp.int32)
    return parent_list, top_index, draft_tokens


def chain_constants(batch_size: int, num_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """topk=1: parent_list = [-1, 0, ..., S-2] (width 0 when S = 1), indices = [0..S-1]."""
    width = num_steps if num_steps > 1 else 0
    parents = np.broadcast_to(np.arange(-1, width - 1, dtype=np.int32), (batch_size, width))
    indices = np.broadcast_to(np.arange(num_steps, dtype=np.int32), (batch_size, num_steps))
    return parents, indices


def organize_chain(levels: list[DraftLevel]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """topk=1 fast path of ``organize_draft_results``: constants and a concatenation, no
    top_k / sort / gather (docs/architecture.md#a-chain-compiles-no-tree)."""
    B = levels[0].tokens.shape[0]
    parents, indices = chain_constants(B, len(levels))
    draft_tokens = jnp.concatenate([lv.tokens for lv in levels], axis=1)  # [B, S]
    return jnp.asarray(parents), jnp.asarray(indices), draft_tokens


def organize(levels: list[DraftLevel], topk: int, num_draft_tokens: int):
    """Static dispatch: the chain specialization for topk=1, the sort path otherwise."""
    if topk == 1:
        return organize_chain(levels)
    return organize_draft_results(levels, num_draft_tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    """The verify tree of each request (node 0 = root = the last verified token).

    tokens: i32[B, n]; depth: i32[B, n]; parent: i32[B, n] (-1 for the root);
    mask: bool[B, n, n] (root, ancestors, self); retrieve_index / next_token / next_sibling:
    i32[B, n] as in SGLang (flat verify row, first child, next sibling; -1 = none).
    """

    tokens: jax.Array
    depth: jax.Array
    parent: jax.Array
    mask: jax.Array
    retrieve_index: jax.Array
    next_token: jax.Array
    next_sibling: jax.Array


def build_tree(
    bonus: jax.Array,  # i32[B] root tokens
    parent_list: jax.Array,  # i32[B, K*(S-1)+1]
    top_scores_index: jax.Array,  # i32[B, n-1] ascending
    draft_tokens: jax.Array,  # i32[B, n-1]
    topk: int,
    num_steps: int,
) -> Tree:
    """Links the chosen candidates into a tree (SGLang ``build_tree_kernel_efficient``)."""
    B, m = draft_tokens.shape
    tokens = jnp.concatenate([bonus[:, None].astype(jnp.int32), draft_tokens.astype(jnp.int32)], axis=1)
    if num_steps > 1:
        parent_cand = jnp.take_along_axis(parent_list, top_scores_index // topk, axis=1)  # [B, m]
    else:
        parent_cand = jnp.full((B, m), -1, jnp.int32)
    # The chosen set is closed under ancestors, so a non-root parent is itself chosen.
    hit = top_scores_index[:, None, :] == parent_cand[:, :, None]  # [B, m, m]
    parent_node = jnp.where(top_scores_index // topk == 0, 0, 1 + jnp.argmax(hit, axis=-1))
    parent = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), parent_node.astype(jnp.int32)], axis=1)
    return link_tree(tokens, parent, num_steps)


# A node whose parent is DETACHED is no node's child: the tree walks never reach it (nor its
# descendants). Fixed-shape trees use it for slots they have nothing to put in.
DETACHED = -2


def link_tree(
    tokens: jax.Array,  # i32[B, n] root first
    parent: jax.Array,  # i32[B, n] parent node of each node (-1 for the root, DETACHED for unused slots)
    max_depth: int,  # deepest node (walks up at most this many levels)
) -> Tree:
    """A ``Tree`` from its parent array: depth, ancestor mask (root, ancestors, self) and links.
    A detached node gets depth 1 and sees only itself (its outputs are never used)."""
    B, n = tokens.shape
    eye = jnp.eye(n, dtype=bool)
    mask = jnp.broadcast_to(eye, (B, n, n))
    depth = jnp.zeros((B, n), jnp.int32)
    cur = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, n))
    for _ in range(max_depth):
        moving = cur > 0
        up = jnp.where(moving, jnp.take_along_axis(parent, jnp.maximum(cur, 0), axis=1), 0)
        mask = mask | (moving[:, :, None] & (jnp.arange(n)[None, None, :] == up[:, :, None]))
        depth = depth + moving
        cur = up
    return Tree(tokens=tokens, depth=depth, parent=parent, mask=mask, **_links(parent))


def truncate(tree: Tree, m: int) -> Tree:
    """The first ``m`` nodes of ``tree`` (a tree: every builder here numbers parents before
    children)."""
    if m == tree.tokens.shape[1]:
        return tree
    parent = tree.parent[:, :m]
    return Tree(tokens=tree.tokens[:, :m], depth=tree.depth[:, :m], parent=parent, mask=tree.mask[:, :m, :m],
                **_links(parent))


def chain_tree(bonus: jax.Array, draft_tokens: jax.Array) -> Tree:
    """The topk=1 tree, built statically: node i has parent i-1 and depth i."""
    B, m = draft_tokens.shape
    n = m + 1
    tokens = jnp.concatenate([bonus[:, None].astype(jnp.int32), draft_tokens.astype(jnp.int32)], axis=1)
    idx = np.arange(n, dtype=np.int32)
    parent = jnp.asarray(np.broadcast_to(idx - 1, (B, n)))
    return Tree(
        tokens=tokens,
        depth=jnp.asarray(np.broadcast_to(idx, (B, n))),
        parent=parent,
        mask=jnp.asarray(np.broadcast_to(np.tril(np.ones((n, n), bool)), (B, n, n))),
        **_links(parent),
    )


def block_tree(
    bonus: jax.Array,  # i32[B] root tokens
    tokens: jax.Array,  # i32[B, S, k] candidates of each block position, best first (column 0: the chain)
    probs: jax.Array,  # f32[B, S, k] their draft probabilities
    num_draft_tokens: int,
) -> Tree:
    """The tree of one block forward: the top-1 chain ``tokens[:, :, 0]``, and at every position
    ``t`` the candidates ``1..k-1`` as extra leaves hanging from the chain node before it (the
    root for ``t = 0``): at most ``1 + S * k`` nodes.

    With fewer nodes (``num_draft_tokens``), the best ``n - 1`` candidates by path score are kept
    (the product of the chain's probabilities before ``t`` and the candidate's own). A score
    never exceeds its parent's and a parent's flat index ``(t - 1) * k`` precedes its children's,
    so the kept set is closed under ancestors. Nodes follow ascending flat index ``t * k + j``.
    """
    B, S, k = tokens.shape
    m = num_draft_tokens - 1
    chain_p = jnp.cumprod(probs[:, :, 0], axis=1)  # [B, S] path score of the chain node at t
    before = jnp.concatenate([jnp.ones((B, 1), probs.dtype), chain_p[:, :-1]], axis=1)  # [B, S]
    scores = (before[:, :, None] * probs).reshape(B, S * k)
    flat = tokens.reshape(B, S * k)
    if m == S * k:
        index = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (B, m))
    else:
        _, index = jax.lax.top_k(scores, m)
        index = jnp.sort(index, axis=-1).astype(jnp.int32)  # [B, m]
    pos = index // k  # block position t of each node (depth t + 1)
    draft_tokens = jnp.take_along_axis(flat, index, axis=1)
    # Parent: the chain node (t - 1, 0), i.e. flat index (t - 1) * k, or the root for t = 0.
    parent_flat = (pos - 1) * k
    hit = index[:, None, :] == parent_flat[:, :, None]  # [B, m, m]
    parent_node = jnp.where(pos == 0, 0, 1 + jnp.argmax(hit, axis=-1)).astype(jnp.int32)
    parent = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), parent_node], axis=1)  # [B, n]
    # Ancestors of node (t, j): the root, the chain nodes (t', 0) with t' < t, and itself.
    pos_n = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), pos], axis=1)  # [B, n] (root: -1)
    is_chain = jnp.concatenate([jnp.ones((B, 1), bool), index % k == 0], axis=1)  # root counts as chain
    n = m + 1
    eye = jnp.eye(n, dtype=bool)[None]
    mask = eye | (is_chain[:, None, :] & (pos_n[:, None, :] < pos_n[:, :, None]))  # [B, n (row), n (ancestor)]
    all_tokens = jnp.concatenate([bonus[:, None].astype(jnp.int32), draft_tokens.astype(jnp.int32)], axis=1)
    return Tree(tokens=all_tokens, depth=pos_n + 1, parent=parent, mask=mask, **_links(parent))


def _links(parent: jax.Array) -> dict[str, jax.Array]:
    """retrieve_index / next_token (first child) / next_sibling from the parent array."""
    B, n = parent.shape
    idx = jnp.arange(n, dtype=jnp.int32)
    is_child = parent[:, None, :] == idx[None, :, None]  # [B, parent i, child j]
    first_child = jnp.where(jnp.any(is_child, axis=-1), jnp.argmax(is_child, axis=-1), -1)
    same_parent = (parent[:, :, None] == parent[:, None, :]) & (idx[None, None, :] > idx[None, :, None])
    same_parent = same_parent & (idx[None, :, None] > 0) & (parent[:, :, None] >= 0)  # root, detached: none
    next_sib = jnp.where(jnp.any(same_parent, axis=-1), jnp.argmax(same_parent, axis=-1), -1)
    retrieve = jnp.arange(B, dtype=jnp.int32)[:, None] * n + idx[None, :]
    return dict(
        retrieve_index=retrieve, next_token=first_child.astype(jnp.int32), next_sibling=next_sib.astype(jnp.int32)
    )
