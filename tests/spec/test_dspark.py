"""DSpark block drafting inside the compiled loop: lossless greedy decoding (chains, a tree, page
sizes 1 and 16, a ragged batch, the three Markov heads, a reduced draft vocabulary, confidence
scheduling on and off), confidence scheduling changing what is verified and never the output,
exact speculative sampling with the Markov head's sequential q (with and without a confidence
cap), and the checks on SpecConfig and on drafts that do not fit.

The drafts are the ``speculators`` goldens' (``tests/data/golden/dspark``), trained briefly on
the DFlash goldens' target, so acceptance varies."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.drafts.dspark import DSparkConfig, dspark_draft
from jaxspec.model.checkpoints.speculators import init_dspark_params
from tests.spec import test_spec_sampling as sampling_test
from tests.spec.test_dflash import MAX_NEW, PROMPTS_4, engine, greedy_lossless, plain
from tests.model.drafts.test_golden_dspark import DRAFTS, draft, target

GREEDY = js.SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=())

LOSSLESS = [
    ("dspark_vanilla", js.SpecConfig.chain(5), 1),  # every slot drafts: a block of 5 for 5 tokens
    ("dspark_vanilla", js.SpecConfig.chain(5, confidence_threshold=0.3), 16),
    ("dspark_vanilla", js.SpecConfig(num_steps=4, topk=2, num_draft_tokens=7), 16),
    ("dspark_rnn", js.SpecConfig.chain(5, confidence_threshold=0.5), 1),  # the anchor drafts nothing
    ("dspark_gated_dv", js.SpecConfig.chain(4), 16),  # its own 192-token vocabulary
    ("dspark_gated_dv", js.SpecConfig.chain(3, confidence_threshold=0.2), 1),
]


@pytest.mark.parametrize("name,spec,page", [
    pytest.param(*c, id=f"{c[0]}-S{c[1].num_steps}_k{c[1].topk}-c{c[1].confidence_threshold}-page{c[2]}")
    for c in LOSSLESS])
def test_greedy_equals_plain_greedy(name, spec, page):
    acc, ver = greedy_lossless(target(), draft(name), spec, page)
    assert (acc > 1).any(), acc
    assert (acc <= ver).all()  # a row accepts nothing it did not ask to verify
    if spec.confidence_threshold is None:
        assert (ver == spec.num_draft_tokens).all()
    else:
        assert ver.min() < spec.num_steps + 1, ver


@functools.cache
def scheduled(threshold: float | None):
    spec = js.SpecConfig.chain(5, confidence_threshold=threshold)
    return js.generate(target(), PROMPTS_4, draft=draft("dspark_vanilla"), spec=spec, sampling=GREEDY,
                       engine=engine(16, 4), progress=False)


def test_confidence_scheduling_changes_what_is_verified_not_the_output():
    """Threshold 0 verifies every block whole (as without scheduling); a middle threshold verifies
    per request only what its confidence head predicts will be accepted (the running product of
    its per-slot probabilities), so fewer tokens but about as many accepted; threshold 1 verifies
    the root alone (plain decoding). The output is the same throughout."""
    full, middle, none = scheduled(0.0), scheduled(0.5), scheduled(1.0)
    assert full.token_ids == middle.token_ids == none.token_ids == plain(16, 4)
    verified = {k: np.concatenate([s.verify_lens for s in o.stats]) for k, o in (("0", full), ("0.5", middle),
                                                                                 ("1", none))}
    accepted = {k: np.concatenate([s.accept_lens for s in o.stats]) for k, o in (("0", full), ("0.5", middle),
                                                                                 ("1", none))}
    assert (verified["0"] == 6).all() and (verified["1"] == 1).all() and (accepted["1"] == 1).all()
    assert 1 < verified["0.5"].mean() < 6 and len(set(verified["0.5"].tolist())) > 2, verified["0.5"]
    # fewer tokens verified per token emitted: the confidence head skips what would be rejected
    assert verified["0.5"].sum() / accepted["0.5"].sum() < verified["0"].sum() / accepted["0"].sum()


def test_a_capped_row_accepts_nothing_past_its_own_length(monkeypatch):
    """Rows of one step share the verified prefix (the longest row's); without the cap a row also
    accepts draft tokens its confidence head did not ask for, so the same output takes fewer
    steps (and what a request verifies would depend on the batch it is in)."""
    import jaxspec.spec.block_loop as block_mod

    def uncapped(conf, threshold, _orig=block_mod.confident_prefix):
        return dataclasses.replace(_orig(conf, threshold), cap=False)

    out = scheduled(0.5)
    assert all(a <= v for s in out.stats for a, v in zip(s.accept_lens, s.verify_lens))
    monkeypatch.setattr(block_mod, "confident_prefix", uncapped)
    jax.clear_caches()
    loose = js.generate(target(), PROMPTS_4, draft=draft("dspark_vanilla"),
                        spec=js.SpecConfig.chain(5, confidence_threshold=0.5), sampling=GREEDY, engine=engine(16, 4),
                        progress=False)
    jax.clear_caches()
    assert loose.token_ids == out.token_ids  # still lossless, but not per-request
    steps = lambda o: sum(len(s.accept_lens) for s in o.stats)  # noqa: E731
    assert steps(loose) < steps(out), (steps(loose), steps(out))


# ----------------------------------------------------------------------------------- sampling


@functools.cache
def sampling_drafts() -> dict:
    """Random DSpark drafts for the 5-token target of the sampling test (block 4): a vanilla head
    with every slot drafting, and an rnn head whose anchor drafts nothing, with confidence heads."""
    t = sampling_test.target()
    c = t.config
    common = dict(hidden_size=c.hidden_size, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=16, vocab_size=c.vocab_size, target_layer_ids=(1, 3), num_target_layers=c.num_layers,
                  block_size=4, mask_token_id=4, markov_rank=4, confidence_head=True)
    vanilla = DSparkConfig(**common, markov_head_type="vanilla", confidence_with_markov=True)
    rnn = DSparkConfig(**common, markov_head_type="rnn", sample_from_anchor=False)
    out = {name: dspark_draft(cfg, init_dspark_params(cfg, jax.random.PRNGKey(7), t.params, scale=0.6))
           for name, cfg in (("vanilla", vanilla), ("rnn", rnn))}
    # Confidences of about 0.6-0.9 per slot, so a 0.6 threshold cuts chains at every length.
    conf = out["vanilla"].params["confidence"]
    out["vanilla"].params["confidence"] = dict(w=conf["w"] * 0.1, b=conf["b"] + 1.0)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name,threshold,sampling", [("vanilla", 0.6, sampling_test.FILTERED),
                                                     ("rnn", None, sampling_test.HOT)],
                         ids=["vanilla-confidence-topk-topp", "rnn-T1"])
def test_speculative_sampling_matches_target_distribution(name, threshold, sampling):
    """Rejection sampling with the q each token was drawn from (slot by slot, given the token drawn
    before it); with a confidence cap a row stopped by its cap draws its bonus from p."""
    probs = sampling_test.exact_joint(sampling)
    d = sampling_drafts()[name]
    spec = js.SpecConfig.chain(3, confidence_threshold=threshold)
    counts = sampling_test.sample_counts(d, spec, sampling, calls=32)
    assert sampling_test.chi_square_p(counts, probs) > sampling_test.P_VALUE_MIN
    out = js.generate(sampling_test.target(), [sampling_test.PROMPT] * 64, draft=d, spec=spec,
                      sampling=js.SamplingParams(temperature=1.0, max_new_tokens=12),
                      engine=js.EngineConfig(page_size=4, max_batch=64, max_seq_len=32), progress=False)
    acc = np.concatenate([s.accept_lens for s in out.stats])
    ver = np.concatenate([s.verify_lens for s in out.stats])
    assert (acc == 1).any() and (acc > 2).any()  # rejections and acceptances both happen
    if threshold is not None:
        assert ((acc == ver) & (ver < 4)).any() and (ver == 4).any()  # rows stopped by their cap (bonus from p)


def test_a_row_stopped_by_its_cap_draws_its_bonus_from_p():
    """Chain rejection sampling with a cap of one draft: x1 (the draft's only token, q one-hot) is
    accepted with p(x1) = 0.4; then the bonus comes from p itself (token 1 as often as p says),
    since x2 was never proposed; a rejection of x1 draws from p without x1."""
    import jax.numpy as jnp
    from jaxspec.spec.verify import verify_chain_rejection

    B, V = 8192, 4
    p = jnp.broadcast_to(jnp.asarray([0.4, 0.3, 0.2, 0.1]), (B, 4, V))  # the target after each node
    drafts = jnp.asarray([0, 1, 2])
    tokens = jnp.broadcast_to(jnp.concatenate([jnp.asarray([3]), drafts]), (B, 4))
    q = jnp.broadcast_to(jax.nn.one_hot(drafts, V), (B, 3, V))
    coins, final = jax.random.uniform(jax.random.PRNGKey(0), (B, 3)), jax.random.uniform(jax.random.PRNGKey(1), (B,))
    _, lens, predict = verify_chain_rejection(tokens, q, p, coins, final, limit=jnp.full((B,), 2))
    lens, bonus = np.asarray(lens), np.asarray(jnp.take_along_axis(predict, lens[:, None] - 1, axis=1)[:, 0])
    assert set(lens.tolist()) == {1, 2} and abs((lens == 2).mean() - 0.4) < 0.03
    after = np.bincount(bonus[lens == 2], minlength=V) / (lens == 2).sum()
    np.testing.assert_allclose(after, [0.4, 0.3, 0.2, 0.1], atol=0.04)  # p, not p without x2
    rejected = np.bincount(bonus[lens == 1], minlength=V) / (lens == 1).sum()
    np.testing.assert_allclose(rejected, [0.0, 0.5, 1 / 3, 1 / 6], atol=0.04)


# ----------------------------------------------------------------------------------- checks


def test_spec_checks_name_the_problem():
    t, sampling, eng = target(), js.SamplingParams(max_new_tokens=4), engine(16, 1)
    vanilla, rnn = draft("dspark_vanilla"), draft("dspark_rnn")  # blocks of 5 (anchor drafts) and 6 (it does not)
    with pytest.raises(ValueError, match=r"at most 5 draft tokens per block \(block_size 5, sample_from_anchor"):
        js.generate(t, [[1, 2]], draft=vanilla, spec=js.SpecConfig.chain(6), sampling=sampling, engine=eng)
    with pytest.raises(ValueError, match=r"at most 5 draft tokens per block \(block_size 6, sample_from_anchor false"):
        js.generate(t, [[1, 2]], draft=rnn, spec=js.SpecConfig.chain(6), sampling=sampling, engine=eng)
    with pytest.raises(ValueError, match=r"confidence_threshold must be None or in \[0, 1\], got 1.5"):
        js.SpecConfig.chain(3, confidence_threshold=1.5)
    with pytest.raises(ValueError, match="confidence_threshold schedules a chain"):
        js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5, confidence_threshold=0.5)
    with pytest.raises(ValueError, match="needs a draft with a confidence head"):
        js.generate(t, [[1, 2]], draft=draft("speculators_dflash"), spec=js.SpecConfig.chain(3, confidence_threshold=0.5),
                    sampling=sampling, engine=eng)


@pytest.mark.parametrize("changes,match", [
    ({"markov_head_type": "lstm"}, r"markov_head_type 'lstm' is not supported; supported: \['vanilla', 'gated', 'rnn'\]"),
    ({"speculators_model_type": "xpress"}, "speculators_model_type 'xpress' is not a draft jaxspec loads"),
    ({"transformer_layer_config.hidden_size": 96}, "hidden_size 96 .* must equal the target's hidden size 64"),
    ({"transformer_layer_config.vocab_size": 300}, "vocab_size 300 .* does not match the target's 256"),
    ({"aux_hidden_state_layer_ids": [2, 7]}, r"aux_hidden_state_layer_ids \[2, 7\] must be distinct HF hidden_states "
                                             r"indices in \[1, 6\]"),
    ({"speculators_config.proposal_methods": [{"speculative_tokens": 9}]}, "speculative_tokens 9 exceeds what a block "
                                                                           "of 5 holds"),
    ({"draft_vocab_size": 256}, r"markov_w2.weight' has shape \(192, 8\), expected \(256, 8\)"),
])
def test_drafts_that_do_not_fit_are_refused_by_name(tmp_path, changes, match):
    name = "dspark_gated_dv" if "draft_vocab_size" in changes else "dspark_vanilla"
    with pytest.raises(ValueError, match=match):
        js.load_draft(DRAFTS.copy_with(tmp_path, name, **changes), target())
