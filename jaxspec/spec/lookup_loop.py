"""The lookup draft loop: n-gram matching in each request's own token history (prompt lookup),
on device, with static shapes (``NgramDraft``).

    prefill   the history is the prompt and the first token
    propose   match the history's last k tokens (k = max_ngram .. min_ngram) against its earlier
              positions; a chain proposes what followed the most recent longest match, a tree
              the continuations of up to topk matches whose next tokens differ, one path each
    extend    append the step's emitted tokens (accepted drafts + bonus) to the history

A continuation that runs into the present repeats with its period (the match at q predicts
position L + i from q + 1 + i, which for i >= L - q - 1 is itself a drafted position), so a
recent match still proposes num_steps tokens. A row with no match drafts nothing; a step in
which no active row drafted verifies the root alone (``jaxspec.spec.step``). With
``NgramConfig.adaptive`` a chain after a match of k tokens asks for min(num_steps, 2**k) of its
tokens to be verified: short matches predict short runs, and verifying costs per token.

Glossary: B rows, M history width, L valid history length (= seq_len + 1, the root included),
K paths (topk), S num_steps, n num_draft_tokens, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.spec import tree as tree_lib
from jaxspec.spec.plan import Plan, StepRows, VerifyPrefix
from jaxspec.model.config import padded_vocab_size
from jaxspec.model.drafts.base import DraftContext
from jaxspec.model.drafts.ngram import NgramConfig, NgramSeed


def match_lengths(
    history: jax.Array,  # i32[B, M]
    length: jax.Array,  # i32[B] L
    max_ngram: int,
    min_ngram: int,
) -> jax.Array:  # i32[B, M]
    """For each end position q, the longest k in [min_ngram, max_ngram] such that the k tokens
    ending at q equal the history's last k tokens (0: none). Only q <= L - 2 count: a match
    needs a token after it, and the suffix itself is no match."""
    B, M = history.shape
    q = jnp.arange(M, dtype=jnp.int32)[None, :]
    last = length - 1
    same = jnp.ones((B, M), bool)
    best = jnp.zeros((B, M), jnp.int32)
    for i in range(max_ngram):
        # history[q - i] against history[last - i], both inside the history.
        earlier = jnp.pad(history, ((0, 0), (i, 0)))[:, :M]  # [B, M]: earlier[:, q] = history[:, q - i]
        suffix = jnp.take_along_axis(history, jnp.maximum(last - i, 0)[:, None], axis=1)  # [B, 1]
        same = same & (q >= i) & (last - i >= 0)[:, None] & (earlier == suffix)
        if i + 1 >= min_ngram:
            best = jnp.where(same, i + 1, best)
    return jnp.where(q < last[:, None], best, 0)


def pick_matches(
    history: jax.Array,  # i32[B, M]
    best: jax.Array,  # i32[B, M] from match_lengths
    num: int,
) -> tuple[jax.Array, jax.Array]:  # start i32[B, num], match length i32[B, num] (0: none)
    """Up to ``num`` matches, longest first and most recent among equals, whose next tokens
    differ (so the paths they start are distinct siblings). ``start``: where each continuation
    begins (the position after the match)."""
    B, M = history.shape
    q = jnp.arange(M, dtype=jnp.int32)[None, :]
    score = jnp.where(best > 0, best * M + q, -1)  # [B, M]
    after = jnp.pad(history[:, 1:], ((0, 0), (0, 1)))  # [B, M]: the token following each end position
    starts, lengths = [], []
    for _ in range(num):
        end = jnp.argmax(score, axis=1).astype(jnp.int32)  # [B]
        top = jnp.take_along_axis(score, end[:, None], axis=1)[:, 0]
        lengths.append(jnp.where(top >= 0, top // M, 0))
        starts.append(end + 1)
        first = jnp.take_along_axis(after, end[:, None], axis=1)  # [B, 1]
        score = jnp.where(after == first, -1, score)  # one path per first token
    return jnp.stack(starts, axis=1), jnp.stack(lengths, axis=1)


def continuation(
    history: jax.Array,  # i32[B, M]
    length: jax.Array,  # i32[B] L
    start: jax.Array,  # i32[B] first position of the continuation (<= L - 1)
    count: int,
) -> jax.Array:  # i32[B, count]
    """The ``count`` tokens from ``start`` on, repeating with period L - start past the present."""
    period = jnp.maximum(length - start, 1)
    idx = start[:, None] + jnp.arange(count, dtype=jnp.int32)[None, :] % period[:, None]
    return jnp.take_along_axis(history, jnp.clip(idx, 0, history.shape[1] - 1), axis=1)


def ngram_paths(
    cfg: NgramConfig,
    history: jax.Array,  # i32[B, M]
    length: jax.Array,  # i32[B] L
    path_lengths: tuple[int, ...],
) -> tuple[list[jax.Array], jax.Array]:  # tokens [B, path_lengths[j]] per path, match length i32[B, K]
    """The continuations of the best ``len(path_lengths)`` matches (``pick_matches``) and the
    length of each match (0: no path)."""
    best = match_lengths(history, length, cfg.max_ngram, cfg.min_ngram)
    start, match = pick_matches(history, best, len(path_lengths))
    paths = [continuation(history, length, start[:, j], n) for j, n in enumerate(path_lengths)]
    return paths, match


def prefix_for(
    cfg: NgramConfig,
    match: jax.Array,  # i32[B] length of the match a branch continues (0: none)
    base: int,  # nodes verified in any case (the root; a hybrid's model tree)
    limit: int,  # the branch's static length
) -> VerifyPrefix:
    """How much of a chain-like branch to verify: ``base + cfg.draft_len(k, limit)`` nodes after a
    match of k tokens, among the static sizes those lengths give."""
    lens = [cfg.draft_len(k, limit) for k in range(cfg.max_ngram + 1)]  # index: match length (0: none)
    lens = [n if k == 0 or k >= cfg.min_ngram else 0 for k, n in enumerate(lens)]
    wanted = base + jnp.asarray(lens, jnp.int32)[match]
    return VerifyPrefix(wanted=wanted, sizes=tuple(sorted({base + n for n in lens})))


def path_lengths(num_nodes: int, num_paths: int, max_len: int) -> tuple[int, ...]:
    """Nodes of each path (static): the first (the most recent longest match) as deep as allowed,
    the others sharing the rest evenly, earlier paths first."""
    first = min(max_len, num_nodes - (num_paths - 1))
    rest, extra = divmod(num_nodes - first, num_paths - 1) if num_paths > 1 else (0, 0)
    out = (first,) + tuple(rest + (j < extra) for j in range(num_paths - 1))
    assert sum(out) == num_nodes and all(1 <= n <= max_len for n in out), (num_nodes, num_paths, max_len, out)
    return out


def paths_tree(
    bonus: jax.Array,  # i32[B] root tokens
    paths: list[jax.Array],  # i32[B, L_j] per path
    found: jax.Array,  # bool[B, K] which paths hold a real continuation
    max_depth: int,
) -> tree_lib.Tree:
    """The verify tree of K paths hanging from the root (a chain when K = 1). Nodes are laid out
    path after path; a path without a continuation is detached (never accepted)."""
    if len(paths) == 1:
        return tree_lib.chain_tree(bonus, paths[0])
    B = bonus.shape[0]
    lengths = [p.shape[1] for p in paths]
    firsts = np.cumsum([1] + lengths[:-1])  # node index of each path's first token
    parent = np.arange(-1, sum(lengths), dtype=np.int32)  # within a path: the previous node
    parent[firsts] = 0
    path_of_first = np.full(len(parent), -1)
    path_of_first[firsts] = np.arange(len(paths))
    is_first = jnp.asarray(path_of_first >= 0)[None, :]
    found_here = jnp.take_along_axis(found, jnp.asarray(np.maximum(path_of_first, 0))[None, :].repeat(B, 0), axis=1)
    parent = jnp.where(is_first & ~found_here, tree_lib.DETACHED, jnp.asarray(parent)[None, :])  # [B, n]
    tokens = jnp.concatenate([bonus[:, None].astype(jnp.int32)] + [p.astype(jnp.int32) for p in paths], axis=1)
    return tree_lib.link_tree(tokens, parent, max_depth)


def append_emitted(
    history: jax.Array,  # i32[B, M]
    seq_lens: jax.Array,  # i32[B] the root's position
    emitted: jax.Array,  # i32[B, A] accepted drafts then the bonus
    accept_lens: jax.Array,  # i32[B] how many of them count
) -> jax.Array:  # i32[B, M]
    B, A = emitted.shape
    j = jnp.arange(A, dtype=jnp.int32)[None, :]
    cols = jnp.where(j < accept_lens[:, None], seq_lens[:, None] + 1 + j, history.shape[1])  # past M: dropped
    return history.at[jnp.arange(B)[:, None], cols].set(emitted.astype(jnp.int32), mode="drop")


def prompt_history(
    empty: jax.Array,  # i32[R, M] zeros
    tokens: jax.Array,  # i32[R, T] prompts, right-padded
    lens: jax.Array,  # i32[R]
    first: jax.Array,  # i32[R] the first generated token (the first root)
) -> jax.Array:  # i32[R, M]
    R, T = tokens.shape
    col = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (R, T))
    col = jnp.where(col < lens[:, None], col, empty.shape[1])
    history = empty.at[jnp.arange(R)[:, None], col].set(tokens.astype(jnp.int32), mode="drop")
    return history.at[jnp.arange(R), lens].set(first.astype(jnp.int32), mode="drop")


def whole_context(tokens, lens, ctx: DraftContext):
    """A prefill's whole contexts (tokens, lens): ``tokens`` / ``lens`` may be their uncached suffixes."""
    return (tokens, lens) if ctx.context is None else ctx.context


