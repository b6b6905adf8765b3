"""Llama-family configs read as HF builds the model (jaxspec/model/targets/llama_config.py): which
layers slide (Mistral from ``sliding_window`` alone, Qwen2/Qwen3 from ``use_sliding_window`` and
``max_window_layers`` or the ``layer_types`` transformers 5 writes), which projections carry biases,
and RoPE settings written by an export and read back."""

import json

import pytest

from jaxspec.model.config import ConfigError, RopeConfig, parse_rope
from jaxspec.model.checkpoints.checkpoint import rope_fields
from jaxspec.model.targets.llama_config import llama_config_from_hf
from tests.model.golden import GOLDEN

S, F = "sliding_attention", "full_attention"
_DROP = object()  # a config change that removes the key


def _config(name: str, **changes) -> dict:
    with open(f"{GOLDEN}/{name}/config.json") as f:
        cfg = json.load(f)
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not _DROP}


# (case, config changes, window or the error) over 2-layer goldens
WINDOWS = [
    ("qwen2", {}, None),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0, layer_types=_DROP), 8),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2, layer_types=_DROP), None),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=_DROP, layer_types=_DROP), None),
    ("qwen2", dict(use_sliding_window=False, sliding_window=8, max_window_layers=0, layer_types=_DROP), None),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, layer_types=[S, S]), 8),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, layer_types=[F, F], max_window_layers=0), None),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types=_DROP),
     "1 of 2 layers slide over 8 positions"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, layer_types=[S, F]), "1 of 2 layers slide"),
    ("mistral", dict(sliding_window=6), 6),
    ("mistral", dict(sliding_window=6, layer_types=[F, F]), 6),  # HF's Mistral ignores layer_types
    ("mistral", dict(sliding_window=None), None),
    ("llama2", dict(sliding_window=8), None),
    ("llama2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), None),
]


def _parsed_field_or_refusal(raw: dict, field: str, want) -> None:
    """``want`` a str: parsing ``raw`` is refused with that message; else the parsed ``field`` is ``want``."""
    if isinstance(want, str):
        with pytest.raises(ConfigError, match=want):
            llama_config_from_hf(raw)
    else:
        assert getattr(llama_config_from_hf(raw), field) == want


@pytest.mark.parametrize("name, changes, want", WINDOWS)
def test_sliding_window_follows_hf_layer_types(name, changes, want):
    _parsed_field_or_refusal(_config(name, **changes), "sliding_window", want)


@pytest.mark.parametrize("name, changes, want", [
    ("qwen2", {}, True),
    ("qwen2", dict(attention_bias=False), True),  # HF's Qwen2 has no switch: q/k/v biases always
    ("mistral", dict(attention_bias=True), False),  # HF's Mistral has none
    ("llama2", dict(attention_bias=True), "attention_bias=true \\(llama: q/k/v and o_proj biases\\)"),
    ("qwen3", dict(attention_bias=True), "attention_bias=true \\(qwen3"),
    ("llama2", dict(mlp_bias=True), "mlp_bias=true"),
    ("llama2", dict(attention_bias=False, mlp_bias=False), False),
])
def test_projection_biases_follow_hf_or_are_refused(name, changes, want):
    """Biases HF would add and jaxspec would not load (o_proj, MLP) are refused, not dropped."""
    _parsed_field_or_refusal(_config(name, **changes), "attention_bias", want)


@pytest.mark.parametrize("rope", [
    RopeConfig(theta=5e5),
    RopeConfig(theta=1e4, kind="linear", factor=2.0),
    RopeConfig(theta=5e5, kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192),
    RopeConfig(theta=1e6, kind="yarn", factor=4.0, original_max_position_embeddings=32768),
    RopeConfig(theta=1e4, kind="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=16.0,
               mscale=1.0, mscale_all_dim=0.5, truncate=False),
    RopeConfig(theta=1e4, kind="yarn", factor=2.0, original_max_position_embeddings=64, attention_factor=1.25),
], ids=lambda r: r.kind)
def test_rope_round_trips_through_the_hf_fields_an_export_writes(rope):
    """What export_llama / an exported EAGLE-3 head writes reads back as the same RoPE (a YaRN head
    trained for a Qwen long-context target keeps its scaling)."""
    assert parse_rope(rope_fields(rope)) == rope
    with pytest.raises(ValueError, match="cannot write 'proportional' RoPE"):
        rope_fields(RopeConfig(kind="proportional", partial_rotary_factor=0.25))


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


# (config fields, the RoPE read or the error): what HF reads from fields published configs carry.
@pytest.mark.parametrize("fields,want", [
    (dict(rope_scaling={}, rope_parameters={"rope_theta": 1e6, **YARN}),  # an empty rope_scaling is no scaling
     RopeConfig(theta=1e6, kind="yarn", factor=4.0, original_max_position_embeddings=1024)),
    (dict(rope_theta=1e6, max_position_embeddings=8192, rope_scaling={"rope_type": "yarn", "factor": 2.0}),
     RopeConfig(theta=1e6, kind="yarn", factor=2.0, original_max_position_embeddings=8192)),  # HF's default
    (dict(rope_scaling={"type": "linear"}), "linear rope_scaling needs a numeric 'factor'"),
], ids=["empty-scaling-beside-parameters", "yarn-without-original-context", "linear-without-factor"])
def test_rope_reads_what_hf_reads(fields, want):
    if isinstance(want, str):
        with pytest.raises(ConfigError, match=want):
            parse_rope(fields)
    else:
        assert parse_rope(fields) == want


def test_eos_ids_of_a_multimodal_wrapper_come_from_its_text_config(tmp_path):
    """A ``...ForConditionalGeneration`` config keeps ``eos_token_id`` in ``text_config``: without a
    generation_config.json, generation must still stop there."""
    from jaxspec.model.checkpoints.checkpoint import read_eos_ids

    cfg = {"architectures": ["Gemma4ForConditionalGeneration"], "text_config": {"eos_token_id": [1, 106]}}
    assert read_eos_ids(str(tmp_path), cfg) == (1, 106)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 50]}))
    assert read_eos_ids(str(tmp_path), {**cfg, "eos_token_id": 2}) == (2, 1, 106, 50)
