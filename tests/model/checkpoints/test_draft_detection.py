"""``load_draft`` detects the kind from ``config.json``'s ``architectures`` first and the tensor
names second; an unknown or mismatched kind is refused with an error naming what was found
and what is supported, so no checkpoint is loaded as a kind it is not."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxspec as js
from jaxspec.model.config import ConfigError
from jaxspec.model.checkpoints.checkpoint import CheckpointError
from tests.model.golden import case_dir, cases


def _target():
    case = next(c for c in cases("target") if c["name"] == "llama3")
    return js.load_model(case_dir(case), dtype="float32", progress=False)


def _copy(tmp_path, name, **config):
    case = next(c for c in cases() if c["name"] == name)
    d = tmp_path / name
    shutil.copytree(case_dir(case), d)
    raw = json.loads((d / "config.json").read_text())
    raw.update(config)
    (d / "config.json").write_text(json.dumps(raw))
    return d


@pytest.mark.parametrize("name,archs,kind", [
    ("eagle3_midlayer", ["LlamaForCausalLM"], "eagle3"),  # SafeAILab's EAGLE-3 config says LlamaForCausalLM
    ("eagle3_layers0", ["LlamaForCausalLMEagle3"], "eagle3"),
    ("eagle1", ["LlamaForCausalLM"], "eagle1"),
    ("qwen2", ["Qwen2ForCausalLM"], "standalone"),
], ids=["eagle3-generic-arch", "eagle3-specforge", "eagle1", "standalone"])
def test_kind_from_architectures_then_tensors(tmp_path, name, archs, kind):
    d = _copy(tmp_path, name, architectures=archs)
    assert js.load_draft(d, _target()).kind == kind


def test_unknown_draft_architecture_is_refused(tmp_path):
    """A DFlash-style checkpoint (fc over two target layers + layers.*) used to load silently
    as an EAGLE-1 head; its architecture now decides, and an unsupported one is named."""
    d = _copy(tmp_path, "eagle1", architectures=["SomeNewDraftModel"], num_target_layers=2)
    with pytest.raises(ConfigError, match=r"unsupported draft architecture \['SomeNewDraftModel'\]; supported: \["):
        js.load_draft(d, _target())


def test_architecture_that_the_tensors_contradict_is_refused(tmp_path):
    # Says EAGLE-3, holds a whole Llama LM.
    d = _copy(tmp_path, "qwen2", architectures=["LlamaForCausalLMEagle3"])
    with pytest.raises(CheckpointError, match="claim: EAGLE-3 head; but the tensors are not of that format "
                                              r"\(they are those of: standalone LM\)"):
        js.load_draft(d, _target())
    # Says frozen-KV assistant, holds an EAGLE-1 head.
    d = _copy(tmp_path, "eagle1", architectures=["JaxspecFrozenKVAssistant"])
    with pytest.raises(CheckpointError, match="claim: frozen-KV assistant; .* those of: EAGLE-1/2 head"):
        js.load_draft(d, _target())


def test_no_architectures_falls_back_to_tensor_names(tmp_path):
    d = _copy(tmp_path, "eagle3_layers0")
    raw = json.loads((d / "config.json").read_text())
    del raw["architectures"]
    (d / "config.json").write_text(json.dumps(raw))
    assert js.load_draft(d, _target()).kind == "eagle3"


def test_mtp_draft_for_a_llama_target_is_refused(tmp_path):
    d = _copy(tmp_path, "deepseek_v3_dense")
    with pytest.raises(ConfigError, match="a DeepSeek MTP \\(NextN\\) layer cannot serve a LlamaConfig target"):
        js.load_draft(d, _target())


def test_tensors_of_no_known_format_are_refused(tmp_path):
    d = tmp_path / "odd"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 64}))
    save_file({"something.weight": np.zeros((2, 2), np.float32)}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"architectures \(none\) claim: EAGLE-3 head or .* standalone LM; but"):
        js.load_draft(d, _target())


@pytest.mark.parametrize("name, hint", [
    ("llama3", ""),
    ("deepseek_v32_dense", r" It holds no MTP \(NextN\) layer: no model\.layers\.3\.\* tensors"),
])
def test_a_target_is_not_its_own_draft(tmp_path, name, hint):
    """The target's own directory with no MTP layer (HF save_pretrained drops it) would otherwise load
    as a standalone LM drafting for itself: refused, naming the missing layer for DeepSeek."""
    d = _copy(tmp_path, name)
    st = d / "model.safetensors"
    if hint:  # the MTP layer stored after the 3 main layers goes
        save_file({k: v for k, v in load_file(str(st)).items() if not k.startswith("model.layers.3.")}, str(st))
    target = js.load_model(d, dtype="float32", progress=False)
    with pytest.raises(ConfigError, match="is the target's own checkpoint, and a model cannot be its own draft\\." + hint):
        js.load_draft(d, target)
    if hint:  # with its MTP layer, the same directory is the MTP draft
        original = case_dir(next(c for c in cases() if c["name"] == name))
        assert js.load_draft(original, js.load_model(original, dtype="float32", progress=False)).kind == "mtp"


def test_sglang_nextn_export_loads_as_the_targets_mtp_layer(tmp_path):
    """SGLang's NextN export (the published '-NextN' repos): the target's config with one layer and
    ``DeepseekV3ForCausalLMNextN``, the MTP layer's tensors renamed to ``model.layers.0.*``, the
    embedding and head left out. It loads as the same MTP draft as the target's own checkpoint."""
    src = _copy(tmp_path, "deepseek_v3_moe")
    target = js.load_model(src, dtype="float32", progress=False)
    layer = f"model.layers.{target.config.num_layers}."
    out = tmp_path / "nextn"
    out.mkdir()
    raw = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 1,
                                                 "architectures": ["DeepseekV3ForCausalLMNextN"]}))
    tensors = {"model.layers.0." + k.removeprefix(layer): v for k, v in load_file(str(src / "model.safetensors")).items()
               if k.startswith(layer) and "embed_tokens" not in k and "shared_head.head" not in k}
    save_file(tensors, str(out / "nextn_layer_parameters.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "nextn_layer_parameters.safetensors" for k in tensors}}))
    exported, own = js.load_draft(out, target), js.load_draft(src, target)
    assert exported.kind == own.kind == "mtp"
    a, b = jax.tree.leaves_with_path(exported.params), jax.tree.leaves_with_path(own.params)
    assert [p for p, _ in a] == [p for p, _ in b]
    assert all(np.array_equal(x, y) for (_, x), (_, y) in zip(a, b))
