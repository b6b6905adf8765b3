"""N-gram drafting (``NgramDraft``) and the hybrid n-gram + model tree (``HybridDraft``).

* The on-device lookup against a plain-Python reference of its rule (longest match first, most
  recent among equals, distinct next tokens for the paths of a tree, continuations that run into
  the present repeat with their period), and the trees built from it (missing paths detached,
  grafted branches hanging below the part the model's tree already holds).
* The no-match mechanism: a step in which no active row matched verifies the root alone (only the
  root's KV is written), a step in which one row matched verifies the full tree; only a draft
  loop that may not draft compiles a ``cond``.
* Lossless greedy decoding with n-gram chains and trees and with hybrids over a chain and a
  tree, page sizes 1 and 16, ragged batch 4, prompts with and without repeats (runs whose first
  steps match in no row, later ones in some).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

import jaxspec as js
from benchmarks.ngram_no_match import successor_model
from jaxspec.spec import lookup_loop as lookup
from jaxspec.spec import tree as tree_lib
from jaxspec.spec.graft_loop import graft
from jaxspec.spec.plan import Plan, verify_branches_on
from jaxspec.spec.verify import verify_tree_greedy
from jaxspec.engine.prefill import request_arrays
from jaxspec.engine.programs import decode_step, prefill_program
from jaxspec.engine.state import DecodeState
from jaxspec.kvcache.paging import positions_to_slots
from jaxspec.model.layers import rms_norm
from jaxspec.model.targets import Model, create_target_pool
from tests.conftest import PROMPTS_1, PROMPTS_4, engine
from tests.spec.test_lossless import drafts

# ----------------------------------------------------------------------------- the lookup rule


def reference_paths(history, length, max_ngram, min_ngram, path_lengths):
    """Plain Python: [(match length (0: none), tokens)] per path."""
    h = [int(t) for t in history[:length]]
    matches = []  # (k, end position q): the k tokens ending at q equal the last k (q <= L - 2)
    for q in range(length - 1):
        ks = [k for k in range(min_ngram, max_ngram + 1) if k <= q + 1 and h[q - k + 1:q + 1] == h[length - k:]]
        if ks:
            matches.append((max(ks), q))
    matches.sort(reverse=True)  # longest, then most recent
    picked, firsts = [], set()
    for k, q in matches:
        if h[q + 1] not in firsts:
            firsts.add(h[q + 1])
            picked.append((k, q + 1))
    out = []
    for j, count in enumerate(path_lengths):
        if j >= len(picked):
            out.append((0, None))
            continue
        k, start = picked[j]
        ext = list(h)  # what the match predicts is read on as it is drafted
        for i in range(count):
            ext.append(ext[start + i])
        out.append((k, ext[length:]))
    return out


@pytest.mark.parametrize("max_ngram,min_ngram,path_lengths", [(3, 1, (5,)), (4, 2, (4, 2, 2)), (2, 2, (3, 3))])
def test_lookup_follows_its_rule(max_ngram, min_ngram, path_lengths):
    rng = np.random.default_rng(max_ngram * 10 + min_ngram)
    B, M = 96, 24
    history = rng.integers(0, 4, size=(B, M)).astype(np.int32)  # 4 symbols: many repeats
    length = rng.integers(1, M + 1, size=B).astype(np.int32)
    length[:3] = [1, 2, M]
    history[3, :8], length[3] = [0, 1, 2, 3, 0, 1, 2, 3], 8  # a period-4 repeat: continuation wraps
    cfg = js.NgramDraft(max_ngram=max_ngram, min_ngram=min_ngram).config.model
    paths, match = jax.jit(lookup.ngram_paths, static_argnums=(0, 3))(cfg, history, length, path_lengths)
    paths, match = [np.asarray(p) for p in paths], np.asarray(match)
    for b in range(B):
        for j, (ref_match, ref_tokens) in enumerate(reference_paths(history[b], length[b], max_ngram, min_ngram,
                                                                    path_lengths)):
            assert match[b, j] == ref_match, (b, j)
            if ref_match:
                assert paths[j][b].tolist() == ref_tokens, (b, j, history[b, :length[b]])
    found = match > 0
    assert found[:, -1].any() and (~found[:, 0]).any()  # every path is found somewhere, and missed
    if min_ngram == 1:
        assert paths[0][3].tolist() == [0, 1, 2, 3, 0]  # "0 1 2 3 0 1 2 3" goes on "0 1 2 3 0"


def test_path_lengths():
    assert lookup.path_lengths(5, 1, 5) == (5,)
    assert lookup.path_lengths(7, 2, 5) == (5, 2)
    assert lookup.path_lengths(15, 4, 5) == (5, 4, 3, 3)
    assert lookup.path_lengths(4, 4, 5) == (1, 1, 1, 1)
    assert lookup.path_lengths(8, 2, 4) == (4, 4)


def test_history_holds_prompt_first_token_and_emitted_tokens():
    tokens = jnp.asarray([[5, 6, 7, 0], [9, 0, 0, 0]], jnp.int32)
    h = lookup.prompt_history(jnp.zeros((2, 6), jnp.int32), tokens, jnp.asarray([3, 1]), jnp.asarray([8, 4]))
    np.testing.assert_array_equal(h, [[5, 6, 7, 8, 0, 0], [9, 4, 0, 0, 0, 0]])
    # Row 0's root sits at seq_len 3; it emitted 2 tokens (one accepted draft + bonus), row 1 emitted 3,
    # the last of which falls past the buffer and is dropped.
    emitted = jnp.asarray([[1, 2, 99], [3, 4, 5]], jnp.int32)
    h = lookup.append_emitted(h, jnp.asarray([3, 3]), emitted, jnp.asarray([2, 3]))
    np.testing.assert_array_equal(h, [[5, 6, 7, 8, 1, 2], [9, 4, 0, 0, 3, 4]])


def test_n_gram_tree_detaches_paths_without_a_match():
    bonus = jnp.asarray([50, 50])
    paths = [jnp.asarray([[1, 2, 3], [1, 2, 3]]), jnp.asarray([[7, 8], [7, 8]])]
    found = jnp.asarray([[True, True], [True, False]])
    tree = lookup.paths_tree(bonus, paths, found, 3)
    np.testing.assert_array_equal(tree.parent[0], [-1, 0, 1, 2, 0, 4])
    np.testing.assert_array_equal(tree.parent[1], [-1, 0, 1, 2, tree_lib.DETACHED, 4])
    np.testing.assert_array_equal(tree.depth[0], [0, 1, 2, 3, 1, 2])
    # The target wants 7, 8 after the root: row 0 accepts the second path, row 1 must not.
    want = jnp.asarray([[7, 0, 0, 0, 8, 9], [7, 0, 0, 0, 8, 9]])
    accept_index, accept_lens, _ = verify_tree_greedy(tree, want, 3)
    assert accept_lens.tolist() == [3, 1]
    assert accept_index[0].tolist() == [0, 4, 5, -1]


def _chain(tokens):  # a model tree: root 50 then a chain
    return tree_lib.chain_tree(jnp.asarray([50]), jnp.asarray([tokens]))


D = tree_lib.DETACHED


@pytest.mark.parametrize("branch,found,parents", [
    ([7, 8, 9], True, [0, 4, 5]),  # no token in common: from the root
    ([1, 2, 9], True, [D, D, 2]),  # "1 2" is the model's path: 9 hangs below its node 2
    ([1, 2, 3], True, [D, D, D]),  # all on the model's chain: nothing new
    ([7, 8, 9], False, [D, D, D]),  # no match
], ids=["disjoint", "shared-prefix", "contained", "no-match"])
def test_graft_hangs_the_branch_below_the_shared_path(branch, found, parents):
    tree = graft(_chain([1, 2, 3]), jnp.asarray([branch]), jnp.asarray([found]), 3)
    np.testing.assert_array_equal(tree.parent[0], [-1, 0, 1, 2] + parents)
    for i in [i for i in range(4, 7) if parents[i - 4] != D]:
        assert int(tree.depth[0, i]) == i - 3  # branch token i - 4 at depth i - 3
        assert bool(tree.mask[0, i, 0]) and bool(tree.mask[0, i, parents[i - 4]])
    # Siblings stay distinct (tree sampling relies on it).
    for p in range(7):
        kids = [int(tree.tokens[0, j]) for j in range(1, 7) if int(tree.parent[0, j]) == p]
        assert len(kids) == len(set(kids))


def test_greedy_walk_takes_the_grafted_branch():
    tree = graft(_chain([1, 2, 3]), jnp.asarray([[1, 5, 6]]), jnp.asarray([True]), 3)  # 5, 6 below node 1
    want = jnp.asarray([[1, 5, 0, 0, 0, 6, 4]])  # after root: 1; after node 1: 5; after 5 (node 5): 6 ...
    accept_index, accept_lens, _ = verify_tree_greedy(tree, want, 3)
    assert int(accept_lens[0]) == 4 and accept_index[0].tolist() == [0, 1, 5, 6]


def test_spec_validation_for_n_gram_trees_and_hybrids(tiny_target):
    ngram = js.NgramDraft()
    with pytest.raises(ValueError, match=r"n-gram tree is topk paths .* holds topk..topk\*num_steps = 2..6"):
        js.generate(tiny_target, PROMPTS_1, draft=ngram, spec=js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=9))
    with pytest.raises(ValueError, match="ngram_tokens=2 grafts an n-gram branch"):
        js.generate(tiny_target, PROMPTS_1, draft=ngram,
                    spec=js.SpecConfig(num_steps=3, topk=1, num_draft_tokens=6, ngram_tokens=2))
    hybrid = js.HybridDraft(drafts(tiny_target)["eagle3"], ngram)
    with pytest.raises(ValueError, match="set ngram_tokens >= 1"):
        js.generate(tiny_target, PROMPTS_1, draft=hybrid, spec=js.SpecConfig.chain(3))
    with pytest.raises(ValueError, match="max_ngram must be a positive int"):
        js.NgramDraft(max_ngram=0)
    with pytest.raises(ValueError, match="min_ngram=3 > max_ngram=2"):
        js.NgramDraft(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="HybridDraft needs a model draft"):
        js.HybridDraft(ngram)
    with pytest.raises(ValueError, match=r"verifies exactly num_steps \+ 1 \+ ngram_tokens"):
        js.SpecConfig(num_steps=3, topk=1, num_draft_tokens=4, ngram_tokens=2)
    with pytest.raises(ValueError, match=r"ngram_tokens must be an int >= 0"):
        js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=8, ngram_tokens=-1)
    with pytest.raises(ValueError, match="leaves no node for the model draft"):
        js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5, ngram_tokens=4)
    assert js.SpecConfig(num_steps=2, topk=1, num_draft_tokens=8, ngram_tokens=5).max_accept == 6  # a deep branch


# ----------------------------------------------------------------------------- the no-match step


_DECODE_STEP = jax.jit(decode_step, static_argnums=0)  # one wrapper: its compiles are shared


def _one_step(target, ngram, prompts, page_size=4):
    """Prefill ``prompts`` (batch 2) and run one n-gram chain step (S = 3). Returns (how many of
    the positions seq_len + 1 .. seq_len + S got KV, per row; accept_lens)."""
    spec = js.SpecConfig.chain(3)
    plan = Plan(target=target.config, draft=ngram.config, spec=spec, page_size=page_size, steps_per_call=1)
    B, W, T = 2, 32, 128
    num_pages = B * W + 1
    tpool = create_target_pool(target.config, num_pages=num_pages, page_size=page_size, dtype=jnp.float32)
    dpool = ngram.config.create_pool(num_pages=num_pages, page_size=page_size, dtype=jnp.float32)
    seed = ngram.config.empty_seed(B, dtype=jnp.float32, max_len=W * page_size)
    state = DecodeState.empty(batch=B, out_width=16, num_stop=1, seed=seed)
    table = jnp.asarray(1 + np.arange(B * W, dtype=np.int32).reshape(B, W))
    tokens = np.zeros((B, T), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    req = request_arrays(B, max_new=8)
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    state, tpool, dpool = prefill_program(plan, target.params, ngram.params, state, tpool, dpool, table,
                                          jnp.arange(B, dtype=jnp.int32), jnp.asarray(tokens), lens, req)
    seq_lens = np.asarray(state.seq_lens)
    state, tpool, dpool = _DECODE_STEP(plan, target.params, ngram.params, state,
                                                                 tpool, dpool, table)
    ahead = seq_lens[:, None] + 1 + np.arange(spec.num_steps)[None, :]  # [B, S] past the root
    slots = np.asarray(positions_to_slots(table, jnp.asarray(ahead), page_size))
    k = np.asarray(tpool.k)
    written = np.asarray([int((np.abs(k[:, slots[b]]).sum(axis=(0, 2, 3)) > 0).sum()) for b in range(B)])
    root = np.asarray(positions_to_slots(table, jnp.asarray(seq_lens[:, None]), page_size))[:, 0]
    assert all(np.abs(k[:, root[b]]).sum() > 0 for b in range(B))  # the root's KV is written either way
    return written, np.asarray(state.out_lens) - 1


def test_a_step_where_nothing_matches_verifies_only_the_root(tiny_target):
    """A target that counts up (``successor_model``) emits 13 and 15 after these prompts, tokens
    neither history holds: the step writes the root's KV and nothing past it. When one row
    matches (its prompt holds every token once, so its first token recurs: a match of one token,
    which asks for 2 drafts), the step verifies root + 2 nodes for every active row (of the
    chain's 3: ``adaptive``)."""
    unigrams = js.NgramDraft(max_ngram=3, min_ngram=1)
    written, emitted = _one_step(successor_model(tiny_target), unigrams, [list(range(1, 13)), [60, 3, 14]])
    assert written.tolist() == [0, 0] and emitted.tolist() == [1, 1]
    written, _ = _one_step(tiny_target, unigrams, [list(range(96)), [60, 3, 14]])
    assert written.tolist() == [2, 2]


def _switches(jaxpr) -> list[int]:
    """Branch counts of every cond / switch in ``jaxpr``, nested ones included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            out.append(len(eqn.params["branches"]))
        for sub in jax_core.jaxprs_in_params(eqn.params):
            out += _switches(sub)
    return out


def test_only_draft_loops_with_varying_proposals_compile_a_switch(tiny_target):
    """An n-gram chain switches among the root alone and the lengths its match lengths ask for
    (S = 3: 1, 1 + 2, 1 + 3 nodes), a hybrid among its model tree plus 0 or 2 grafted tokens; a
    model draft alone, or a hybrid that always verifies everything, compiles none; nor does any
    plan without verify branches (a GPU's: ``verify_branches_on``)."""
    eagle = drafts(tiny_target)["eagle3"]
    chain = js.SpecConfig.chain(3)
    hybrid_spec = js.SpecConfig(num_steps=3, topk=1, num_draft_tokens=6, ngram_tokens=2)
    assert verify_branches_on("cpu") and not verify_branches_on("gpu")
    for draft, spec, switches, branches in [
        (js.NgramDraft(), chain, [3], True), (js.NgramDraft(adaptive=False), chain, [2], True), (eagle, chain, [], True),
        (js.HybridDraft(eagle), hybrid_spec, [2], True),
        (js.HybridDraft(eagle, js.NgramDraft(adaptive=False)), hybrid_spec, [], True),
        (js.NgramDraft(), chain, [], False), (js.HybridDraft(eagle), hybrid_spec, [], False),
    ]:
        plan = Plan(target=tiny_target.config, draft=draft.config, spec=spec, page_size=4, verify_branches=branches)
        tpool = create_target_pool(tiny_target.config, num_pages=9, page_size=4, dtype=jnp.float32)
        dpool = draft.config.create_pool(num_pages=9, page_size=4, dtype=jnp.float32)
        state = DecodeState.empty(batch=2, out_width=8, num_stop=1,
                                  seed=draft.config.empty_seed(2, dtype=jnp.float32, max_len=16))
        jaxpr = jax.make_jaxpr(functools.partial(decode_step, plan))(tiny_target.params, draft.params, state, tpool,
                                                                     dpool, jnp.ones((2, 4), jnp.int32))
        assert _switches(jaxpr.jaxpr) == switches, draft


# ----------------------------------------------------------------------------- lossless end to end

MAX_NEW = 24
REPEATS_4 = [[5, 17, 33, 2, 9, 5, 17, 33, 2, 9, 5, 17], [60, 3, 14, 60, 3], [1, 2, 3, 1, 2, 3, 1, 2, 3], [88, 88, 88]]
PROMPT_SETS = {"repeats4": REPEATS_4, "plain4": PROMPTS_4}
NGRAM = js.NgramDraft(max_ngram=3, min_ngram=1)


@functools.cache
def periodic_target(target: Model, period: int = 6, layer_scale: float = 0.025) -> Model:
    """``target`` turned into a model that mostly repeats itself, as code and JSON outputs do: its
    head favours a fixed successor of each token (cycles of ``period`` tokens), and its layers,
    their outputs scaled down, still move the argmax now and then (attention and KV matter)."""
    p = target.params
    V = target.config.vocab_size
    successor = np.roll(np.arange(V).reshape(-1, period), -1, axis=1).reshape(-1)
    layers = dict(p["layers"], wo=p["layers"]["wo"] * layer_scale, w_down=p["layers"]["w_down"] * layer_scale)
    final = rms_norm(p["embed"], p["norm"], target.config.rms_norm_eps)  # [V, H] the final hidden of each token
    head = final[np.argsort(successor)].T  # [H, V]: column v scores the token whose successor is v
    return Model(config=target.config, params=dict(p, layers=layers, lm_head=head), dtype=target.dtype,
                 eos_token_ids=())


@functools.cache
def plain(target, prompts, page):
    out = js.generate(target, [list(p) for p in prompts], sampling=js.SamplingParams(max_new_tokens=MAX_NEW),
                      engine=engine(page, len(prompts)))
    return out.token_ids


def matched_steps(prompt, tokens, accept_lens, cfg) -> list[bool]:
    """Replays one row of a run: whether its history had a match at each of its verify steps."""
    out, emitted = [], 1  # the first token comes from the prefill
    for n in accept_lens:
        history = list(prompt) + tokens[:emitted]
        out.append(reference_paths(history, len(history), cfg.max_ngram, cfg.min_ngram, (1,))[0][0] > 0)
        emitted += n
    return out


CASES = [  # (draft, spec, page, prompts): an n-gram chain and tree, a hybrid deeper than its model tree
    ("ngram", js.SpecConfig.chain(3), 1, "repeats4"),
    ("ngram", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 16, "plain4"),
    ("eagle3", js.SpecConfig(num_steps=2, topk=2, num_draft_tokens=9, ngram_tokens=5), 1, "plain4"),
]


@pytest.mark.parametrize("draft,spec,page,prompts", [
    pytest.param(*c, id=f"{'hybrid-' if c[1].ngram_tokens else ''}{c[0]}-S{c[1].num_steps}k{c[1].topk}"
                 f"n{c[1].num_draft_tokens}-page{c[2]}-{c[3]}") for c in CASES])
def test_n_gram_and_hybrid_greedy_equal_plain_greedy(tiny_target, draft, spec, page, prompts):
    """Ragged batch 4. The ``plain4`` prompts hold no repeat: their first steps find no match in
    any row (the step verifies the root alone), later ones do, in the same compiled loop."""
    _greedy_equal_plain(tiny_target, draft, spec, page, prompts)


@pytest.mark.parametrize("draft,spec,page,prompts", [CASES[0], CASES[2]], ids=["ngram-chain", "hybrid-tree"])
def test_without_verify_branches_greedy_equals_plain_greedy(tiny_target, draft, spec, page, prompts, monkeypatch):
    """The GPU's plan (``verify_branches_on("gpu")``: every step verifies the longest size) on the CPU."""
    monkeypatch.setattr("jaxspec.engine.engine.verify_branches_on", lambda backend: False)
    _greedy_equal_plain(tiny_target, draft, spec, page, prompts, branches=False)


def _greedy_equal_plain(tiny_target, draft, spec, page, prompts, branches=True):
    target = periodic_target(tiny_target)
    ps = tuple(tuple(p) for p in PROMPT_SETS[prompts])
    d = NGRAM if draft == "ngram" else js.HybridDraft(drafts(tiny_target)[draft], NGRAM)
    eng = js.Engine(target, d, spec, engine(page, len(ps)))
    assert eng.plan.verify_branches == branches
    out = eng.generate([list(p) for p in ps], sampling=js.SamplingParams(max_new_tokens=MAX_NEW))
    assert out.token_ids == plain(target, ps, page)
    assert out.kv_pages_free == out.kv_pages_total
    lens = np.concatenate([s.accept_lens for s in out.stats])
    assert lens.min() >= 1 and lens.max() <= spec.max_accept
    assert (lens >= 3).sum() >= 2 and (lens < spec.max_accept).any(), lens  # drafts partly accepted
    if spec.ngram_tokens > spec.num_steps:
        assert lens.max() > spec.num_steps + 1, lens  # accepted deeper than the model's chain: on the branch
    if prompts == "plain4":  # steps where no row matched (root alone) and steps where some row did
        rows = [matched_steps(p, t, s.accept_lens, NGRAM.config.model) for p, t, s in zip(ps, out.token_ids, out.stats)]
        any_row = [any(r[j] for r in rows if j < len(r)) for j in range(max(map(len, rows)))]
        assert any(any_row) and not all(any_row), rows

