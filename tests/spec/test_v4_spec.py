"""Speculative decoding on a DeepSeek-V4 target (the HF golden: CSA / sliding / HCA layers, window 8,
rates 2 and 4, prompts of 13 / 29 / 40 tokens + 24 greedy tokens):

* lossless: the V4 MTP layer (chain, tree), n-gram lookup and a perturbed copy of the target as a
  standalone draft, pages 1 and 16, a ragged batch of 3, equal HF's greedy tokens (the golden, itself
  equal to plain greedy); the paged verify's log-probabilities equal HF's no-cache logits; forced
  preemption (resume by prefill) changes nothing; every page of every pool comes back;
* rollback: a rejected tree node that closes a CSA and an HCA window leaves no trace, whether an accepted
  sibling closes them, no accepted node does, or a chain is cut before its closer: after commit and
  compaction every entry pool and the ring (K = V rows and compressor inputs) equal a fresh forward over
  the accepted tokens, and so do they after the next step; the verify itself wrote no entry;
* one draft-scratch layout (docs/architecture.md#jitted-and-eager-runs-agree): the per-step compressed write targets of multi-step drafting come from the one layout
  helper, and the jitted and eager paths agree on them; V4's own draft loop (a perturbed V4 draft, a
  tree of 2 x 3 steps) writes its ring rows at exactly those targets, jitted and eager alike, and its
  attention reads each scratch column back where the helper wrote it, at that step's logical position;
  a different layout in the helper moves the writes and the reads together;
* the MTP layer against an independent torch implementation of DeepSeek's documented forward;
* speculative sampling (MTP chain and tree; DeepSeek's DSpark chain with its Markov head's sequential q,
  with and without confidence scheduling) on a tiny V4 target (vocabulary 5) has the target's exact
  distribution.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.spec.compact import compact_pool
from jaxspec.spec.plan import Plan
from jaxspec.spec.proposers import proposer_for
from jaxspec.engine.state import DecodeState
from jaxspec.kvcache.compressed import compressed_write_targets
from jaxspec.kvcache import layout
from jaxspec.kvcache.layout import draft_scratch_positions, per_step_draft_locs
from jaxspec.kvcache.paging import AttentionInputs, PageTables, WindowTable
from jaxspec.model.drafts import standalone_draft
from jaxspec.model.drafts.base import DraftContext, DraftSeed
from jaxspec.model.drafts.deepseek_v4_dspark import V4DSparkConfig, v4_dspark_draft
from jaxspec.model.drafts.deepseek_v4_mtp import V4MtpConfig, v4_mtp_draft, v4_mtp_forward, v4_mtp_logits
from jaxspec.model.checkpoints.deepseek_v4 import init_deepseek_v4_params
from jaxspec.model.checkpoints.deepseek_v4_dspark import init_v4_dspark_params
from jaxspec.model.checkpoints.deepseek_v4_mtp import init_v4_mtp_params
from jaxspec.model.targets import Model, create_target_pool, target_commit, target_forward
from jaxspec.model.targets.deepseek_v4_attention import block_columns
from jaxspec.model.targets.deepseek_v4_config import DeepseekV4Config
from tests.model.golden import GOLDEN, arrays, cases

CASE = next(c for c in cases() if c["name"] == "deepseek_v4")
PATH = os.path.join(GOLDEN, "deepseek_v4")


@functools.cache
def golden():
    target = js.load_model(PATH, dtype="float32", progress=False)
    return target, js.load_draft(PATH, target), arrays(CASE)


@functools.cache
def perturbed():
    """The target with N(0, 0.02^2) noise on every f32 parameter (numpy's: JAX's per-leaf draws took
    ~25 s to compile) as a standalone draft."""
    target, _, _ = golden()
    rng = np.random.default_rng(2)
    noisy = jax.tree.map(lambda x: x + 0.02 * rng.standard_normal(x.shape).astype(np.float32)
                         if x.dtype == jnp.float32 else x, target.params)
    return standalone_draft(Model(config=target.config, params=noisy, dtype=target.dtype))


def test_mtp_layer_matches_its_reference():
    """The MTP layer over the target's last-layer streams (tests/model/targets/test_deepseek_v4.py checks that the
    target's tap L gives them) equals the independent torch forward of the golden (streams out, logits)."""
    target, draft, ref = golden()
    T = len(ref["mtp_input_ids"])
    pool = draft.config.create_pool(num_pages=2, page_size=T, dtype=jnp.float32)
    page = jnp.ones((1, 1), jnp.int32)
    pos = jnp.asarray(ref["mtp_positions"], jnp.int32)[None]
    attn = AttentionInputs.build(PageTables(full=page, window=WindowTable(pages=page, first=jnp.zeros(1, jnp.int32))),
                                 jnp.zeros(1, jnp.int32), pos, T)

    @jax.jit
    def run(params, tokens, streams):
        h, _ = v4_mtp_forward(params, draft.config.model, tokens, streams, pos, pool, attn)
        return h, v4_mtp_logits(params, draft.config.model, h)

    h, logits = run(draft.params, jnp.asarray(ref["mtp_input_ids"], jnp.int32)[None], jnp.asarray(ref["mtp_hidden_in"])[None])
    np.testing.assert_allclose(np.asarray(h[0]), ref["mtp_hidden_out"], atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(np.asarray(logits[0]), ref["mtp_logits"], atol=2e-4, rtol=2e-4)


# ------------------------------------------------------------------------------------ lossless

TREE = js.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4)


