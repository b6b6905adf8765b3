"""Gemma 4 targets, Gemma 4 assistants and Mistral with a sliding window against HF transformers
(tests/data/golden/sliding_window): logits, hidden states, greedy tokens past the window; the
assistant's logits and returned hidden given the same target KV; config forms and refusals."""

import copy
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.config import ConfigError
from jaxspec.model.targets import forward_sequence
from jaxspec.model.targets.gemma4_config import (Gemma4Moe, PerLayerInputs, gemma4_config_from_hf,
                                                 gemma4_for_tensor_parallel)
from tests.conftest import engine
from tests.model.sliding_golden import (arrays, assistant, assistant_golden_steps, case, case_dir,
                                       check_assistant_steps, target)

TARGETS = ["gemma4_text", "gemma4_condgen", "mistral_swa", "gemma4_moe", "gemma4_ple"]
ASSISTANTS = ["gemma4_assistant", "gemma4_assistant_plain", "gemma4_ple_assistant"]


@pytest.mark.parametrize("name", TARGETS)
def test_logits_and_hidden_match_hf(name):
    """The longest golden prompt (17 tokens, windows 5-6): every position's logits and hidden."""
    c, model, ref = case(name), target(name), arrays(name)
    i = len(c["prompts"]) - 1
    prompt = c["prompts"][i]
    logits, hidden, _ = forward_sequence(model, np.asarray([prompt]))
    np.testing.assert_allclose(np.asarray(logits[0]), ref[f"logits_{i}"], atol=c["atol"], rtol=c["rtol"])
    np.testing.assert_allclose(np.asarray(hidden[0]), ref[f"hidden_final_{i}"], atol=c["atol"], rtol=c["rtol"])


@pytest.mark.parametrize("name,page_size", [("gemma4_text", 1), ("mistral_swa", 1), ("gemma4_moe", 1),
                                            ("gemma4_ple", 1)])
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
    # On the E2B kind the last layers share K/V: they read layer 3's (window pool layer 2) and layer 2's
    # (full pool layer 0), HF's "store" layers.
    assert assistant("gemma4_ple_assistant").config.model.kv_sources == (("window", 2), ("full", 0))
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
    assert cfg.segments() == ((0, 6, 3),) and cfg.final_logit_softcapping == 30.0
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
    ("use_bidirectional_attention", "all", "use_bidirectional_attention='all'"),
    ("hidden_activation", "silu", "hidden_activation 'silu'"),
    ("attention_bias", True, "attention_bias=true"),
])
def test_features_of_other_kinds_are_refused_by_name(field, value, message):
    raw = _text_config("gemma4_text")
    raw[field] = value
    with pytest.raises(ConfigError, match=message):
        gemma4_config_from_hf(raw)


def test_e2b_kind_parses_its_per_layer_inputs_and_kv_sharing():
    """gemma4_ple: per-layer inputs 8 wide, the last 2 of [S, S, F, S, S, F] sharing K/V with
    double-wide MLPs. Only layers 0-3 keep K/V (3 sliding, 1 full); layer 4 reads layer 3's
    (window pool layer 2), layer 5 layer 2's (full pool layer 0); the forward scans [0, 4) and
    [4, 6) apart, each by its own period."""
    cfg = gemma4_config_from_hf(_text_config("gemma4_ple"))
    assert cfg.per_layer_inputs == PerLayerInputs(width=8, vocab_size=256)
    assert (cfg.num_kv_shared_layers, cfg.first_shared_layer) == (2, 4)
    assert (cfg.intermediate_size, cfg.shared_intermediate_size) == (64, 128)
    assert (cfg.num_sliding_layers, cfg.num_full_layers) == (3, 1)
    assert [cfg.kv_source(i) for i in range(6)] == [("window", 0), ("window", 1), ("full", 0), ("window", 2),
                                                    ("window", 2), ("full", 0)]
    assert cfg.segments() == ((0, 4, 4), (4, 6, 2))
    narrow = _text_config("gemma4_ple")
    narrow["use_double_wide_mlp"] = False
    assert gemma4_config_from_hf(narrow).shared_intermediate_size == 64
    absent = _text_config("gemma4_text")
    absent.pop("hidden_size_per_layer_input")  # HF's defaults: on, 256 wide over 262144 rows
    absent.pop("vocab_size_per_layer_input")
    assert gemma4_config_from_hf(absent).per_layer_inputs == PerLayerInputs(width=256, vocab_size=262_144)
    assert gemma4_config_from_hf(_text_config("gemma4_text")).per_layer_inputs is None
    raw = _text_config("gemma4_ple")
    raw["vocab_size_per_layer_input"] = 255
    with pytest.raises(ConfigError, match="vocab_size_per_layer_input=255 is smaller than vocab_size=256"):
        gemma4_config_from_hf(raw)
    for shared, message in [(5, "no earlier layer of type \\['full_attention'\\] produces the K/V"),
                            (6, "num_kv_shared_layers=6 must be between 0 and num_hidden_layers - 1 = 5")]:
        raw = _text_config("gemma4_ple")
        raw["num_kv_shared_layers"] = shared
        with pytest.raises(ConfigError, match=message):
            gemma4_config_from_hf(raw)
    with pytest.raises(ConfigError, match="shared_intermediate_size .* must be set when num_kv_shared_layers=2"):
        dataclasses.replace(cfg, shared_intermediate_size=0)
    raw = _text_config("gemma4_ple")
    raw["intermediate_size"] = 66  # the shared layers' 132 splits over 4 shards, 66 does not
    with pytest.raises(ConfigError, match="intermediate_size 66 is not divisible by tensor_parallel 4$"):
        gemma4_for_tensor_parallel(gemma4_config_from_hf(raw), 4)


def test_kv_sharing_layers_may_carry_unused_kv_weights(tmp_path):
    """Checkpoints may keep k/v projections and norms in the K/V-sharing layers, which HF ignores:
    they load without the unread-tensor warning and change nothing; another unread tensor warns."""
    import shutil
    import warnings

    from safetensors.numpy import load_file, save_file

    src = case_dir("gemma4_ple")
    for f in ("config.json", "generation_config.json"):
        shutil.copy(f"{src}/{f}", tmp_path / f)
    tensors = load_file(f"{src}/model.safetensors")
    for layer in (4, 5):  # shaped as layer 3's (sliding) and 2's (full)
        like = 3 if layer == 4 else 2
        for name in ("k_proj", "v_proj", "k_norm"):
            weight = f"model.layers.{{}}.self_attn.{name}.weight"
            tensors[weight.format(layer)] = tensors[weight.format(like)]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = js.load_model(str(tmp_path), dtype="float32", progress=False)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(target("gemma4_ple").params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tensors["model.layers.3.self_attn.v_bias"] = tensors["model.layers.3.self_attn.k_norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.warns(UserWarning, match="1 checkpoint tensor\\(s\\) are not read .*layers.3.self_attn.v_bias"):
        js.load_model(str(tmp_path), dtype="float32", progress=False)


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
