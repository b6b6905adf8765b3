"""Gemma 4 targets, Gemma 4 assistants and Mistral with a sliding window against HF transformers
(tests/data/golden/sliding_window): logits, hidden states, greedy tokens past the window; the
assistant's logits and returned hidden given the same target KV; config forms and refusals."""

import copy
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.config import ConfigError
from jaxspec.model.drafts.assistant import assistant_forward, assistant_logits
from jaxspec.model.targets import forward_sequence
from jaxspec.model.targets.gemma4_config import gemma4_config_from_hf
from tests.conftest import engine
from tests.model.sliding_golden import arrays, assistant, case, case_dir, prefill_context, target

TARGETS = ["gemma4_text", "gemma4_condgen", "mistral_swa"]
ASSISTANTS = ["gemma4_assistant", "gemma4_assistant_plain"]


@functools.partial(jax.jit, static_argnums=1)
def assistant_step(params, cfg, tokens, hidden, ctx, positions):  # one compiled draft step
    h_out, y = assistant_forward(params, cfg, tokens, hidden, ctx, positions=positions)
    return h_out, assistant_logits(params, cfg, y)


@pytest.mark.parametrize("name", TARGETS)
def test_logits_and_hidden_match_hf(name):
    """The longest golden prompt (17 tokens, windows 5-6): every position's logits and hidden."""
    c, model, ref = case(name), target(name), arrays(name)
    i = len(c["prompts"]) - 1
    prompt = c["prompts"][i]
    logits, hidden, _ = forward_sequence(model, np.asarray([prompt]))
    np.testing.assert_allclose(np.asarray(logits[0]), ref[f"logits_{i}"], atol=c["atol"], rtol=c["rtol"])
    np.testing.assert_allclose(np.asarray(hidden[0]), ref[f"hidden_final_{i}"], atol=c["atol"], rtol=c["rtol"])


@pytest.mark.parametrize("name,page_size", [("gemma4_text", 1), ("mistral_swa", 1)])
def test_greedy_tokens_past_the_window_match_hf(name, page_size):
    """Ragged batch of 3 through the engine; sequences run to 33 positions, windows are 5-6 (page
    size 16: tests/draft/test_sliding_lossless.py compares its speculative runs with these tokens)."""
    c, model, ref = case(name), target(name), arrays(name)
    sampling = js.SamplingParams(max_new_tokens=c["greedy_new_tokens"], stop_token_ids=())
    out = js.generate(model, c["prompts"], sampling=sampling, engine=engine(page_size, max_batch=4, max_seq_len=64))
    assert out.token_ids == [ref[f"greedy_{i}"].tolist() for i in range(len(c["prompts"]))]
    assert out.kv_window_pages_free == out.kv_window_pages_total > 0
    if page_size == 1:  # positions fell behind the window while requests ran: their pages came back
        assert out.kv_window_pages_returned > 0


@pytest.mark.parametrize("name", ASSISTANTS)
def test_assistant_matches_hf_given_the_target_kv(name):
    """HF's recipe: the target over the prompt, then 4 draft steps at position T fed the golden
    token and hidden; the selected logits, the selection and the returned hidden match, the
    fill outside the selected clusters is -inf where HF writes min(selected) - 1."""
    c, draft, ref = case(name), assistant(name), arrays(name)
    model, cfg = target(c["target"]), assistant(name).config.model
    i = len(c["prompts"]) - 1  # the longest prompt (17 tokens): the window layers see only their window
    prompt = c["prompts"][i]
    ctx, hidden = prefill_context(model, prompt)
    np.testing.assert_allclose(np.asarray(hidden[0, -1]), ref[f"hidden_in_{i}"][0], atol=c["atol"], rtol=c["rtol"])
    T = len(prompt)
    for j in range(c["draft_steps"]):
        tok = jnp.asarray([[int(ref[f"tokens_{i}"][j])]], jnp.int32)
        h_in = jnp.asarray(ref[f"hidden_in_{i}"][j])[None, None]
        h_out, logits = assistant_step(draft.params, cfg, tok, h_in, ctx, jnp.full((1, 1), T, jnp.int32))
        logits = np.asarray(logits)[0, 0]
        hf = ref[f"logits_{i}"][j]
        picked = np.isfinite(logits)
        if c["use_ordered_embeddings"]:
            assert picked.sum() == c["centroid_intermediate_top_k"] * 256 // c["num_centroids"]
            assert (hf[~picked] == hf.min()).all() and (hf[picked] > hf.min()).all()
        else:
            assert picked.all()
        np.testing.assert_allclose(logits[picked], hf[picked], atol=c["atol"], rtol=c["rtol"])
        np.testing.assert_allclose(np.asarray(h_out[0, 0]), ref[f"hidden_out_{i}"][j], atol=c["atol"],
                                   rtol=c["rtol"])