@pytest.mark.parametrize("draft,spec,page,extra", [
    ("mtp", js.SpecConfig.chain(2), 1, dict(logprobs=True)),
    ("mtp", TREE, 1, dict(preempt_every=2)),
    ("ngram", js.SpecConfig.chain(3), 16, {}),
    ("perturbed", TREE, 16, {}),
], ids=["mtp-chain-page1-logprobs", "mtp-tree-page1-preempted", "ngram-chain-page16", "perturbed-tree-page16"])
def test_speculative_greedy_equals_hf_greedy(draft, spec, page, extra):
    target, mtp, ref = golden()
    d = {"mtp": mtp, "ngram": js.NgramDraft(max_ngram=3, min_ngram=1), "perturbed": perturbed()}[draft]
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
    sampling = js.SamplingParams(max_new_tokens=CASE["greedy_new_tokens"], logprobs=0 if extra.get("logprobs") else None)
    out = js.generate(target, prompts, draft=d, spec=spec, sampling=sampling, progress=False,
                      engine=js.EngineConfig(page_size=page, max_batch=4, max_seq_len=96, check_pages=True,
                                             preempt_every=extra.get("preempt_every", 0),
                                             min_prefill_rows=4, min_prefill_bucket=64))  # as engine() in tests/conftest.py
    for i in range(3):
        assert out.token_ids[i] == ref[f"greedy_{i}"].tolist(), i
    assert out.kv_pages_free == out.kv_pages_total
    lens = np.concatenate([s.accept_lens for s in out.stats])
    if draft == "perturbed":
        assert lens.mean() > 1.3 and (lens < spec.num_steps + 1).any(), lens  # partly accepted: paths compacted
    if extra.get("preempt_every"):
        assert sum(s.preemptions for s in out.stats) > 0
    if extra.get("logprobs"):  # the paged verify's logits are HF's no-cache ones
        for i in range(3):
            n = len(prompts[i])
            full = ref[f"full_logits_{i}"][n - 1: n - 1 + len(out.token_ids[i])]
            want = full - np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True)) - full.max(-1,
                                                                                                             keepdims=True)
            want = np.take_along_axis(want, np.asarray(out.token_ids[i])[:, None], 1)[:, 0]
            np.testing.assert_allclose(out.logprobs[i], want, atol=2e-4)


# ------------------------------------------------------------------------------------ rollback


