"""Greedy verification: walk the tree along the target's argmax (exact, hence lossless).

Outputs follow SGLang: ``accept_index i32[B, S+1]`` (verify node of each accepted token,
-1 padded), ``accept_lens i32[B]`` (accepted drafts + 1 bonus), ``predict i32[B, n]`` (the
token emitted after each node). Emitted tokens are ``predict[b, accept_index[b, :accept_lens[b]]]``.

Every function takes an optional ``limit i32[B]``: row b proposes only its first ``limit[b]``
nodes (a ``VerifyPrefix``'s ``wanted``: the step verified more for the batch's sake). Nodes past
it are treated as never proposed: never accepted, and a sampled bonus at the limit is drawn
from the target's own distribution there, as at the end of a full chain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.sampling.distributions import sample_with_uniform
from jaxspec.spec.tree import Tree


def proposed(n: int, limit: jax.Array | None) -> jax.Array:  # -> bool[B or 1, n]
    """Nodes each row proposes: the first ``limit`` (all without one)."""
    idx = jnp.arange(n, dtype=jnp.int32)[None, :]
    return idx >= 0 if limit is None else idx < limit[:, None]


def verify_tree_greedy(
    tree: Tree,
    target_predict: jax.Array,  # i32[B, n] argmax of the target logits at each node
    num_steps: int,
    limit: jax.Array | None = None,  # i32[B]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Descends from the root: at each level accept the first child (ascending node index,
    i.e. highest score first) whose token equals the target's argmax after its parent."""
    B, n = tree.tokens.shape
    idx = jnp.arange(n, dtype=jnp.int32)[None, :]
    valid = proposed(n, limit) & (idx > 0)
    last = jnp.zeros((B,), jnp.int32)
    alive = jnp.ones((B,), bool)
    cols = [last]
    for _ in range(num_steps):
        want = jnp.take_along_axis(target_predict, last[:, None], axis=1)  # [B, 1]
        match = (tree.parent == last[:, None]) & (tree.tokens == want) & valid
        alive = alive & jnp.any(match, axis=1)
        child = jnp.argmax(match, axis=1).astype(jnp.int32)
        cols.append(jnp.where(alive, child, -1))
        last = jnp.where(alive, child, last)
    accept_index = jnp.stack(cols, axis=1)  # [B, S+1]
    accept_lens = jnp.sum(accept_index >= 0, axis=1).astype(jnp.int32)
    return accept_index, accept_lens, target_predict


