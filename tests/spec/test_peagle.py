"""P-EAGLE drafting through the block proposer inside the compiled loop: lossless greedy decoding
(a tree of the top-k alternatives per position, a chain of one (no mask rows), a chain deeper than
the trained depths over a reduced draft vocabulary; page sizes 1 and 16, a ragged batch), exact
speculative sampling with the q each position was drawn from, and the checks on SpecConfig and on
heads that do not fit their target.

The heads are the ``speculators`` goldens' (``tests/data/golden/peagle``), trained briefly on the
DFlash goldens' target, so acceptance varies."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxspec as js
from jaxspec.model.drafts.peagle import PEagleConfig, peagle_draft
from jaxspec.model.checkpoints.peagle import init_peagle_params
from tests.spec import test_spec_sampling as sampling_test
from tests.spec.test_dflash import engine, greedy_lossless
from tests.model.drafts.test_golden_peagle import DRAFTS, draft, target

LOSSLESS = [
    ("peagle", js.SpecConfig(num_steps=5, topk=2, num_draft_tokens=8), 16),  # the greedy chain + alternatives
    ("peagle", js.SpecConfig.chain(1), 1),  # draft 1 from the seed alone: no mask rows
    ("peagle_llama_dv", js.SpecConfig.chain(6), 16),  # past its 4 trained depths, 192-token vocabulary
]


@pytest.mark.parametrize("name,spec,page", [
    pytest.param(*c, id=f"{c[0]}-S{c[1].num_steps}_k{c[1].topk}_n{c[1].num_draft_tokens}-page{c[2]}")
    for c in LOSSLESS])
def test_greedy_equals_plain_greedy(name, spec, page):
    acc, _ = greedy_lossless(target(), draft(name), spec, page)
    assert (acc > 1).mean() > 0.15, acc  # the trained heads' first proposal is right in 22-29% of the steps


# ----------------------------------------------------------------------------------- sampling


@functools.cache
def sampling_draft():
    """A random P-EAGLE head for the 5-token target of the sampling test, over a 4-token draft
    vocabulary (the fifth token is never proposed: q is 0 there)."""
    t = sampling_test.target()
    c = t.config
    cfg = PEagleConfig(hidden_size=c.hidden_size, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                       head_dim=16, vocab_size=c.vocab_size, draft_vocab_size=4, target_hidden_size=c.hidden_size,
                       aux_layers=(1, 3), mask_token_id=4, num_speculative_tokens=3, qk_norm=True, fc_norm=True)
    return peagle_draft(cfg, init_peagle_params(cfg, jax.random.PRNGKey(7), scale=0.6))


@pytest.mark.slow
def test_speculative_sampling_matches_target_distribution():
    """Chain rejection sampling with the q each position was drawn from (the seed's for draft 1,
    the mask rows' for the rest): the joint distribution of the first tokens is the target's."""
    sampling = sampling_test.FILTERED
    probs = sampling_test.exact_joint(sampling)
    d = sampling_draft()
    counts = sampling_test.sample_counts(d, js.SpecConfig.chain(3), sampling, calls=24)
    assert sampling_test.chi_square_p(counts, probs) > sampling_test.P_VALUE_MIN
    out = js.generate(sampling_test.target(), [sampling_test.PROMPT] * sampling_test.ROWS, draft=d,
                      spec=js.SpecConfig.chain(3), sampling=sampling, seed=99, progress=False,
                      engine=js.EngineConfig(page_size=4, max_batch=sampling_test.ROWS, max_seq_len=32, steps_per_call=4))
    acc = np.concatenate([s.accept_lens for s in out.stats])
    assert (acc == 1).any() and (acc > 2).any()  # rejections and acceptances both happen


# ----------------------------------------------------------------------------------- checks


def test_spec_checks_name_the_problem():
    t, sampling, eng, d = target(), js.SamplingParams(max_new_tokens=4), engine(16, 1), draft("peagle")
    with pytest.raises(ValueError, match=r"a P-EAGLE tree has at most num_steps \* topk = 6 draft nodes"):
        js.generate(t, [[1, 2]], draft=d, spec=js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=8),
                    sampling=sampling, engine=eng)
    with pytest.raises(ValueError, match="needs a draft with a confidence head .* this 'peagle' draft has none"):
        js.generate(t, [[1, 2]], draft=d, spec=js.SpecConfig.chain(3, confidence_threshold=0.5), sampling=sampling,
                    engine=eng)


def _copy_with(tmp_path, name: str, drop: str | None = None, **changes):
    """A copy of golden head ``name`` whose config.json has ``changes`` (dotted keys reach in) and
    whose tensors lack ``drop``."""
    dst = DRAFTS.copy_with(tmp_path, name, **changes)
    if drop is not None:
        tensors = load_file(dst / "model.safetensors")
        del tensors[drop]
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("name,changes,match", [
    ("peagle", {"transformer_layer_config.hidden_size": 96}, "P-EAGLE hidden_size 96 .* must equal the target's hidden "
                                                             "size 64"),
    ("peagle", {"target_hidden_size": 32}, r"P-EAGLE hidden_size 64 \(target_hidden_size 32\) must equal the target's"),
    ("peagle", {"transformer_layer_config.vocab_size": 300}, "P-EAGLE vocab_size 300 .* does not match the target's 256"),
    ("peagle", {"eagle_aux_hidden_state_layer_ids": [2, 7]}, r"eagle_aux_hidden_state_layer_ids \[2, 7\] must be "
                                                             r"distinct HF hidden_states indices in \[1, 6\]"),
    ("peagle", {"mask_token_id": 256}, "P-EAGLE mask_token_id 256 is outside the vocabulary of 256"),
    ("peagle", {"transformer_layer_config.layer_types": ["sliding_attention"]}, "sliding-window attention"),
    ("peagle_llama_dv", {"draft_vocab_size": 300}, "P-EAGLE draft_vocab_size 300 exceeds the target vocabulary 256"),
    ("peagle_llama_dv", {"draft_vocab_size": 256}, r"lm_head.weight' has shape \(192, 64\), expected \(256, 64\)"),
    ("peagle_llama_dv", {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, r"'mask_hidden' has shape \(1, 1, 128\), "
                                                                         r"expected \(1, 1, 192\)"),
])
def test_heads_that_do_not_fit_are_refused_by_name(tmp_path, name, changes, match):
    with pytest.raises(ValueError, match=match):
        js.load_draft(_copy_with(tmp_path, name, **changes), target())


def test_missing_tensors_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="a speculators peagle config, but the tensors are not a P-EAGLE head's"):
        js.load_draft(_copy_with(tmp_path, "peagle", drop="mask_hidden"), target())
    with pytest.raises(ValueError, match="draft_vocab_size 192 < the target's 256 but the checkpoint has no d2t map"):
        js.load_draft(_copy_with(tmp_path, "peagle_llama_dv", drop="d2t"), target())


def test_check_fits_names_the_target_it_does_not_fit():
    """A loaded head against targets it was not built for: fewer layers than its taps, another
    width, another vocabulary."""
    d, cfg = draft("peagle").config, target().config
    with pytest.raises(ValueError, match=r"taps target hidden states \[1, 3, 5\]; the target has 4 layers"):
        d.check_fits(dataclasses.replace(cfg, num_layers=4))
    with pytest.raises(ValueError, match="built for target hidden size 64, the target has 128"):
        d.check_fits(dataclasses.replace(cfg, hidden_size=128))
    with pytest.raises(ValueError, match="P-EAGLE draft vocab_size 256 does not match the target's 512"):
        d.check_fits(dataclasses.replace(cfg, vocab_size=512))