def _tables(B: int, pages: int):
    table = jnp.asarray(1 + np.arange(B * pages, dtype=np.int32).reshape(B, pages))  # a plain table as the ring
    return PageTables(full=table, window=WindowTable(pages=table, first=jnp.zeros(B, jnp.int32)),
                      compressed=(table, table))


P_ROLL, PAGES_ROLL = 4, 12  # 48 positions / entries per row
TREE_PARENTS = [-1, 0, 0, 1, 2]  # root(29) -> {a, b}(30) -> {c under a, d under b}(31)
CHAIN_PARENTS = [-1, 0, 1, 2, 3]  # root(29) -> x(30) -> y(31) -> ...(32, 33)


def _ancestor_mask(parents: list[int]) -> np.ndarray:  # bool[T, T]: node i sees itself and its ancestors
    mask = np.eye(len(parents), dtype=bool)
    for i in range(len(parents)):
        j = parents[i]
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def _fresh(seq: list[int], params=None):
    """A committing forward over ``seq`` (padded to 40: one compiled program) from an empty pool, with
    the target's params or ``params`` of the same config."""
    cfg, params = _cfg(), golden()[0].params if params is None else params
    T = 40
    toks = jnp.zeros((1, T), jnp.int32).at[0, : len(seq)].set(jnp.asarray(seq))
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    write = jnp.where(pos < len(seq), pos, -1)
    pool = create_target_pool(cfg, num_pages=PAGES_ROLL + 1, page_size=P_ROLL, dtype=jnp.float32)
    attn = AttentionInputs.build(_tables(1, PAGES_ROLL), jnp.zeros(1, jnp.int32), write, P_ROLL)
    return _forward(params, toks, pos, pool, attn)


def _step(pool, tokens: list[int], parents: list[int], seq_len: int, accept: list[int]):
    """One verify of the 5 nodes ``tokens`` (tree ``parents``) behind ``seq_len`` committed positions,
    the commit of the path ``accept`` (node indices, -1 past its end) and compaction: (the pool the
    verify left, the committed pool)."""
    tables = _tables(1, PAGES_ROLL)
    depth = np.zeros(len(parents), np.int32)
    for i, j in enumerate(parents):
        depth[i] = 0 if j < 0 else depth[j] + 1
    seq_lens = jnp.asarray([seq_len], jnp.int32)
    attn = AttentionInputs.build(tables, seq_lens, seq_len + jnp.arange(5, dtype=jnp.int32)[None], P_ROLL,
                                 block_mask=jnp.asarray(_ancestor_mask(parents))[None], pending=True)
    return _verify_commit_compact(golden()[0].params, jnp.asarray([tokens], jnp.int32),
                                  jnp.asarray(seq_len + depth)[None], pool, attn, tables, seq_lens,
                                  jnp.asarray([accept], jnp.int32))


def _assert_state_equal(got, want, positions: int):
    """Every entry pool equal; the ring (K = V rows and compressor inputs) at positions < ``positions``."""
    for part_g, part_w in zip(got.entries, want.entries):
        for x, y in zip(part_g.buffers, part_w.buffers):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-5)
    slots = np.asarray(_tables(1, PAGES_ROLL).window.slots(jnp.arange(positions, dtype=jnp.int32)[None], P_ROLL))[0]
    for x, y in zip(got.window.buffers, want.window.buffers):
        np.testing.assert_allclose(np.asarray(x)[:, slots], np.asarray(y)[:, slots], atol=2e-5)