def verify_chain_greedy(
    tokens: jax.Array,  # i32[B, n] root + S chain tokens
    target_predict: jax.Array,  # i32[B, n]
    limit: jax.Array | None = None,  # i32[B]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """topk=1: the accepted prefix is the run of leading matches (no tree walk)."""
    B, n = tokens.shape
    match = (tokens[:, 1:] == target_predict[:, :-1]) & proposed(n, limit)[:, 1:]  # [B, n-1]
    run = jnp.cumprod(match.astype(jnp.int32), axis=1)
    accept_lens = 1 + jnp.sum(run, axis=1).astype(jnp.int32)
    idx = jnp.arange(n, dtype=jnp.int32)[None, :]
    accept_index = jnp.where(idx < accept_lens[:, None], idx, -1)
    return accept_index, accept_lens, target_predict


def emitted_tokens(
    predict: jax.Array,  # i32[B, n]
    accept_index: jax.Array,  # i32[B, S+1]
) -> jax.Array:  # i32[B, S+1] (entries past accept_lens are garbage)
    return jnp.take_along_axis(predict, jnp.maximum(accept_index, 0), axis=1)


# ---------------------------------------------------------------- sampling (temperature > 0)


def verify_tree_target_only(
    tree: Tree,
    probs: jax.Array,  # f32[B, n, V] target distribution after each node
    coins: jax.Array,  # f32[B, n] one uniform per node (used to choose among its children)
    coin_final: jax.Array,  # f32[B] uniform for the last token
    num_steps: int,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    limit: jax.Array | None = None,  # i32[B]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """SGLang's ``tree_speculative_sampling_target_only``.

    At node x, the children are scanned in sibling order accumulating their target
    probabilities; child c is accepted when ``coin[x] < acc / threshold_acc`` or its own
    probability >= ``threshold_single``. If no child is accepted, the last token is drawn
    from the target distribution at x with the scanned children removed. With both
    thresholds at 1 this is inverse-CDF sampling of one token from p: exact. Lower
    thresholds accept more and are lossy.
    """
    B, n, V = probs.shape
    idx = jnp.arange(n, dtype=jnp.int32)[None, :]
    valid = proposed(n, limit) & (idx > 0)
    rows = jnp.arange(B)[:, None]
    p_child = probs[rows, jnp.maximum(tree.parent, 0), tree.tokens]  # [B, n]: p(token | parent)
    predict = jnp.zeros((B, n), jnp.int32)
    last = jnp.zeros((B,), jnp.int32)
    alive = jnp.ones((B,), bool)
    rejected_at_last = jnp.zeros((B,), bool)
    cols = [last]
    for _ in range(num_steps):
        children = (tree.parent == last[:, None]) & valid  # [B, n], ascending = sibling order
        acc = jnp.cumsum(jnp.where(children, p_child, 0.0), axis=1)
        coin = jnp.take_along_axis(coins, last[:, None], axis=1)
        ok = children & ((coin < acc / max(threshold_acc, 1e-9)) | (p_child >= threshold_single))
        hit = jnp.any(ok, axis=1) & alive
        child = jnp.argmax(ok, axis=1).astype(jnp.int32)
        rejected_at_last = rejected_at_last | (alive & ~hit & jnp.any(children, axis=1))
        predict = jnp.where(
            hit[:, None] & (idx == last[:, None]), jnp.take_along_axis(tree.tokens, child[:, None], axis=1), predict
        )
        cols.append(jnp.where(hit, child, -1))
        last = jnp.where(hit, child, last)
        alive = hit
    accept_index = jnp.stack(cols, axis=1)
    accept_lens = jnp.sum(accept_index >= 0, axis=1).astype(jnp.int32)
    # Last token: p at the last accepted node minus the children scanned there (if it rejected).
    p_last = jnp.take_along_axis(probs, last[:, None, None], axis=1)[:, 0]  # [B, V]
    scanned = (tree.parent == last[:, None]) & valid & rejected_at_last[:, None]  # [B, n]
    removed = jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], tree.tokens].max(scanned)
    final = sample_with_uniform(jnp.where(removed, 0.0, p_last), coin_final, fallback=p_last)
    predict = jnp.where(idx == last[:, None], final[:, None], predict)
    return accept_index, accept_lens, predict


def verify_chain_rejection(
    tokens: jax.Array,  # i32[B, n] root + S drafted tokens (x_1..x_S)
    draft_probs: jax.Array,  # f32[B, S, V] q_j: the distribution x_j was drawn from
    probs: jax.Array,  # f32[B, n, V] p_j: the target distribution after node j
    coins: jax.Array,  # f32[B, S]
    coin_final: jax.Array,  # f32[B]
    limit: jax.Array | None = None,  # i32[B]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Speculative sampling (Leviathan et al.) on a chain: accept x_j with probability
    min(1, p(x_j) / q(x_j)); at the first rejection draw from norm(max(0, p - q)); if all
    (of the row's ``limit``) are accepted draw the bonus from p. The output is distributed
    exactly as p. (q: draft prob, p: target prob.)"""
    B, n = tokens.shape
    S = n - 1
    x = tokens[:, 1:]  # [B, S]
    p_x = jnp.take_along_axis(probs[:, :S], x[:, :, None], axis=2)[..., 0]  # p_{j-1}(x_j)
    q_x = jnp.take_along_axis(draft_probs, x[:, :, None], axis=2)[..., 0]  # q_j(x_j)
    valid = jnp.broadcast_to(proposed(n, limit)[:, 1:], (B, S))
    ok = (coins * q_x < p_x) & valid
    run = jnp.cumprod(ok.astype(jnp.int32), axis=1)
    num_ok = jnp.sum(run, axis=1).astype(jnp.int32)  # accepted drafts
    accept_lens = num_ok + 1
    idx = jnp.arange(n, dtype=jnp.int32)[None, :]
    accept_index = jnp.where(idx < accept_lens[:, None], idx, -1)
    p_last = jnp.take_along_axis(probs, num_ok[:, None, None], axis=1)[:, 0]  # [B, V]
    q_pad = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)  # q_{S+1} = 0
    q_last = jnp.take_along_axis(q_pad, num_ok[:, None, None], axis=1)[:, 0]
    # Stopped by the limit rather than a rejection: nothing was proposed there, draw from p.
    rejected = jnp.take_along_axis(jnp.pad(valid, ((0, 0), (0, 1))), num_ok[:, None], axis=1)  # [B, 1]
    q_last = jnp.where(rejected, q_last, 0.0)
    residual = jnp.maximum(p_last - q_last, 0.0)
    final = sample_with_uniform(residual, coin_final, fallback=p_last)
    predict = jnp.concatenate([x, jnp.zeros((B, 1), jnp.int32)], axis=1)
    predict = jnp.where(idx == num_ok[:, None], final[:, None], predict)
    return accept_index, accept_lens, predict
