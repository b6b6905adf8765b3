"""DeepSeek-V4 target: both config forms, the three checkpoint layouts, FP8 / FP4 dequantization,
refusals by name, and the forward against HF's ``DeepseekV4ForCausalLM`` goldens (a tiny model
mixing CSA, sliding and HCA layers, 64 positions: 8 windows, 16 HCA and 32 CSA entries)."""

from __future__ import annotations

import functools
import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import jaxspec as js
from jaxspec.model.config import ConfigError
from jaxspec.model.checkpoints.checkpoint import CheckpointError, CheckpointTensors
from jaxspec.model.targets import forward_fresh
from jaxspec.model.targets.deepseek_v4_config import CSA, HASH, HCA, SLIDING, TOPK, deepseek_v4_config_from_hf
from tests.model.golden import GOLDEN, arrays, cases

CASE = next(c for c in cases() if c["name"] == "deepseek_v4")
MIXED = os.path.join(GOLDEN, "deepseek_v4")
MODULES = os.path.join(GOLDEN, "deepseek_v4_modules")


@functools.cache
def golden_model():
    return js.load_model(MIXED, dtype="float32", progress=False)


def raw_config() -> dict:
    with open(os.path.join(MIXED, "config.json")) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------ forward


def test_logits_and_greedy_match_hf():
    """No-cache logits of HF over prompt + greedy continuation (64 positions at most), every row; the
    argmax of each continuation step is HF's greedy token; the last layer's streams (tap L, what the
    MTP layer reads) are those the golden's MTP input was taken from."""
    ref = arrays(CASE)
    seqs = [np.concatenate([ref[f"prompt_{i}"], ref[f"greedy_{i}"]]) for i in range(3)]
    T = max(len(s) for s in seqs)
    batch = np.zeros((3, T), np.int32)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    m = golden_model()
    L = m.config.num_layers
    logits, _, streams = jax.jit(lambda p, t: forward_fresh(m.config, p, t, dtype=np.float32, aux_layers=(L,)))(
        m.params, batch)
    logits = np.asarray(logits)
    for i, s in enumerate(seqs):
        want = ref[f"full_logits_{i}"]
        np.testing.assert_allclose(logits[i, : len(s)], want, atol=CASE["atol"], rtol=CASE["rtol"])
        n = len(ref[f"prompt_{i}"])
        np.testing.assert_array_equal(logits[i, n - 1: len(s) - 1].argmax(-1), ref[f"greedy_{i}"])
    mtp_in = ref["mtp_hidden_in"]
    np.testing.assert_allclose(np.asarray(streams[0, : len(mtp_in)]), mtp_in, atol=CASE["atol"], rtol=CASE["rtol"])


# ------------------------------------------------------------------------------------ config


def legacy_form(raw: dict) -> dict:
    """The same model in the published config form (compress_ratios with the MTP layer's entry,
    num_hash_layers, qk_rope_head_dim, rope_scaling for the compressed layers)."""
    out = {k: v for k, v in raw.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates",
                                                     "rope_parameters", "partial_rotary_factor")}
    rates = raw["compress_rates"]
    by_type = {"sliding_attention": 0, "compressed_sparse_attention": rates["compressed_sparse_attention"],
               "heavily_compressed_attention": rates["heavily_compressed_attention"]}
    comp = raw["rope_parameters"]["compress"]
    out.update(compress_ratios=[by_type[t] for t in raw["layer_types"]] + [0], num_hash_layers=1,
               compress_rate_csa=rates["compressed_sparse_attention"],
               compress_rate_hca=rates["heavily_compressed_attention"], qk_rope_head_dim=8,
               rope_theta=raw["rope_parameters"]["main"]["rope_theta"], compress_rope_theta=comp["rope_theta"],
               rope_scaling={"type": "yarn", "factor": comp["factor"],
                             "original_max_position_embeddings": comp["original_max_position_embeddings"]})
    return out


def test_both_config_forms_parse_alike():
    raw = raw_config()
    new, old = deepseek_v4_config_from_hf(raw), deepseek_v4_config_from_hf(legacy_form(raw))
    assert new == old
    assert new.layer_kinds == (CSA, SLIDING, HCA, CSA) and new.mlp_kinds == (HASH, TOPK, TOPK, TOPK)
    assert (new.csa_rate, new.hca_rate, new.rope_dim, new.hc_mult) == (2, 4, 8, 2)
    assert new.main_rope.kind == "default" and new.compress_rope.kind == "yarn"
    assert new.compress_rope.cos_sin_scale == 1.0  # HF: the compressed YaRN does not scale cos / sin
    assert new.window_span == 8 and new.entry_rates == (2, 4)
    # A V4-Flash-shaped schedule: 0 / 4 / 128 with the default rates, the MTP layer's 0 last.
    flash = {**legacy_form(raw), "compress_ratios": [0, 4, 128, 4, 0]}
    for key in ("compress_rate_csa", "compress_rate_hca"):
        flash.pop(key)
    cfg = deepseek_v4_config_from_hf(flash)
    assert cfg.layer_kinds == (SLIDING, CSA, HCA, CSA) and (cfg.csa_rate, cfg.hca_rate) == (4, 128)
    assert cfg.window_span == 128  # an HCA window of 128 inputs stays resident


