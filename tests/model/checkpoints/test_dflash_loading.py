"""Loading DFlash / DFlash 2 checkpoints: the kind comes from ``architectures`` (or, without
them, from the tensors), never an EAGLE head; a bad config (taps outside the target, a hidden
size or vocabulary that does not match, missing fields, sliding layers without a window) is a
clear error before any device work; both codebook spellings load; export round-trips."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxspec as js
from jaxspec.model.config import ConfigError
from jaxspec.model.drafts.dflash import default_target_layer_ids, dflash_config_for
from jaxspec.model.checkpoints.checkpoint import CheckpointError
from jaxspec.model.checkpoints.dflash import export_dflash
from jaxspec.model.checkpoints.loader import target_family
from tests.conftest import DATA
from tests.model.drafts.test_golden_dflash import draft, target

ROOT = os.path.join(DATA, "golden", "dflash")


def copy(tmp_path, name: str, drop=(), **config):
    d = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}"  # several copies per test
    shutil.copytree(os.path.join(ROOT, name), d)
    raw = json.loads((d / "config.json").read_text())
    raw.update(config)
    for key in drop:
        raw.pop(key, None)
        raw.get("dflash_config", {}).pop(key, None)
    (d / "config.json").write_text(json.dumps(raw))
    return d


def test_without_architectures_the_tensors_decide(tmp_path):
    assert js.load_draft(copy(tmp_path, "dflash", drop=("architectures",)), target()).kind == "dflash"
    assert js.load_draft(copy(tmp_path, "dflash2", drop=("architectures",)), target()).kind == "dflash2"


def test_never_loaded_as_an_eagle_head(tmp_path):
    """``fc`` over two target layers + ``layers.*`` used to load silently as an EAGLE-1 head."""
    d = copy(tmp_path, "dflash", architectures=["LlamaForCausalLM"])
    with pytest.raises(CheckpointError, match=r"the tensors are not of that format \(they are those of: DFlash block"):
        js.load_draft(d, target())
    d = copy(tmp_path, "dflash", architectures=["DFlash2DraftModel"])
    with pytest.raises(CheckpointError, match="claim: DFlash 2 block draft; .* those of: DFlash block draft"):
        js.load_draft(d, target())


@pytest.mark.parametrize("change,match", [
    (dict(target_layer_ids=[1, 6]), r"target_layer_ids \[1, 6\] are outside the target's 6 layers"),
    (dict(target_layer_ids=[2, 2]), r"target_layer_ids \[2, 2\] repeat a layer"),
    (dict(hidden_size=48), "hidden_size 48 must equal the target's hidden size 64"),
    (dict(vocab_size=300), "vocab_size 300 does not match the target's 256"),
    (dict(dflash_config={"block_size": 8}), "missing required DFlash field 'mask_token_id'"),
    (dict(dflash_config={"block_size": 8, "mask_token_id": 256}), "mask_token_id 256 is outside the vocabulary"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "sliding_attention layers need use_sliding_window"),
    (dict(attention_bias=True), "attention_bias are not supported"),
], ids=["taps-outside", "taps-repeat", "hidden", "vocab", "no-mask", "mask-outside", "sliding-no-window", "bias"])
def test_bad_config_is_a_clear_error(tmp_path, change, match):
    with pytest.raises(ConfigError, match=match):
        js.load_draft(copy(tmp_path, "dflash", **change), target())


def test_default_taps_follow_the_reference(tmp_path):
    assert default_target_layer_ids(6, 2) == (1, 3)
    assert default_target_layer_ids(11, 3) == (1, 4, 8)  # 4.5 rounds half to even
    assert default_target_layer_ids(52, 5) == (1, 13, 25, 37, 49)
    assert default_target_layer_ids(8, 1) == (4,)
    # Without target_layer_ids the draft must have been built for a target of this depth.
    d = copy(tmp_path, "dflash", drop=("target_layer_ids",), num_target_layers=36)
    with pytest.raises(ConfigError, match="built for a 36-layer target"):
        js.load_draft(d, target())
    d = copy(tmp_path, "dflash", drop=("target_layer_ids",))
    assert js.load_draft(d, target()).config.model.target_layer_ids == (1, 3)


def test_both_codebook_spellings_load(tmp_path):
    d = copy(tmp_path, "dflash2")
    tensors = load_file(str(d / "model.safetensors"))
    assert "candidate_selector.predecessor_codebook" in tensors  # the published spelling
    for cb in ("predecessor_codebook", "successor_codebook"):
        tensors[f"candidate_selector.{cb}.weight"] = tensors.pop(f"candidate_selector.{cb}")
    save_file(tensors, str(d / "model.safetensors"))
    again = js.load_draft(d, target())
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(draft("dflash2").params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["dflash", "dflash2", "dflash_mixed"])
def test_export_round_trips(tmp_path, name):
    d = draft(name)
    export_dflash(str(tmp_path / name), d.params, d.config.model)
    again = js.load_draft(tmp_path / name, target())
    assert again.config == d.config
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(d.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    names = set(load_file(str(tmp_path / name / "model.safetensors")))
    assert not any(n.startswith(("embed", "lm_head", "model.")) for n in names)  # the target's are not written


@pytest.mark.parametrize("golden_dir,layout", [
    ("qwen3", None),  # the target's own heads
    ("dflash_gemma4/target", (4, 2, 16, 10_000.0)),  # Gemma 4: the sliding layers' heads and RoPE
    ("deepseek_v3_dense", "hidden / heads"),  # MLA: no head layout to copy
])
def test_a_new_draft_has_heads_for_every_target_family(golden_dir, layout):
    """``dflash_config_for`` (what ``train-draft --method dflash`` builds) for each target family."""
    with open(os.path.join(DATA, "golden", golden_dir, "config.json")) as f:
        raw = json.load(f)
    cfg = target_family(raw, "config.json").parse(raw, "config.json")
    d = dflash_config_for(cfg, num_layers=2, block_size=8, mask_token_id=1)
    got = (d.num_heads, d.num_kv_heads, d.head_dim, d.rope.theta)
    if layout is None:
        layout = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope.theta)
    elif layout == "hidden / heads":
        layout = (cfg.num_heads, cfg.num_heads, cfg.hidden_size // cfg.num_heads, 10_000.0)
    assert got == layout
    assert d.hidden_size == cfg.hidden_size and d.num_target_layers == cfg.num_layers