class Lookup:
    """Drives ``NgramDraft``: no forward, no KV; the seed is the token history."""

    @staticmethod
    def propose(plan: Plan, dparams, rows: StepRows, dpool, ctx: DraftContext):
        """-> (tree, one-hot q f32[B, S, V] for chain sampling else None, VerifyPrefix, dpool).

        A chain is verified as far as its match length asks (``NgramConfig.draft_len``), a tree
        whole; either only the root when no row matched."""
        spec, cfg = plan.spec, plan.draft.model
        n = spec.num_draft_tokens
        lengths = path_lengths(n - 1, spec.topk, spec.num_steps)
        paths, match = ngram_paths(cfg, rows.seed.history, rows.seq_lens + 1, lengths)
        tree = paths_tree(rows.bonus, paths, match > 0, spec.num_steps)
        if spec.topk == 1:
            prefix = prefix_for(cfg, match[:, 0], 1, spec.num_steps)
        else:
            prefix = VerifyPrefix(wanted=jnp.where(match[:, 0] > 0, n, 1), sizes=(1, n))
        # A deterministic proposal is a one-hot q: rejection sampling accepts x with p(x) and
        # resamples from p without x, exactly the target's distribution.
        q_all = jax.nn.one_hot(tree.tokens[:, 1:], padded_vocab_size(plan.target)) if plan.draft_samples else None
        return tree, q_all, prefix, dpool

    @staticmethod
    def feature(plan: Plan, out):
        return None

    @staticmethod
    def extend(plan: Plan, dparams, rows: StepRows, predict, feature, accept_lens, dpool, ctx: DraftContext):
        """predict: i32[B, A] emitted tokens (front-compacted). -> (bonus i32[B], NgramSeed, dpool)."""
        bonus = jnp.take_along_axis(predict, (accept_lens - 1)[:, None], axis=1)[:, 0]
        return bonus, NgramSeed(append_emitted(rows.seed.history, rows.seq_lens, predict, accept_lens)), dpool

    @staticmethod
    def prefill(plan: Plan, dparams, tokens, lens, first, out, dpool, ctx: DraftContext, seed: NgramSeed):
        return NgramSeed(prompt_history(seed.history, *whole_context(tokens, lens, ctx), first)), dpool