def _entry_written(pool, part: int, entry: int) -> bool:
    slot = (1 + entry // P_ROLL) * P_ROLL + entry % P_ROLL  # the plain table: entry e in page 1 + e // P
    return bool(np.abs(np.asarray(pool.entries[part].kv[:, slot])).max() > 0)


@pytest.mark.parametrize("parents,accept", [
    (TREE_PARENTS, [0, 2, 4]),
    (TREE_PARENTS, [0, 2, -1]),
    (CHAIN_PARENTS, [0, 1, -1]),
], ids=["sibling-closes", "closers-rejected", "chain-cut-before-closer"])
def test_a_rejected_node_closing_windows_leaves_no_trace(parents, accept):
    """Prompt of 29 tokens, a verify of 5 nodes in which position 31 closes a CSA entry (15, rate 2) and
    an HCA entry (7, rate 4): in the tree, c (under a) and d (under b) both close them; in the chain, y.
    Accepted: root -> b -> d (a sibling closes the same windows), root -> b (neither closer: nothing
    closes them), root -> x (the chain cut before its closer). The verify alone writes no entry; after
    commit + compaction every entry pool and the committed ring equal a fresh forward over the accepted
    tokens only, and so does the next step (one more token at the committed length, which reads the
    ring positions the rejected nodes had used and closes 15 and 7 where they stayed open)."""
    _, _, ref = golden()
    prompt = ref["prompt_1"].tolist()  # 29 tokens
    s = len(prompt)
    tokens = [5, 17, 23, 41, 50]
    path = [tokens[i] for i in accept if i >= 0]
    n = s + len(path)
    before = _fresh(prompt)
    verified, after = _step(before, tokens, parents, s, accept)
    for part_v, part_b in zip(verified.entries, before.entries):  # the verify wrote no entry
        for x, y in zip(part_v.buffers, part_b.buffers):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    _assert_state_equal(after, _fresh(prompt + path), n)
    closed = n > s + 2  # the accepted path reaches position 31
    assert all(_entry_written(after, part, entry) == closed for part, entry in ((0, 15), (1, 7)))
    # The next step: token 60 at position n accepted, four more nodes rejected.
    _, later = _step(after, [60, 61, 62, 63, 64], CHAIN_PARENTS, n, [0, -1, -1])
    _assert_state_equal(later, _fresh(prompt + path + [60]), n + 1)
    assert all(_entry_written(later, part, entry) for part, entry in ((0, 15), (1, 7)))


@jax.jit
def _forward(params, tokens, positions, pool, attn):
    return target_forward(_cfg(), params, tokens, positions, pool, attn).pool


@jax.jit
def _verify_commit_compact(params, tokens, positions, pool, attn, tables, seq_lens, accept_index):
    cfg = _cfg()
    out = target_forward(cfg, params, tokens, positions, pool, attn)
    lens = jnp.sum(accept_index >= 0, axis=1).astype(jnp.int32)
    active = jnp.ones((1,), bool)
    committed = target_commit(cfg, out.pool, out.pending, accept_index, lens, active)
    return out.pool, compact_pool(committed, tables, seq_lens, accept_index, lens, active)


def _cfg():
    return golden()[0].config


# ------------------------------------------- one draft-scratch layout: jitted and eager runs agree


@pytest.mark.parametrize("B,K,S", [(2, 1, 3), (3, 2, 4)])
def test_per_step_compressed_write_targets_jit_equals_eager(B, K, S):
    """The draft loop's step i writes K = V rows and compressor inputs at row i of the one layout helper
    (``per_step_draft_locs``), and the entries it closes follow from those positions: jitted and eager
    agree, and both are branch j, step i at base + j*S + i (SGLang's c4/c128 bug: a second copy of this
    layout in the attention backend disagreed with the draft loop's)."""
    page, rates = 4, (2, 4)
    base = jnp.asarray(7 + 13 * np.arange(B), jnp.int32)
    ring = WindowTable(pages=jnp.asarray(1 + np.arange(B * 16, dtype=np.int32).reshape(B, 16)),
                       first=jnp.zeros(B, jnp.int32))

    def targets(base):
        per_step = per_step_draft_locs(draft_scratch_positions(base, K, S), B, K, S)  # [S, B*K]
        out = []
        for i in range(S):
            write = per_step[i].reshape(B, K)
            logical = jnp.broadcast_to((base + i)[:, None], (B, K))
            out.append(compressed_write_targets(ring, write, logical, rates, page))
        return out

    jitted = jax.jit(targets)(base)
    with jax.disable_jit():
        eager = targets(base)
    for (sj, cj), (se, ce) in zip(jitted, eager):
        np.testing.assert_array_equal(np.asarray(sj), np.asarray(se))
        for a, b in zip(cj, ce):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for i, (slots, closes) in enumerate(jitted):
        pos = np.asarray(base)[:, None] + np.arange(K)[None, :] * S + i  # branch j, step i
        np.testing.assert_array_equal(np.asarray(slots), np.asarray(ring.slots(jnp.asarray(pos), page)))
        logical = np.asarray(base)[:, None] + i
        for m, c in zip(rates, closes):
            want = np.where((logical + 1) % m == 0, (logical + 1) // m - 1, -1)
            np.testing.assert_array_equal(np.asarray(c), np.broadcast_to(want, (B, K)))


def _reads_follow_writes(base: jax.Array, K: int, S: int, tables, page: int) -> np.ndarray:
    """The draft loop's AttentionInputs for each step i (prefix ``base``, its K rows written at row i of
    the layout helper, a [B, K, K*S] block mask): V4's ``block_columns`` (the read side: where and at
    which logical position each scratch column was written) gives every row's own column back at the
    row's write position and at its logical position base + i. Returns the writes, i32[S, B, K]."""
    B = base.shape[0]
    per_step = per_step_draft_locs(draft_scratch_positions(base, K, S), B, K, S).reshape(S, B, K)
    for i in range(S):
        positions = jnp.broadcast_to((base + i)[:, None], (B, K))
        attn = AttentionInputs.build(tables, base, per_step[i], page, block_mask=jnp.ones((B, K, K * S), bool))
        logical, write = block_columns(attn, positions, K)  # [B, K*S]
        own = np.asarray(per_step[i] - base[:, None])  # each row's column
        np.testing.assert_array_equal(np.take_along_axis(np.asarray(write), own, 1), np.asarray(per_step[i]))
        np.testing.assert_array_equal(np.take_along_axis(np.asarray(logical), own, 1), np.asarray(positions))
    return np.asarray(per_step)


def test_draft_reads_and_writes_share_one_layout(monkeypatch):
    """The draft-scratch layout cannot drift between writes and reads, both ways round: V4's read side (``block_columns``) takes the scratch layout
    from the same helper as the draft loop's writes, so swapping the helper's layout (here step-major,
    ``i * K + j``, for the real ``j * S + i``) moves the write positions and the read positions, and they
    still agree column for column."""
    B, K, S = 2, 3, 4
    base = jnp.asarray([5, 17], jnp.int32)
    tables = _tables(B, 8)
    writes = _reads_follow_writes(base, K, S, tables, 4)
    np.testing.assert_array_equal(writes, np.asarray(base)[None, :, None] + (np.arange(K)[None, None, :] * S
                                                                             + np.arange(S)[:, None, None]))
    probe = AttentionInputs.build(tables, base, jnp.zeros((B, K), jnp.int32), 4,
                                  block_mask=jnp.ones((B, K, K * S), bool))
    logical = np.asarray(block_columns(probe, jnp.zeros((B, K), jnp.int32), K)[0])  # every column's position
    np.testing.assert_array_equal(logical - np.asarray(base)[:, None],
                                  np.broadcast_to(np.arange(K * S) % S, (B, K * S)))

    monkeypatch.setattr(layout, "_scratch_offsets",
                        lambda topk, num_steps: np.arange(topk * num_steps, dtype=np.int32).reshape(num_steps, topk).T)
    moved = _reads_follow_writes(base, K, S, tables, 4)
    np.testing.assert_array_equal(moved, np.asarray(base)[None, :, None] + (np.arange(S)[:, None, None] * K
                                                                            + np.arange(K)[None, None, :]))
    moved_logical = np.asarray(block_columns(probe, jnp.zeros((B, K), jnp.int32), K)[0])
    np.testing.assert_array_equal(moved_logical - np.asarray(base)[:, None],
                                  np.broadcast_to(np.arange(K * S) // K, (B, K * S)))


STEP_TREE = js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)


@functools.partial(jax.jit, static_argnums=0)
def _propose_jit(plan, dparams, state, dpool, tables):
    return _propose(plan, dparams, state, dpool, tables)


def _propose(plan, dparams, state, dpool, tables):
    """The draft loop of one step (``Recurrent.propose``): (tree, draft pool)."""
    rows = state.step_rows()
    ctx = DraftContext(tables, rows.seq_lens, None)  # a standalone draft reads no target pool
    tree, _, _, dpool = proposer_for(plan).propose(plan, dparams, rows, dpool, ctx)
    return tree, dpool


def test_multi_step_v4_draft_loop_jit_equals_eager():
    """Jitted and eager runs agree through V4's own draft loop: a perturbed V4 draft (its pool holding a 29-token prompt and
    the bonus token at 29) drafts a tree of 2 branches x 3 steps; each draft forward writes its K = V rows
    and compressor inputs and computes the CSA / HCA entries its path closes (step 1, at 31, closes CSA
    entry 15 and HCA entry 7 on each branch). Jitted and under ``jax.disable_jit()`` the tree and every
    pool buffer agree, and in both the ring changed at exactly the slots of the layout helper's
    positions (branch j, step i < S - 1 at 30 + j*S + i) while no entry was written."""
    _, _, ref = golden()
    draft = perturbed()
    cfg = draft.config.model
    prompt, bonus = ref["prompt_1"].tolist(), int(ref["greedy_1"][0])  # 29 tokens, then the bonus at 29
    K, S = STEP_TREE.topk, STEP_TREE.num_steps
    before = _fresh(prompt + [bonus], draft.params)
    tables = _tables(1, PAGES_ROLL)
    plan = Plan(target=cfg, draft=draft.config, spec=STEP_TREE, page_size=P_ROLL)
    seed = jax.random.normal(jax.random.PRNGKey(5), (1, cfg.hidden_size), jnp.float32)  # the root's draft output
    state = dataclasses.replace(
        DecodeState.empty(batch=1, out_width=8, num_stop=1, hidden_size=cfg.hidden_size),
        seq_lens=jnp.asarray([len(prompt)], jnp.int32), bonus=jnp.asarray([bonus], jnp.int32),
        active=jnp.ones(1, bool), seed=DraftSeed(hidden=seed))
    jitted = _propose_jit(plan, draft.params, state, before, tables)
    with jax.disable_jit():
        eager = _propose(plan, draft.params, state, before, tables)
    np.testing.assert_array_equal(np.asarray(jitted[0].tokens), np.asarray(eager[0].tokens))
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    base = len(prompt) + draft.config.pos_offset  # 30: a standalone draft's scratch follows the bonus
    assert base == 30
    written = base + np.asarray([j * S + i for j in range(K) for i in range(S - 1)])
    # The loop's attention reads each scratch column where the helper wrote it, at its step's position.
    helper = _reads_follow_writes(jnp.asarray([base], jnp.int32), K, S, tables, P_ROLL)  # [S, 1, K]
    np.testing.assert_array_equal(np.sort(helper[:S - 1].reshape(-1)), np.sort(written))
    want = np.sort(np.asarray(tables.window.slots(jnp.asarray(written)[None], P_ROLL))[0])
    for _, dpool in (jitted, eager):
        for x, y in zip(dpool.window.buffers, before.window.buffers):
            changed = np.flatnonzero(np.any(np.asarray(x) != np.asarray(y), axis=(0, 2)))
            np.testing.assert_array_equal(changed, want)
        for part_a, part_b in zip(dpool.entries, before.entries):
            for x, y in zip(part_a.buffers, part_b.buffers):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------------------------ sampling

SMALL = DeepseekV4Config(
    vocab_size=5, hidden_size=16, moe_intermediate_size=16, num_layers=3, num_heads=2, head_dim=16, q_lora_rank=8,
    rope_dim=4, layer_kinds=("csa", "hca", "sliding"), mlp_kinds=("hash", "topk", "topk"), csa_rate=2, hca_rate=2,
    hc_mult=2, hc_sinkhorn_iters=4, num_experts=2, num_experts_per_tok=1, sliding_window=3, o_groups=1, o_lora_rank=8,
    index_n_heads=2, index_head_dim=8, index_topk=1, swiglu_limit=3.0)


@functools.cache
def small_pair():
    params = init_deepseek_v4_params(SMALL, seed=3, scale=0.3)
    target = Model(config=SMALL, params=params, dtype=np.dtype(np.float32))
    cfg = V4MtpConfig(target=SMALL)
    return target, v4_mtp_draft(cfg, init_v4_mtp_params(cfg, params, seed=4, scale=0.3))


@pytest.mark.parametrize("spec", [js.SpecConfig.chain(2), TREE], ids=["chain", "tree"])
def test_mtp_sampling_matches_the_target_distribution(spec):
    """Rejection sampling with the MTP layer's q (a chain; a tree of 2 x 2 steps, 4 nodes) on a tiny V4
    target whose 8 positions pass its window (3) and its CSA top-1 selection: the joint of the first 4
    tokens is the target's (chi-square over 32 x 256 samples), and drafts are partly accepted."""
    from tests.spec.test_spec_sampling import HOT, P_VALUE_MIN, chi_square_p, exact_joint, sample_counts

    target, draft = small_pair()
    probs = exact_joint(HOT, model=target)
    counts = sample_counts(draft, spec, HOT, calls=32, model=target)
    assert chi_square_p(counts, probs) > P_VALUE_MIN
    out = js.generate(target, [[1, 2, 3, 4]] * 256, draft=draft, spec=spec, sampling=HOT, progress=False,
                      engine=js.EngineConfig(page_size=4, max_batch=256, max_seq_len=32, steps_per_call=4), seed=99)
    lens = np.concatenate([s.accept_lens for s in out.stats])
    assert 1.05 < lens.mean() < 3.0 and (lens == 1).any() and (lens > 1).any(), lens.mean()


@functools.cache
def small_dspark():
    """DeepSeek's DSpark layout on the tiny target: 2 stages over the outputs of layers 1 and 2, a block of
    2 slots, a Markov head of rank 4 and a confidence head."""
    target, _ = small_pair()
    cfg = V4DSparkConfig(target=SMALL, num_stages=2, block_size=2, mask_token_id=4, target_layer_ids=(1, 2),
                         markov_rank=4)
    return v4_dspark_draft(cfg, init_v4_dspark_params(cfg, target.params, seed=5, scale=0.5))


def test_dspark_sampling_matches_the_target_distribution():
    """Rejection sampling with the V4 DSpark draft's sequential q (each slot drawn from its logits plus the
    Markov bias of the token drawn before it) under confidence scheduling (threshold 0.3: some rows verify
    the whole block, some less): the joint of the first 4 tokens is the target's (chi-square over 32 x 256
    samples), and drafts are partly accepted."""
    from tests.spec.test_spec_sampling import HOT, P_VALUE_MIN, chi_square_p, exact_joint, sample_counts

    target, _ = small_pair()
    spec = js.SpecConfig.chain(2, confidence_threshold=0.3)
    counts = sample_counts(small_dspark(), spec, HOT, calls=32, model=target)
    assert chi_square_p(counts, exact_joint(HOT, model=target)) > P_VALUE_MIN
    out = js.generate(target, [[1, 2, 3, 4]] * 256, draft=small_dspark(), spec=spec, sampling=HOT, progress=False,
                      engine=js.EngineConfig(page_size=4, max_batch=256, max_seq_len=32, steps_per_call=4), seed=99)
    lens = np.concatenate([s.accept_lens for s in out.stats])
    verified = np.concatenate([s.verify_lens for s in out.stats])
    assert 1.05 < lens.mean() < 3.0 and (lens == 1).any() and (lens > 1).any(), lens.mean()
    assert (verified < 3).any() and (verified == 3).any(), np.bincount(verified)  # scheduling cuts some rows
