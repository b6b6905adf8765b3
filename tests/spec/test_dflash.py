"""DFlash block drafting inside the compiled loop: the block tree's shape, lossless greedy
decoding (chains and trees, page sizes 1 and 16, ragged batches, DFlash and DFlash 2, full,
sliding and causal draft layers), exact speculative sampling, and the SpecConfig checks.

The drafts are the reference goldens' (``tests/data/golden/dflash``): trained briefly on their
target, so acceptance varies (a random draft accepts almost nothing)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.spec.tree import block_tree
from jaxspec.spec.verify import verify_tree_greedy
from jaxspec.model.drafts.dflash import DFlashConfig, dflash_draft
from jaxspec.model.checkpoints.dflash import init_dflash_params
from tests.conftest import engine as conftest_engine
from tests.spec import test_spec_sampling as sampling_test
from tests.model.drafts.test_golden_dflash import draft, target

MAX_NEW = 40
PROMPTS_4 = [[3, 71, 200, 14, 9, 120, 33], [250, 17, 40], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [88]]
PROMPTS_1 = [[12, 99, 230, 31, 5]]


# ----------------------------------------------------------------------------------- block tree


def test_block_tree_full_budget():
    """S = 3 positions, k = 2: the chain c0 -> c1 -> c2 and one extra leaf per position, hanging
    from the chain node before it."""
    tokens = jnp.asarray([[[10, 11], [20, 21], [30, 31]]])
    probs = jnp.asarray([[[0.6, 0.3], [0.5, 0.4], [0.9, 0.05]]])
    t = block_tree(jnp.asarray([5]), tokens, probs, num_draft_tokens=7)
    np.testing.assert_array_equal(t.tokens[0], [5, 10, 11, 20, 21, 30, 31])
    np.testing.assert_array_equal(t.parent[0], [-1, 0, 0, 1, 1, 3, 3])
    np.testing.assert_array_equal(t.depth[0], [0, 1, 1, 2, 2, 3, 3])
    ancestors = {i: sorted(np.flatnonzero(np.asarray(t.mask[0, i])).tolist()) for i in range(7)}
    assert ancestors == {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 1, 3, 5], 6: [0, 1, 3, 6]}


def test_block_tree_budget_keeps_best_path_scores_closed_under_ancestors():
    tokens = jnp.asarray([[[10, 11], [20, 21], [30, 31]]])
    probs = jnp.asarray([[[0.6, 0.3], [0.5, 0.4], [0.9, 0.05]]])
    # path scores: c0 .6, l0 .3, c1 .3, l1 .24, c2 .27, l2 .015 -> the best 4: c0, l0, c1, c2
    t = block_tree(jnp.asarray([5]), tokens, probs, num_draft_tokens=5)
    np.testing.assert_array_equal(t.tokens[0], [5, 10, 11, 20, 30])
    np.testing.assert_array_equal(t.parent[0], [-1, 0, 0, 1, 3])
    # the target's argmax after each node: root -> 11 (the leaf), so the walk takes the leaf
    predict = jnp.asarray([[11, 20, 7, 30, 8]])
    idx, lens, _ = verify_tree_greedy(t, predict, num_steps=3)
    np.testing.assert_array_equal(idx[0], [0, 2, -1, -1])
    assert int(lens[0]) == 2
    predict = jnp.asarray([[10, 20, 7, 30, 8]])
    idx, lens, _ = verify_tree_greedy(t, predict, num_steps=3)
    np.testing.assert_array_equal(idx[0], [0, 1, 3, 4])


def test_chain_from_a_block_has_no_topk_sort_gather():
    """DFlash's chain is the static topk=1 path: argmax proposals, a constant chain tree; the tree
    from the same block uses top_k and sort (so the check can fail)."""
    from jaxspec.spec.plan import Plan
    from jaxspec.spec.shape import shape_for
    from tests.spec.test_tree import _primitives

    d = draft("dflash")
    hidden = jnp.ones((2, 7, 64), jnp.float32)
    bonus = jnp.asarray([3, 4], jnp.int32)

    def build(spec):
        plan = Plan(target=target().config, draft=d.config, spec=spec)
        shape = shape_for(plan)
        return lambda h: shape.build_block(bonus, *d.config.candidates(d.params, h, bonus, shape.block_width(plan)), plan)

    chain = _primitives(build(js.SpecConfig.chain(7)), hidden)
    assert not chain & {"top_k", "sort", "gather"}, chain
    tree = _primitives(build(js.SpecConfig(num_steps=7, topk=2, num_draft_tokens=9)), hidden)
    assert {"top_k", "sort"} <= tree


@functools.cache
def tiny_dflash(target, version: int = 1):
    """A random DFlash (2) draft for the conftest tiny target: a full bidirectional layer and a
    causal sliding one (window 3)."""
    extra = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=4, selector_top_k=3) if version == 2 else {}
    cfg = DFlashConfig(version=version, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, vocab_size=96, target_layer_ids=(1, 3), num_target_layers=4,
                       block_size=4, mask_token_id=95, layer_windows=(None, 3), layer_causal=(False, True), **extra)
    return dflash_draft(cfg, init_dflash_params(cfg, jax.random.PRNGKey(version), target.params, scale=0.3))


# ----------------------------------------------------------------------------------- lossless


def engine(page: int, batch: int) -> js.EngineConfig:
    return conftest_engine(page, batch, max_seq_len=80)


@functools.cache
def plain(page: int, batch: int):
    prompts = PROMPTS_4 if batch == 4 else PROMPTS_1
    return js.generate(target(), prompts, sampling=js.SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=()),
                       engine=engine(page, batch), progress=False).token_ids


def greedy_lossless(target_model, d, spec, page: int, batch: int = 4):
    """Greedy decoding with draft ``d`` under ``spec``, checked lossless: the tokens of ``plain``,
    every page freed, every accept length in [1, num_steps + 1]. Returns the accept and the verify
    lengths of every step."""
    prompts = PROMPTS_4 if batch == 4 else PROMPTS_1
    out = js.generate(target_model, prompts, draft=d, spec=spec,
                      sampling=js.SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=()),
                      engine=engine(page, batch), progress=False)
    assert out.token_ids == plain(page, batch)
    assert out.kv_pages_free == out.kv_pages_total
    acc = np.concatenate([s.accept_lens for s in out.stats])
    assert acc.min() >= 1 and acc.max() <= spec.num_steps + 1, acc
    return acc, np.concatenate([s.verify_lens for s in out.stats])


LOSSLESS = [
    ("dflash", js.SpecConfig.chain(7), 1, 4),
    ("dflash", js.SpecConfig(num_steps=7, topk=3, num_draft_tokens=16), 16, 4),
    ("dflash2", js.SpecConfig.chain(5), 16, 4),
    ("dflash2", js.SpecConfig(num_steps=7, topk=4, num_draft_tokens=12), 1, 4),
    ("dflash_mixed", js.SpecConfig(num_steps=7, topk=2, num_draft_tokens=10), 1, 4),
]


@pytest.mark.parametrize("name,spec,page,batch", [
    pytest.param(*c, id=f"{c[0]}-S{c[1].num_steps}_k{c[1].topk}_n{c[1].num_draft_tokens}-page{c[2]}-B{c[3]}")
    for c in LOSSLESS])
def test_greedy_equals_plain_greedy(name, spec, page, batch):
    lens, _ = greedy_lossless(target(), draft(name), spec, page, batch)
    if name != "dflash_mixed":  # the trained drafts: some proposals accepted, not all
        assert lens.mean() > 1.3 and (lens < spec.num_steps + 1).any(), lens


# ----------------------------------------------------------------------------------- spec checks


def test_block_size_bounds_the_chain():
    d = draft("dflash")  # block 8
    eng = engine(16, 1)
    sampling = js.SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match=r"blocks of 8 tokens \(block_size\): num_steps=8 needs a block of 9"):
        js.generate(target(), PROMPTS_1, draft=d, spec=js.SpecConfig.chain(8), sampling=sampling, engine=eng)
    with pytest.raises(ValueError, match="at most num_steps \\* topk = 6 draft nodes"):
        js.generate(target(), PROMPTS_1, draft=d, spec=js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=8),
                    sampling=sampling, engine=eng)
    with pytest.raises(ValueError, match="topk=5 > selector_top_k=4"):
        js.generate(target(), PROMPTS_1, draft=draft("dflash2"), spec=js.SpecConfig(num_steps=3, topk=5,
                    num_draft_tokens=8), sampling=sampling, engine=eng)
    with pytest.raises(ValueError, match="adaptive_steps"):
        js.generate(target(), PROMPTS_1, draft=d, spec=js.SpecConfig.chain(3, adaptive_steps=(3, 9)),
                    sampling=sampling, engine=eng)
    assert d.block_size == 8 and js.SpecConfig.chain(d.block_size - 1).num_draft_tokens == 8
    with pytest.raises(AttributeError, match="no block_size"):
        js.standalone_draft(target()).block_size


# ----------------------------------------------------------------------------------- sampling


@functools.cache
def sampling_drafts() -> dict:
    """Random DFlash / DFlash 2 drafts for the 5-token target of the sampling test."""
    t = sampling_test.target()
    c = t.config
    common = dict(hidden_size=c.hidden_size, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=16, vocab_size=c.vocab_size, target_layer_ids=(1, 3), num_target_layers=c.num_layers,
                  block_size=4, mask_token_id=4)
    one = DFlashConfig(version=1, **common)
    two = DFlashConfig(version=2, conv_kernel_size=2, conv_group_size=16, selector_rank=4, selector_top_k=3,
                       layer_windows=(3, None), layer_causal=(False, False), **common)
    return {name: dflash_draft(cfg, init_dflash_params(cfg, jax.random.PRNGKey(7), t.params, scale=0.4))
            for name, cfg in (("dflash", one), ("dflash2", two))}


@pytest.mark.slow
@pytest.mark.parametrize("name,sampling", [("dflash", sampling_test.FILTERED), ("dflash2", sampling_test.HOT)],
                         ids=["dflash-topk-topp", "dflash2-T1"])
def test_speculative_sampling_matches_target_distribution(name, sampling):
    """Rejection sampling with the draft's q (DFlash 2: the selector's q over its candidates)."""
    probs = sampling_test.exact_joint(sampling)
    d = sampling_drafts()[name]
    counts = sampling_test.sample_counts(d, js.SpecConfig.chain(3), sampling, calls=32)
    assert sampling_test.chi_square_p(counts, probs) > sampling_test.P_VALUE_MIN
    out = js.generate(sampling_test.target(), [sampling_test.PROMPT] * 64, draft=d, spec=js.SpecConfig.chain(3),
                      sampling=js.SamplingParams(temperature=1.0, max_new_tokens=12),
                      engine=js.EngineConfig(page_size=4, max_batch=64, max_seq_len=32), progress=False)
    lens = np.concatenate([s.accept_lens for s in out.stats])
    assert (lens == 1).any() and (lens > 2).any()  # rejections and acceptances both happen


# ----------------------------------------------------------------------------------- Gemma 4 target


def test_gemma4_target_tree_past_its_window():
    """The DFlash draft trained on the Gemma 4 golden target, with the target's sliding layers
    narrowed to a window of 8 (the window pool returns pages while the requests run): a block tree
    at page 16 over a ragged batch equals plain greedy, and some proposals are accepted."""
    import dataclasses

    from tests.model.drafts import test_golden_dflash as goldens

    wide = goldens.target("dflash_gemma4")
    t = dataclasses.replace(wide, config=dataclasses.replace(wide.config, sliding_window=8))
    d = goldens.draft("dflash", "dflash_gemma4")
    prompts = goldens.case("dflash", "dflash_gemma4")["prompts"]
    sampling = js.SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=())
    eng = js.EngineConfig(page_size=16, max_batch=4, max_seq_len=80, steps_per_call=4)
    plain_ids = js.generate(t, prompts, sampling=sampling, engine=eng, progress=False).token_ids
    wide_ids = [goldens.golden("dflash_gemma4")[f"dflash/generate/p{j}/b8/tokens"].tolist() for j in range(len(prompts))]
    assert plain_ids != wide_ids  # the narrow window changes the text: it is in force
    spec = js.SpecConfig(num_steps=7, topk=2, num_draft_tokens=10)
    out = js.generate(t, prompts, draft=d, spec=spec, sampling=sampling, engine=eng, progress=False)
    assert out.token_ids == plain_ids
    assert out.kv_pages_free == out.kv_pages_total
    lens = np.concatenate([s.accept_lens for s in out.stats])
    assert lens.max() >= 3, lens
