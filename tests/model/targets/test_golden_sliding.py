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
from jaxspec.model.targets import forward_sequence
from jaxspec.model.targets.gemma4_config import Gemma4Moe, gemma4_config_from_hf, gemma4_for_tensor_parallel
from tests.conftest import engine
from tests.model.sliding_golden import (arrays, assistant, assistant_golden_steps, case, case_dir,
                                       check_assistant_steps, target)

TARGETS = ["gemma4_text", "gemma4_condgen", "mistral_swa", "gemma4_moe"]
ASSISTANTS = ["gemma4_assistant", "gemma4_assistant_plain"]


@pytest.mark.parametrize("name", TARGETS)
def test_logits_and_hidden_match_hf(name):
    """The longest golden prompt (17 tokens, windows 5-6): every position's logits and hidden."""
    c, model, ref = case(name), target(name), arrays(name)
    i = len(c["prompts"]) - 1
    prompt = c["prompts"][i]
    logits, hidden, _ = forward_sequence(model, np.asarray([prompt]))
    np.testing.assert_allclose(np.asarray(logits[0]), ref[f"logits_{i}"], atol=c["atol"], rtol=c["rtol"])
    np.testing.assert_allclose(np.asarray(hidden[0]), ref[f"hidden_final_{i}"], atol=c["atol"], rtol=c["rtol"])


@pytest.mark.parametrize("name,page_size", [("gemma4_text", 1), ("mistral_swa", 1), ("gemma4_moe", 1)])
def test_greedy_tokens_past_the_window_match_hf(name, page_size):
    """Ragged batch of 3 through the engine; sequences run to 33 positions, windows are 5-6 (page
    size 16: tests/spec/test_sliding_lossless.py compares its speculative runs with these tokens)."""
    c, model, ref = case(name), target(name), arrays(name)
    sampling = js.SamplingParams(max_new_tokens=c["greedy_new_tokens"], stop_token_ids=())
    out = js.generate(model, c["prompts"], sampling=sampling, engine=engine(page_size, max_batch=4, max_seq_len=64))
    assert out.token_ids == [ref[f"greedy_{i}"].tolist() for i in range(len(c["prompts"]))]
    assert out.kv_window_pages_free == out.kv_window_pages_total > 0
    if page_size == 1:  # positions fell behind the window while requests ran: their pages came back
        assert out.kv_window_pages_returned > 0


def test_moe_greedy_one_request_at_a_time_matches_hf():
    """Batch 1: each decode step routes 2 assignments over 8 experts, fewer than the experts, so it
    gathers the assigned experts' weights (``layers.routed_experts``); the batch of 3 above routes
    8 or more and runs ``ragged_dot``."""
    c, model, ref = case("gemma4_moe"), target("gemma4_moe"), arrays("gemma4_moe")
    sampling = js.SamplingParams(max_new_tokens=c["greedy_new_tokens"], stop_token_ids=())
    for i, prompt in enumerate(c["prompts"]):
        out = js.generate(model, [prompt], sampling=sampling, engine=engine(16, max_batch=1, max_seq_len=64))
        assert out.token_ids == [ref[f"greedy_{i}"].tolist()]


@pytest.mark.parametrize("name", ASSISTANTS)
def test_assistant_matches_hf_given_the_target_kv(name):
    """HF's recipe (``assistant_golden_steps``): the target over the prompt, then 4 draft steps
    at position T fed the golden token and hidden, against HF's logits and returned hidden."""
    c = case(name)
    check_assistant_steps(name, *assistant_golden_steps(name, target(c["target"]), assistant(name)))


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


@pytest.mark.parametrize("per_layer_config, full_shape", [
    # transformers 5 saves only what differs from the global head_dim (16) / num_key_value_heads (2)
    ({}, (16, 2)),
    ({"2": {"num_key_value_heads": 1}, "5": {"num_key_value_heads": 1}}, (16, 1)),
    ({"2": {"head_dim": 32}, "5": {"head_dim": 32}}, (32, 2)),
])
def test_per_layer_config_holds_only_differences(per_layer_config, full_shape):
    """An empty or partial per_layer_config keeps the global fields for what it leaves out (HF reloads it
    so); only the published form, with no per_layer_config at all, defaults full layers to 512."""
    raw = _text_config("gemma4_text")
    raw["per_layer_config"] = per_layer_config
    cfg = gemma4_config_from_hf(raw)
    assert (cfg.full.head_dim, cfg.full.num_kv_heads) == full_shape
    assert (cfg.sliding.head_dim, cfg.sliding.num_kv_heads) == (16, 2)


def test_moe_blocks_parse_and_check_their_fields():
    """26B-A4B's fields (enable_moe_block, num_experts, top_k_experts, moe_intermediate_size); a dense
    config has none; experts must split evenly over the model axis."""
    cfg = gemma4_config_from_hf(_text_config("gemma4_moe"))
    assert cfg.moe == Gemma4Moe(num_experts=8, top_k=2, intermediate_size=32)
    assert gemma4_config_from_hf(_text_config("gemma4_text")).moe is None
    assert gemma4_for_tensor_parallel(cfg, 2).moe == cfg.moe
    for field, value, message in [("top_k_experts", 9, "top_k_experts=9 must be between 1 and num_experts=8"),
                                  ("num_experts", None, "num_experts")]:
        raw = _text_config("gemma4_moe")
        raw[field] = value
        with pytest.raises(ConfigError, match=message):
            gemma4_config_from_hf(raw)
    raw = _text_config("gemma4_moe")
    raw["num_experts"] = 6
    with pytest.raises(ConfigError, match="num_experts 6 is not divisible by tensor_parallel 4"):
        gemma4_for_tensor_parallel(gemma4_config_from_hf(raw), 4)


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size_per_layer_input", 256, "per-layer input embeddings"),
    ("num_kv_shared_layers", 2, "KV sharing across layers"),
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


def test_sliding_window_models_split_over_a_tensor_parallel_mesh():
    """Both pools split by KV head: a layer type with fewer KV heads than shards repeats them
    (gemma4_text: sliding 2, full 1 KV heads); a count that neither divides nor is divided by
    the shards is refused by name. The lossless runs on a mesh are in tests/mesh."""
    from jaxspec.model.targets.gemma4_config import gemma4_for_tensor_parallel
    from jaxspec.model.targets.llama_config import llama_for_tensor_parallel

    gemma, mistral = target("gemma4_text").config, target("mistral_swa").config
    assert gemma4_for_tensor_parallel(gemma, 1) is gemma
    for shards, sliding, full in ((2, (2, 1), (2, 2)), (4, (4, 2), (4, 4))):  # (KV heads on the mesh, repeat)
        cfg = gemma4_for_tensor_parallel(gemma, shards)
        assert cfg.tensor_parallel == shards
        assert (cfg.sliding.num_kv_heads, cfg.sliding.kv_repeat) == sliding
        assert (cfg.full.num_kv_heads, cfg.full.kv_repeat) == full
    with pytest.raises(ConfigError, match="num_attention_heads 4 is not divisible by tensor_parallel 3; .*; the "
                                          "sliding layers' 2 KV heads neither divide nor are divided by "
                                          "tensor_parallel 3$"):  # (the full layers' 1 KV head repeats)
        gemma4_for_tensor_parallel(gemma, 3)
    split = llama_for_tensor_parallel(mistral, 2)
    assert (split.tensor_parallel, split.num_kv_heads, split.sliding_window) == (2, 2, 6)
