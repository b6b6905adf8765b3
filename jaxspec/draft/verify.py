"""Greedy verification: walk the tree along the target's argmax (exact, hence lossless).

Outputs follow SGLang: ``accept_index i32[B, S+1]`` (verify node of each accepted token,
-1 padded), ``accept_lens i32[B]`` (accepted drafts + 1 bonus), ``predict i32[B, n]`` (the
token emitted after each node). Emitted tokens are ``predict[b, accept_index[b, :accept_lens[b]]]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.draft.tree import Tree


def verify_tree_greedy(
    tree: Tree,
    target_predict: jax.Array,  # i32[B, n] argmax of the target logits at each node
    num_steps: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Descends from the root: at each level accept the first child (ascending node index,
    i.e. highest score first) whose token equals the target's argmax after its parent."""
    B, n = tree.tokens.shape
    idx = jnp.arange(n, dtype=jnp.int32)[None, :]
    last = jnp.zeros((B,), jnp.int32)
    alive = jnp.ones((B,), bool)
    cols = [last]
    for _ in range(num_steps):
        want = jnp.take_along_axis(target_predict, last[:, None], axis=1)  # [B, 1]
        match = (tree.parent == last[:, None]) & (tree.tokens == want) & (idx > 0)
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
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """topk=1: the accepted prefix is the run of leading matches (no tree walk)."""
    B, n = tokens.shape
    match = tokens[:, 1:] == target_predict[:, :-1]  # [B, n-1]
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