@pytest.mark.parametrize("change,message", [
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"n_group": 4}, "n_group=4"),
    ({"layer_types": ["full_attention"] * 4}, "layer type\\(s\\) \\['full_attention'"),
    ({"mlp_layer_types": ["dense"] * 4}, "MLP layer type\\(s\\) \\['dense'"),
    ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4},
                          "compress": {"rope_type": "deepseek_yarn", "rope_theta": 1e4}}}, "RoPE type 'deepseek_yarn'"),
    ({"layer_types": None, "compress_ratios": [0, 8, 0, 0]}, "compress_ratios value\\(s\\) \\[8\\]"),
    ({"layer_types": None, "compress_ratios": [0, 0, 0, 0, 2]}, "MTP layer of kind 'csa'"),
])
def test_unsupported_configs_are_refused_by_name(change, message):
    raw = {**raw_config(), **change}
    with pytest.raises(ConfigError, match=message):
        deepseek_v4_config_from_hf(raw)


def test_other_quantizations_are_refused(tmp_path):
    d = tmp_path / "q"
    shutil.copytree(MIXED, d)
    for q, message in [({"quant_method": "awq", "bits": 4}, "quantization 'awq'"),
                       ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [8, 8], "scale_fmt": "e5m2"},
                        "scale_fmt 'e5m2'"),
                       ({"quant_method": "fp8", "weight_block_size": [8, 8], "expert_dtype": "int4"},
                        "expert_dtype 'int4'")]:
        raw = {**raw_config(), "quantization_config": q}
        (d / "config.json").write_text(json.dumps(raw))
        with pytest.raises(CheckpointError, match=message):
            js.load_model(d, dtype="float32", progress=False)


# ------------------------------------------------------------------------------------ layouts


def published_from_mixed(name: str) -> str:
    """HF's save_pretrained names -> DeepSeek's release names (written out here, independently of
    jaxspec's tables)."""
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}
    if name in top:
        return top[name]
    return name.removeprefix("model.").replace(".attn.norm.weight", ".attn.kv_norm.weight")


def _write(directory, tensors: dict, config: dict):
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


def _published_tensor(x: np.ndarray) -> np.ndarray:
    return x.astype(np.int32) if x.dtype == np.int64 else x  # the release stores tid2eid as int32


@functools.cache
def published_dir(root: str) -> str:
    ckpt = CheckpointTensors(MIXED)
    out = os.path.join(root, "published")
    _write(out, {published_from_mixed(k): _published_tensor(ckpt.get(k)) for k in ckpt.keys()},
           legacy_form(raw_config()))
    return out


def modules_dir(root: str) -> str:
    """The module-names golden with the MTP layer's ``mtp.0.*`` tensors added (DeepSeek's names, which
    every layout keeps for it; HF writes no MTP layer)."""
    out = os.path.join(root, "modules")
    shutil.copytree(MODULES, out)
    mixed, modules = CheckpointTensors(MIXED), CheckpointTensors(MODULES)
    tensors = {k: modules.get(k) for k in modules.keys()}
    tensors.update({k: mixed.get(k) for k in mixed.keys() if k.startswith("mtp.")})
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def _assert_same_leaves(want, got, where: str):
    ref = jax.tree_util.tree_leaves_with_path(want)
    got = jax.tree.leaves(got)
    assert len(got) == len(ref), where
    for (p, a), b in zip(ref, got):
        assert a.dtype == b.dtype, f"{where}: {jax.tree_util.keystr(p)}"
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{where}: {jax.tree_util.keystr(p)}")


def test_three_layouts_load_the_same_params(tmp_path_factory):
    """The published layout (no ``model.`` prefix, int32 ``tid2eid``) and HF's module names load the
    mixed layout's params, and ``load_draft`` the same MTP layer from each."""
    root = str(tmp_path_factory.mktemp("v4"))
    pub = published_dir(root)
    ckpt = CheckpointTensors(pub)
    assert "embed.weight" in ckpt and "model.embed_tokens.weight" not in ckpt
    assert ckpt.get("layers.0.ffn.gate.tid2eid").dtype == np.int32
    mixed = golden_model()
    mtp = js.load_draft(MIXED, mixed)
    for path in (pub, modules_dir(root)):
        target = js.load_model(path, dtype="float32", progress=False)
        _assert_same_leaves(mixed.params, target.params, path)
        draft = js.load_draft(path, target)
        assert draft.kind == mtp.kind and draft.config == mtp.config
        _assert_same_leaves(mtp.params, draft.params, f"{path} (MTP layer)")