def test_assistant_detection_and_fit():
    d = assistant("gemma4_assistant")
    cfg = d.config.model
    assert d.kind == "frozen_kv" and cfg.style == "gemma4"
    assert cfg.kv_layers == (4, 5) and cfg.kv_sources == (("window", 3), ("full", 1))  # last layer of each type
    assert cfg.window == 6 and cfg.num_centroids == 16 and cfg.centroid_top_k == 4
    with pytest.raises(ConfigError, match="cannot serve a LlamaConfig target"):
        js.load_draft(case_dir("gemma4_assistant"), target("mistral_swa"))
    with pytest.raises(ConfigError, match="full_attention layers read the target KV \\(2 heads x 32\\), assistant "
                                          "has 1 x 32"):
        js.load_draft(case_dir("gemma4_assistant"), target("gemma4_condgen"))


def _text_config(name: str) -> dict:
    with open(f"{case_dir(name)}/config.json") as f:
        return json.load(f)


def test_config_forms_parse_identically():
    """per_layer_config (transformers 5) and global_head_dim (published) give the same shapes."""
    raw = _text_config("gemma4_text")
    published = copy.deepcopy(raw)
    published.pop("per_layer_config")
    published.update(global_head_dim=32, num_global_key_value_heads=1)
    assert gemma4_config_from_hf(raw) == gemma4_config_from_hf(published)
    cfg = gemma4_config_from_hf(raw)
    assert (cfg.full.head_dim, cfg.full.num_kv_heads, cfg.full.k_eq_v) == (32, 1, True)
    assert (cfg.sliding.head_dim, cfg.sliding.num_kv_heads, cfg.sliding.k_eq_v) == (16, 2, False)
    assert cfg.full.rope.kind == "proportional" and cfg.full.rope.partial_rotary_factor == 0.25
    assert cfg.period == 3 and cfg.final_logit_softcapping == 30.0
    condgen = target("gemma4_condgen").config
    assert condgen.prefix == "model.language_model." and condgen.full.num_kv_heads == 2 and not condgen.full.k_eq_v
    no_global = copy.deepcopy(published)
    no_global.pop("global_head_dim")
    assert gemma4_config_from_hf(no_global).full.head_dim == 512  # HF's default, even in a tiny config


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size_per_layer_input", 256, "per-layer input embeddings"),
    ("num_kv_shared_layers", 2, "KV sharing across layers"),
    ("enable_moe_block", True, "MoE blocks"),
    ("use_bidirectional_attention", "all", "use_bidirectional_attention='all'"),
    ("hidden_activation", "silu", "hidden_activation 'silu'"),
])
def test_features_of_other_sizes_are_refused_by_name(field, value, message):
    raw = _text_config("gemma4_text")
    raw[field] = value
    with pytest.raises(ConfigError, match=message):
        gemma4_config_from_hf(raw)
    absent = _text_config("gemma4_text")
    absent.pop("hidden_size_per_layer_input")  # HF's default is 256: PLE on
    with pytest.raises(ConfigError, match="per-layer input embeddings"):
        gemma4_config_from_hf(absent)


def test_sliding_window_models_are_refused_on_a_tensor_parallel_mesh():
    """The window pool runs on one device: Gemma 4 and Mistral with a window say so at load."""
    from jaxspec.model.targets.gemma4_config import gemma4_for_tensor_parallel
    from jaxspec.model.targets.llama_config import llama_for_tensor_parallel

    gemma, mistral = target("gemma4_text").config, target("mistral_swa").config
    assert gemma4_for_tensor_parallel(gemma, 1) is gemma
    with pytest.raises(ConfigError, match="Gemma 4 model over tensor_parallel 2"):
        gemma4_for_tensor_parallel(gemma, 2)
    with pytest.raises(ConfigError, match="sliding_window 6: the sliding-window KV pool runs on one device"):
        llama_for_tensor_parallel(mistral, 2)
