"""Checkpoint tensors that no parameter-table entry reads are named in a warning (the model would
run without them), except what a family leaves unread on purpose: DeepSeek's MTP layers (read by
``load_draft``) and the vision tower of a Gemma 4 ConditionalGeneration checkpoint."""

import os
import shutil
import warnings

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxspec as js
from tests.model.golden import GOLDEN

QUIET = ["llama2", "qwen2_yarn", "deepseek_v3_moe", "deepseek_v32_dense", "sliding_window/gemma4_condgen"]


@pytest.mark.parametrize("name", QUIET)
def test_goldens_load_without_a_warning(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        js.load_model(os.path.join(GOLDEN, name), dtype="float32", progress=False)


@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.o_proj.bias", "model.layers.1.mlp.extra_norm.weight"])
def test_a_tensor_nothing_reads_is_named(tmp_path, extra):
    d = tmp_path / "llama2"
    shutil.copytree(os.path.join(GOLDEN, "llama2"), d)
    tensors = load_file(str(d / "model.safetensors"))
    tensors[extra] = np.zeros((64,), np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.warns(UserWarning, match=r"1 checkpoint tensor\(s\) are not read by jaxspec's llama model, which "
                                         r"runs without them.*: " + extra.replace(".", r"\.") + "$"):
        js.load_model(d, dtype="float32", progress=False)
