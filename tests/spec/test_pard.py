"""PARD drafting inside the compiled loop (the block draft loop over an LM with its own KV):
lossless greedy decoding (chains and a tree, page sizes 1 and 16, a ragged batch, Qwen3 and Llama
drafts), exact speculative sampling with each position's own q, and the refusals of drafts that do
not fit and of shapes a PARD block cannot propose.

The drafts are the PARD goldens' (``tests/data/golden/pard``), trained briefly with PARD's
objective for the DFlash goldens' target, so acceptance varies."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.targets import Model
from tests.spec import test_spec_sampling as sampling_test
from tests.spec.test_dflash import engine, greedy_lossless
from tests.model.drafts.test_golden_pard import DRAFTS, draft, target

LOSSLESS = [
    ("pard_qwen3", js.SpecConfig.chain(5), 1),
    ("pard_llama", js.SpecConfig.chain(3), 16),
    ("pard_qwen3", js.SpecConfig(num_steps=4, topk=2, num_draft_tokens=7), 16),  # alternatives off the chain
]


@pytest.mark.parametrize("name,spec,page", [
    pytest.param(*c, id=f"{c[0]}-S{c[1].num_steps}_k{c[1].topk}_n{c[1].num_draft_tokens}-page{c[2]}")
    for c in LOSSLESS])
def test_greedy_equals_plain_greedy(name, spec, page):
    acc, ver = greedy_lossless(target(), draft(name), spec, page)
    assert acc.mean() > 1.3 and (acc < spec.num_steps + 1).any(), acc  # some proposals accepted, not all
    assert (ver == spec.num_draft_tokens).all(), ver


# ----------------------------------------------------------------------------------- sampling


@functools.cache
def sampling_draft():
    """A PARD draft for the 5-token target of the sampling test: a perturbed copy of it whose mask
    token is token 4 (its mask rows were never trained: q is whatever they say)."""
    t = sampling_test.target()
    keys = iter(np.asarray(jax.random.split(jax.random.PRNGKey(9), 64)))  # numpy: iterating a jax.Array compiles
    noisy = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape, x.dtype), t.params)
    return js.pard_draft(Model(config=t.config, params=noisy, dtype=t.dtype), mask_token_id=4)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [sampling_test.HOT, sampling_test.FILTERED], ids=["T1", "topk-topp"])
def test_speculative_sampling_matches_target_distribution(sampling):
    """Chain rejection sampling with the q each position's token was drawn from."""
    probs = sampling_test.exact_joint(sampling)
    spec = js.SpecConfig.chain(3)
    counts = sampling_test.sample_counts(sampling_draft(), spec, sampling, calls=24)
    assert sampling_test.chi_square_p(counts, probs) > sampling_test.P_VALUE_MIN
    out = js.generate(sampling_test.target(), [sampling_test.PROMPT] * 64, draft=sampling_draft(), spec=spec,
                      sampling=js.SamplingParams(temperature=1.0, max_new_tokens=12),
                      engine=js.EngineConfig(page_size=4, max_batch=64, max_seq_len=32), progress=False)
    acc = np.concatenate([s.accept_lens for s in out.stats])
    assert (acc == 1).any() and (acc > 2).any()  # rejections and acceptances both happen


# ----------------------------------------------------------------------------------- checks


@pytest.mark.parametrize("name,drop,changes,match", [
    ("pard_qwen3", (), {"vocab_size": 300}, "PARD draft vocab_size 300 does not match the target's 256"),
    ("pard_qwen3", ("pard_token",), {}, "spd_type 'pard' but no pard_token: a PARD draft needs the id of its mask "
                                         "token"),
    ("pard_qwen3", (), {"pard_token": 256}, "PARD pard_token 256 is outside the target's vocabulary of 256 tokens"),
    ("pard_qwen3", (), {"pard_token": "<mask>"}, "PARD pard_token must be an integer token id, got '<mask>'"),
    ("pard_llama", (), {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 8},
     "a PARD draft must be a Llama-family LM .* with full attention; this is a mistral LM with a sliding window"),
    ("pard_qwen3", (), {"architectures": ["GPT2LMHeadModel"]}, "a PARD config .* but architectures "
                                                              r"\['GPT2LMHeadModel'\] is not an LM jaxspec runs"),
])
def test_drafts_that_do_not_fit_are_refused_by_name(tmp_path, name, drop, changes, match):
    with pytest.raises(ValueError, match=match):
        js.load_draft(DRAFTS.copy_with(tmp_path, name, drop, **changes), target())


def test_without_pard_token_an_lm_is_a_standalone_draft(tmp_path):
    d = js.load_draft(DRAFTS.copy_with(tmp_path, "pard_llama", ("pard_token", "spd_type")), target())
    assert d.kind == "standalone" and d.config.proposer == "recurrent"


def test_spec_and_fit_checks_name_the_problem():
    t, sampling, eng = target(), js.SamplingParams(max_new_tokens=4), engine(16, 1)
    d = draft("pard_qwen3")
    with pytest.raises(ValueError, match=r"a PARD tree has at most num_steps \* topk = 6 draft nodes"):
        js.generate(t, [[1, 2]], draft=d, spec=js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=8),
                    sampling=sampling, engine=eng)
    with pytest.raises(ValueError, match="needs a draft with a confidence head"):
        js.generate(t, [[1, 2]], draft=d, spec=js.SpecConfig.chain(3, confidence_threshold=0.5), sampling=sampling,
                    engine=eng)
    with pytest.raises(ValueError, match=r"PARD draft mask token \(pard_token\) 256 is outside the vocabulary"):
        js.generate(t, [[1, 2]], draft=js.pard_draft(t, 256), spec=js.SpecConfig.chain(3), sampling=sampling,
                    engine=eng)
