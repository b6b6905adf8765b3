"""Llama-family targets against HF transformers: logits, hidden states, EAGLE-3 taps, greedy tokens."""

import functools

import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.targets import forward_sequence
from tests.conftest import engine
from tests.model.golden import arrays, case_dir, cases

LLAMA_FAMILY = [c for c in cases("target") if not c["model_type"].startswith("deepseek")]
IDS = [c["name"] for c in LLAMA_FAMILY]


@functools.cache
def load(name):
    case = next(c for c in LLAMA_FAMILY if c["name"] == name)
    return case, js.load_model(case_dir(case), dtype="float32"), arrays(case)


@pytest.mark.parametrize("name", IDS)
def test_logits_and_hidden_match_hf(name):
    case, model, ref = load(name)
    aux_layers = tuple(case["eagle3_aux_layers"] or ())
    for i, prompt in enumerate(case["prompts"]):
        logits, hidden, aux = forward_sequence(model, np.asarray([prompt]), aux_layers=aux_layers)
        np.testing.assert_allclose(np.asarray(logits[0]), ref[f"logits_{i}"], atol=case["atol"], rtol=case["rtol"])
        np.testing.assert_allclose(np.asarray(hidden[0]), ref[f"hidden_final_{i}"], atol=case["atol"], rtol=case["rtol"])
        if f"aux_{i}" in ref:
            np.testing.assert_allclose(np.asarray(aux[0]), ref[f"aux_{i}"], atol=case["atol"], rtol=case["rtol"])


def test_eagle3_taps_follow_the_formula():
    case, model, _ = load("llama3")
    assert model.config.eagle3_aux_layers() == tuple(case["eagle3_aux_layers"])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", IDS)
def test_greedy_tokens_match_hf(name, page_size):
    case, model, ref = load(name)
    n = case["greedy_new_tokens"]
    sampling = js.SamplingParams(max_new_tokens=n, stop_token_ids=())
    eng = engine(page_size, max_batch=4, max_seq_len=64)
    batched = js.generate(model, case["prompts"], sampling=sampling, engine=eng)  # batch 3 (ragged)
    for i in range(len(case["prompts"])):
        assert batched.token_ids[i] == ref[f"greedy_{i}"].tolist(), f"prompt {i}"
    single = js.generate(model, case["prompts"][:1], sampling=sampling, engine=eng)  # batch 1
    assert single.token_ids[0] == ref["greedy_0"].tolist()


def test_config_forms_parse_identically():
    """The classic (rope_theta + rope_scaling) and rope_parameters config forms both load."""
    forms = {c["rope_form"] for c in LLAMA_FAMILY}
    assert forms == {"classic", "rope_parameters"}
    _, llama3, _ = load("llama3")
    assert llama3.config.rope.kind == "llama3" and llama3.config.rope.theta == 500000.0
