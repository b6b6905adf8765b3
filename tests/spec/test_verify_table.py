"""Table-driven unit tests of acceptance and commit (tpu-inference style): each case states its
inputs and the expected outputs by hand, and every case also runs ``_padded``: placed in a
batch between two filler rows of other contents (and, for chains, with junk after the first
mismatch), which must not change its result."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.spec import tree as tree_lib
from jaxspec.spec.step import StepOutput
from jaxspec.spec.verify import (
    verify_chain_greedy,
    verify_chain_rejection,
    verify_tree_greedy,
    verify_tree_target_only,
)
from jaxspec.engine.state import DecodeState, commit
from jaxspec.model.drafts.base import DraftSeed
from jaxspec.sampling.distributions import RowSampling, pick_tokens, target_probs


def with_padded(cases):
    """Each case as is and as ``<name>_padded``."""
    out = []
    for c in cases:
        out.append(pytest.param(c, False, id=c.name))
        out.append(pytest.param(c, True, id=c.name + "_padded"))
    return out


# ----------------------------------------------------------------------------- chain, greedy


@dataclasses.dataclass(frozen=True)
class ChainCase:
    name: str
    tokens: list[int]  # root + drafted tokens
    target: list[int]  # target argmax after each node
    accept_lens: int  # expected


CHAIN_CASES = [
    ChainCase("all_accepted", [9, 1, 2, 3], [1, 2, 3, 4], 4),
    ChainCase("first_rejected", [9, 1, 2, 3], [5, 2, 3, 4], 1),
    ChainCase("middle_rejected_later_match_ignored", [9, 1, 2, 3], [1, 7, 3, 4], 2),
    ChainCase("last_rejected", [9, 1, 2, 3], [1, 2, 0, 4], 3),
    ChainCase("single_draft", [9, 1], [1, 6], 2),
]


@pytest.mark.parametrize("case,padded", with_padded(CHAIN_CASES))
def test_verify_chain_greedy(case: ChainCase, padded: bool):
    tokens, target = list(case.tokens), list(case.target)
    n = len(tokens)
    if padded and case.accept_lens < n:  # junk after the first mismatch must not matter
        k = case.accept_lens
        tokens = tokens[: k + 1] + [(t + 3) % 50 for t in tokens[k + 1:]]
    rows = [tokens]
    targets = [target]
    if padded:
        rows = [[4] * n, tokens, [8] * n]
        targets = [[4] * n, target, [0] * n]
    idx, lens, predict = verify_chain_greedy(jnp.asarray(rows, jnp.int32), jnp.asarray(targets, jnp.int32))
    r = 1 if padded else 0
    assert int(lens[r]) == case.accept_lens
    want_idx = [j if j < case.accept_lens else -1 for j in range(n)]
    assert np.asarray(idx[r]).tolist() == want_idx
    emitted = np.asarray(predict[r])[: case.accept_lens].tolist()
    assert emitted == target[: case.accept_lens]  # accepted drafts, then the bonus
    if padded:
        assert np.asarray(lens).tolist() == [n, case.accept_lens, 1]


# ----------------------------------------------------------------------------- tree, greedy


def tree_from_parents(tokens: list[int], parents: list[int]) -> tree_lib.Tree:
    """A one-request verify tree from explicit node tokens and parents (parent -1 = root)."""
    n = len(tokens)
    depth = [0] * n
    mask = np.eye(n, dtype=bool)
    for i in range(1, n):
        p = parents[i]
        depth[i] = depth[p] + 1
        mask[i] = mask[p]
        mask[i, i] = True
    parent = jnp.asarray([parents], jnp.int32)
    return tree_lib.Tree(tokens=jnp.asarray([tokens], jnp.int32), depth=jnp.asarray([depth], jnp.int32),
                         parent=parent, mask=jnp.asarray(mask[None]), **tree_lib._links(parent))


def stack_trees(trees: list[tree_lib.Tree]) -> tree_lib.Tree:
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *trees)


@dataclasses.dataclass(frozen=True)
class TreeCase:
    name: str
    tokens: list[int]  # node tokens, node 0 = root
    parents: list[int]
    target: list[int]  # target argmax after each node
    accept_index: list[int]  # expected accepted nodes (then -1)


TREE_CASES = [
    #        0    1  2  3  4        (1, 2 children of the root; 3 child of 1; 4 child of 3)
    TreeCase("root_only", [9, 5, 6, 8, 7], [-1, 0, 0, 1, 3], [3, 0, 0, 0, 0], [0]),
    TreeCase("second_sibling", [9, 5, 6, 8, 7], [-1, 0, 0, 1, 3], [6, 0, 0, 0, 0], [0, 2]),
    TreeCase("deep_path", [9, 5, 6, 8, 7], [-1, 0, 0, 1, 3], [5, 8, 0, 7, 1], [0, 1, 3, 4]),
    TreeCase("first_equal_sibling_wins", [9, 5, 5, 8, 7], [-1, 0, 0, 2, 1], [5, 7, 8, 0, 2], [0, 1, 4]),
    TreeCase("mismatch_deeper", [9, 5, 6, 8, 7], [-1, 0, 0, 1, 3], [5, 2, 0, 7, 1], [0, 1]),
]


@pytest.mark.parametrize("case,padded", with_padded(TREE_CASES))
def test_verify_tree_greedy(case: TreeCase, padded: bool):
    S = 3
    tree = tree_from_parents(case.tokens, case.parents)
    target = jnp.asarray([case.target], jnp.int32)
    if padded:
        filler = tree_from_parents([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3])
        tree = stack_trees([filler, tree, filler])
        target = jnp.concatenate([jnp.asarray([[2, 3, 4, 5, 6]]), target, jnp.asarray([[0, 0, 0, 0, 0]])])
    idx, lens, _ = verify_tree_greedy(tree, target, S)
    r = 1 if padded else 0
    want = case.accept_index + [-1] * (S + 1 - len(case.accept_index))
    assert np.asarray(idx[r]).tolist() == want
    assert int(lens[r]) == len(case.accept_index)
    if padded:
        assert np.asarray(lens).tolist() == [4, len(case.accept_index), 1]


# ----------------------------------------------------------------------------- sampling


def onehot(v: int, V: int = 4) -> list[float]:
    return [1.0 if i == v else 0.0 for i in range(V)]


@dataclasses.dataclass(frozen=True)
class RejectionCase:
    name: str
    tokens: list[int]  # root + drafted x_1..x_S
    q: list[list[float]]  # q_j the draft distribution x_j was drawn from, [S, V]
    p: list[list[float]]  # target distribution after each node, [S + 1, V]
    coins: list[float]  # [S]
    coin_final: float
    accept_lens: int
    final: int  # the token emitted after the accepted drafts


REJECTION_CASES = [
    # p >= q on the drafted token: always accepted; the bonus comes from p after the last node.
    RejectionCase("accept_all_bonus_from_p", [0, 1, 2], [onehot(1), onehot(2)], [onehot(1), onehot(2), onehot(3)],
                  [0.99, 0.99], 0.5, 3, 3),
    # p(x1) = 0.25 < q(x1) = 1: accepted iff coin < 0.25; rejected here, the residual
    # max(p - q, 0) leaves tokens 0, 2, 3 (mass 0.75); coin_final 0.5 * 0.75 lands on token 2.
    RejectionCase("reject_draws_from_residual", [0, 1, 2], [onehot(1), onehot(2)],
                  [[0.25] * 4, onehot(2), onehot(3)], [0.3, 0.0], 0.5, 1, 2),
    RejectionCase("accept_by_coin", [0, 1, 2], [onehot(1), onehot(2)], [[0.25] * 4, onehot(0), onehot(3)],
                  [0.2, 0.0], 0.1, 2, 0),
]


@pytest.mark.parametrize("case,padded", with_padded(REJECTION_CASES))
def test_verify_chain_rejection(case: RejectionCase, padded: bool):
    args = [jnp.asarray([case.tokens], jnp.int32), jnp.asarray([case.q], jnp.float32),
            jnp.asarray([case.p], jnp.float32), jnp.asarray([case.coins], jnp.float32),
            jnp.asarray([case.coin_final], jnp.float32)]
    if padded:  # a filler row on each side, its own contents
        S = len(case.coins)
        filler = [jnp.asarray([[3] * (S + 1)], jnp.int32), jnp.asarray([[onehot(3)] * S], jnp.float32),
                  jnp.asarray([[onehot(3)] * (S + 1)], jnp.float32), jnp.zeros((1, S)), jnp.zeros((1,))]
        args = [jnp.concatenate([f, a, f]) for f, a in zip(filler, args)]
    idx, lens, predict = verify_chain_rejection(*args)
    r = 1 if padded else 0
    assert int(lens[r]) == case.accept_lens
    assert int(predict[r, case.accept_lens - 1]) == case.final
    assert np.asarray(predict[r, : case.accept_lens - 1]).tolist() == case.tokens[1: case.accept_lens]


@pytest.mark.parametrize("padded", [False, True], ids=["target_only", "target_only_padded"])
def test_verify_tree_target_only(padded: bool):
    """Root children 1 (token 1) and 2 (token 2); p at the root = [0.1, 0.3, 0.2, 0.4]. The
    children are scanned in order accumulating p: coin 0.35 passes child 1 (cum 0.3) and lands
    on child 2 (cum 0.5): accepted. Node 2 has no children, so the last token is drawn from p
    after node 2 (one-hot 3)."""
    tree = tree_from_parents([0, 1, 2], [-1, 0, 0])
    p = jnp.asarray([[[0.1, 0.3, 0.2, 0.4], onehot(0), onehot(3)]], jnp.float32)
    coins = jnp.asarray([[0.35, 0.0, 0.0]], jnp.float32)
    final = jnp.asarray([0.5], jnp.float32)
    if padded:
        filler = tree_from_parents([3, 3, 3], [-1, 0, 1])
        tree = stack_trees([filler, tree, filler])
        p = jnp.concatenate([jnp.asarray([[onehot(3)] * 3], jnp.float32), p, jnp.asarray([[onehot(3)] * 3])])
        coins = jnp.concatenate([jnp.zeros((1, 3)), coins, jnp.zeros((1, 3))])
        final = jnp.concatenate([jnp.zeros((1,)), final, jnp.zeros((1,))])
    idx, lens, predict = verify_tree_target_only(tree, p, coins, final, 2)
    r = 1 if padded else 0
    assert np.asarray(idx[r]).tolist() == [0, 2, -1]
    assert int(lens[r]) == 2
    assert int(predict[r, 0]) == 2 and int(predict[r, 2]) == 3


def test_sampling_with_top_k_1_is_greedy():
    """top_k = 1 at any temperature keeps only the argmax: the distribution is one-hot and every
    draw equals the greedy token (gemma's invariant)."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((64, 50)) * 3, jnp.float32)
    R = logits.shape[0]
    t = jnp.full((R,), 1.7, jnp.float32)
    k = jnp.ones((R,), jnp.int32)
    p = jnp.full((R,), 0.9, jnp.float32)
    settings = RowSampling(temperature=t, top_k=k, top_p=p, min_p=jnp.zeros((R,), jnp.float32))
    probs = target_probs(logits, settings)
    np.testing.assert_array_equal(np.asarray(probs), np.asarray(jax.nn.one_hot(jnp.argmax(logits, -1), 50)))
    keys = jax.random.split(jax.random.PRNGKey(3), R)
    drawn = pick_tokens(logits, settings, keys, greedy_only=False)
    np.testing.assert_array_equal(np.asarray(drawn), np.asarray(jnp.argmax(logits, -1)))


# ----------------------------------------------------------------------------- commit


@dataclasses.dataclass(frozen=True)
class CommitCase:
    name: str
    emitted: list[int]  # accepted tokens then the bonus, padded to A
    accept_lens: int
    out_before: list[int]  # tokens already emitted
    max_new: int
    stop: int  # stop token (-1: none)
    active: bool
    out_after: list[int]  # expected
    still_active: bool


COMMIT_CASES = [
    CommitCase("append_all", [4, 5, 6, 0], 3, [1], 10, -1, True, [1, 4, 5, 6], True),
    CommitCase("stop_cuts_and_is_not_emitted", [4, 7, 6, 0], 3, [1], 10, 7, True, [1, 4], False),
    CommitCase("stop_past_accept_len_ignored", [4, 5, 7, 0], 2, [1], 10, 7, True, [1, 4, 5], True),
    CommitCase("max_new_truncates", [4, 5, 6, 0], 3, [1, 2], 4, -1, True, [1, 2, 4, 5], False),
    CommitCase("exactly_max_new", [4, 5, 6, 0], 2, [1], 3, -1, True, [1, 4, 5], False),
    CommitCase("inactive_row_unchanged", [4, 5, 6, 0], 3, [1, 2], 10, -1, False, [1, 2], False),
]


def _commit_state(cases: list[CommitCase], M: int = 8):
    B = len(cases)
    out = np.zeros((B, M), np.int32)
    for b, c in enumerate(cases):
        out[b, : len(c.out_before)] = c.out_before
    state = DecodeState.empty(batch=B, out_width=M, num_stop=1, hidden_size=2, hidden_dtype=jnp.float32)
    state = dataclasses.replace(
        state,
        seq_lens=jnp.full((B,), 10, jnp.int32),
        active=jnp.asarray([c.active for c in cases]),
        out_tokens=jnp.asarray(out),
        out_lens=jnp.asarray([len(c.out_before) for c in cases], jnp.int32),
        max_new=jnp.asarray([c.max_new for c in cases], jnp.int32),
        stop_ids=jnp.asarray([[c.stop] for c in cases], jnp.int32),
        seed=DraftSeed(hidden=jnp.zeros((B, 2))),
    )
    step = StepOutput(
        emitted=jnp.asarray([c.emitted for c in cases], jnp.int32),
        accept_lens=jnp.asarray([c.accept_lens for c in cases], jnp.int32),
        bonus=jnp.asarray([c.emitted[c.accept_lens - 1] for c in cases], jnp.int32),
        seed=DraftSeed(hidden=jnp.ones((B, 2))),
        verified=jnp.full((B,), 5, jnp.int32),
    )
    return state, step


@pytest.mark.parametrize("case,padded", with_padded(COMMIT_CASES))
def test_commit(case: CommitCase, padded: bool):
    filler = CommitCase("filler", [9, 9, 9, 9], 4, [3], 10, -1, True, [3, 9, 9, 9, 9], True)
    cases = [filler, case, filler] if padded else [case]
    state, step = _commit_state(cases)
    new = commit(state, step)
    for b, c in enumerate(cases):
        n = len(c.out_after)
        assert int(new.out_lens[b]) == n, c.name
        assert np.asarray(new.out_tokens[b, :n]).tolist() == c.out_after, c.name
        assert bool(new.active[b]) == c.still_active, c.name
        # Lengths, the next root and the draft seed move only for rows that were active.
        assert int(new.seq_lens[b]) == 10 + (c.accept_lens if c.active else 0), c.name
        assert int(new.num_verify[b]) == int(c.active), c.name
        assert float(new.seed.hidden[b, 0]) == float(c.active), c.name
        assert int(new.bonus[b]) == (c.emitted[c.accept_lens - 1] if c.active else 0), c.name