# ------------------------------------------------------------------------------------ FP8 / FP4

E4M3_MAX, BLOCK = 448.0, 8


def _quantize_fp8(w: np.ndarray):
    """e4m3 values and ue8m0 (power of two) scales per BLOCK x BLOCK block."""
    r, c = w.shape
    s = np.zeros((-(-r // BLOCK), -(-c // BLOCK)), np.float32)
    q = np.zeros_like(w)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            s[i, j] = 2.0 ** np.ceil(np.log2(max(np.abs(blk).max(), 1e-30) / E4M3_MAX))
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = blk / s[i, j]
    return q.astype(ml_dtypes.float8_e4m3fn), s.astype(ml_dtypes.float8_e8m0fnu)


FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def _quantize_fp4(w: np.ndarray, group: int = 16):
    """e2m1 codes packed two per byte (low nibble first) and ue8m0 scales per 1 x ``group``."""
    r, c = w.shape
    s = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(w.reshape(r, c // group, group)).max(-1), 1e-30) / 6.0))
    x = w / np.repeat(s, group, axis=1)
    codes = np.abs(x[..., None] - FP4).argmin(-1).astype(np.uint8)  # nearest e2m1 value
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.int8)
    return packed, s.astype(ml_dtypes.float8_e8m0fnu)


def quantize_as_released(name: str, x: np.ndarray, prefix: str, tensors: dict, want: dict) -> bool:
    """Under ``prefix``, the dense linears ``wq_b`` / ``wo_b`` / shared ``w2`` as FP8 blocks and the routed
    experts as FP4, as DeepSeek releases them: the codes and ``.scale`` go into ``tensors``, code x scale
    (numpy) into ``want``. False for a tensor left as it is."""
    if name.startswith(prefix) and name.endswith(("wq_b.weight", "wo_b.weight", "shared_experts.w2.weight")):
        q, s = _quantize_fp8(x.astype(np.float32))
        want[name] = q.astype(np.float32) * np.kron(s.astype(np.float32), np.ones((BLOCK, BLOCK)))[: x.shape[0],
                                                                                                 : x.shape[1]]
    elif name.startswith(prefix) and ".ffn.experts." in name:
        q, s = _quantize_fp4(x.astype(np.float32))
        want[name] = FP4[np.stack([q.view(np.uint8) & 15, q.view(np.uint8) >> 4], -1).reshape(x.shape)] * \
            np.repeat(s.astype(np.float32), 16, axis=1)
    else:
        return False
    tensors[name], tensors[name.replace(".weight", ".scale")] = q, s
    return True


def test_fp8_and_fp4_weights_dequantize_while_loading(tmp_path_factory):
    """The published layout, its dense linears FP8 with ``.scale`` (ue8m0) blocks and its routed experts
    FP4: every quantized weight loads as code x scale, computed here with numpy."""
    pub = published_dir(str(tmp_path_factory.mktemp("v4")))
    ckpt = CheckpointTensors(pub)
    tensors, want = {}, {}
    for name in ckpt.keys():
        x = ckpt.get(name)
        if not quantize_as_released(name, x, "layers.", tensors, want):
            tensors[name] = x
    config = {**legacy_form(raw_config()), "expert_dtype": "fp4",
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK],
                                      "scale_fmt": "ue8m0"}}
    out = os.path.join(str(tmp_path_factory.mktemp("v4q")), "quantized")
    _write(out, tensors, config)
    p = js.load_model(out, dtype="float32", progress=False).params
    layers = p["layers"]
    checks = [("layers.1.attn.wq_b.weight", layers["wq_b"][1]), ("layers.3.attn.wo_b.weight", layers["wo_b"][3]),
              ("layers.2.ffn.shared_experts.w2.weight", layers["shared_down"][2]),
              ("layers.0.ffn.experts.3.w1.weight", layers["experts_gate"][0, 3]),
              ("layers.2.ffn.experts.1.w2.weight", layers["experts_down"][2, 1])]
    for name, got in checks:
        np.testing.assert_array_equal(np.asarray(got).T, want[name], err_msg=name)
        assert np.abs(np.asarray(got).T - ckpt.get(name)).max() > 0, name  # it really was quantized


def test_prefix_cache_is_on_by_default():
    """Compressed KV is cached (tests/engine/test_prefix_cache_compressed.py): the window pool's pages
    and every rate's entry pages."""
    eng = js.Engine(golden_model(), engine=js.EngineConfig(max_batch=1, max_seq_len=64))
    assert eng.uncacheable is None and eng.pages.window.caching and all(e.caching for e in eng.pages.entries)
