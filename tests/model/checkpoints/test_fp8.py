"""Block-scaled FP8 checkpoints (DeepSeek-V3's format) are dequantized while loading. A tiny
random DeepSeek checkpoint (MoE + MTP layer) is quantized by ``scripts/make_fp8_checkpoint.py``
with small blocks (so tensors span several, partial ones included), loaded, and compared with
its unquantized source within the quantization error."""

from __future__ import annotations

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.checkpoints.checkpoint import CheckpointError
from scripts.make_fp8_checkpoint import quantize_checkpoint
from tests.model.golden import case_dir, cases

BLOCK = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    src = case_dir(next(c for c in cases() if c["name"] == "deepseek_v3_moe"))
    out = tmp_path_factory.mktemp("fp8") / "deepseek_fp8"
    quantized = quantize_checkpoint(src, str(out), BLOCK)
    return src, str(out), quantized


def test_fp8_weights_dequantize_within_the_quantization_error(pair):
    """Every quantized weight is within the quantization error of its source, and equals an
    independent numpy dequantization of the file."""
    src, fp8, quantized = pair
    assert any(".experts." in n for n in quantized) and any("kv_b_proj" in n for n in quantized)
    a = js.load_model(src, dtype="float32", progress=False)
    b = js.load_model(fp8, dtype="float32", progress=False)
    checked = 0
    for (path, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(a.params), jax.tree_util.tree_leaves_with_path(b.params)):
        x, y = np.asarray(x), np.asarray(y)
        name = jax.tree_util.keystr(path)
        if any(k in name for k in ("norm", "embed", "lm_head", "router")):
            np.testing.assert_array_equal(x, y, err_msg=name)  # not quantized: bit-exact
            continue
        # e4m3 keeps 3 mantissa bits: rounding moves a value by at most 1/16 of its block's
        # largest magnitude (which the scale maps to the format's maximum).
        bound = np.abs(x).max() / 16 + 1e-7
        assert np.abs(x - y).max() <= bound, (name, np.abs(x - y).max(), bound)
        assert np.abs(x - y).max() > 0, name  # it really went through float8
        checked += 1
    assert checked >= 10
    # Exactly fp8 value x its block's scale, computed here with numpy from the file's bytes.
    model = b
    name = "model.layers.1.mlp.experts.2.down_proj.weight"  # [H, Im] of MoE layer 1 (the first MoE layer)
    assert name in quantized
    q, s = _raw(fp8, name).astype(np.float32), _raw(fp8, name + "_scale_inv")
    want = q * np.repeat(np.repeat(s, BLOCK, 0), BLOCK, 1)[: q.shape[0], : q.shape[1]]
    got = np.asarray(model.params["moe"]["experts_down"][0, 2]).T  # ours [Im, H], stacked [layer, expert]
    np.testing.assert_array_equal(got, want)


def test_fp8_mtp_layer_loads_as_a_draft(pair):
    """The target's MTP layer, quantized too, loads as the MTP draft within the quantization error."""
    src, fp8, quantized = pair
    assert any(n.startswith("model.layers.3.") for n in quantized)  # the MTP layer's block is quantized
    a = js.load_draft(src, js.load_model(src, dtype="float32", progress=False))
    b = js.load_draft(fp8, js.load_model(fp8, dtype="float32", progress=False))
    assert b.kind == "mtp"
    for key in ("wq_a", "wkv_a", "w_uk", "wo", "experts_down", "shared_gate_up"):
        if key in a.params["block"]:
            x, y = np.asarray(a.params["block"][key]), np.asarray(b.params["block"][key])
            assert 0 < np.abs(x - y).max() <= np.abs(x).max() / 16 + 1e-7, key


def _raw(path, name):
    """A tensor's bytes straight from the file (safetensors' numpy path has no float8)."""
    file = os.path.join(path, "model.safetensors")
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        info = header[name]
        begin, end = info["data_offsets"]
        f.seek(8 + n + begin)
        data = f.read(end - begin)
    dtype = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F32": np.float32}[info["dtype"]]
    return np.frombuffer(data, dtype=dtype).reshape(info["shape"])


def test_other_quantizations_are_refused(tmp_path, pair):
    _, fp8, _ = pair
    d = tmp_path / "q"
    shutil.copytree(fp8, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quantization 'awq' .* is not supported; supported: block-scaled fp8"):
        js.load_model(d, dtype="float32", progress=False)
    # fp8 without a block size (per-tensor scales) is not the DeepSeek format: refused, not misread
    cfg["quantization_config"] = {"quant_method": "fp8"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quantization 'fp8' .*weight_block_size None.* is not supported"):
        js.load_model(d, dtype="float32", progress=False)
    cfg.pop("quantization_config")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="is float8_e4m3fn but the checkpoint has no quantization_config"):
        js.load_model(d, dtype="float32", progress=False)
