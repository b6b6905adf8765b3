"""EAGLE heads with q/k/v biases (SafeAILab EAGLE-1's ``qkv_bias``, vLLM llama_eagle3's
``attention_bias``): the biases are read, change the head's output, and the output matches an
independent numpy statement of the head; an o_proj or MLP bias is refused by name; a tensor
nothing reads is named in a warning (as for a target); ``export_eagle3`` keeps the biases."""

import dataclasses
import functools
import json
import math
import os
import shutil
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxspec as js
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.checkpoints.checkpoint import decoder_fields, rope_fields, write_json
from jaxspec.model.checkpoints.eagle import eagle_table, export_eagle3, init_eagle_params
from jaxspec.model.checkpoints.name_tables import export_params
from jaxspec.model.config import RopeConfig
from jaxspec.model.drafts.eagle import EagleConfig, eagle3_config_for
from tests.model.golden import GOLDEN

T = 6
ROPE = RopeConfig(theta=10000.0)  # plain RoPE: the reference below states only that


@functools.cache
def target():
    return js.load_model(os.path.join(GOLDEN, "llama3"), dtype="float32", progress=False)


# ------------------------------------------------------------------- numpy reference (float64)
# Written from SafeAILab EAGLE (cnets1.py: EAGLE-1, cnets.py: EAGLE-3) and vLLM's llama_eagle3:
# one Llama layer, q/k/v with their biases when present, rotate-half RoPE, causal GQA attention.


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rot_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)


def reference_head(d, ids, hidden_in, target_embed):
    """The head's output hidden states [T, H] (pre-norm) for target features ``hidden_in``."""
    c = json.load(open(os.path.join(d, "config.json")))
    assert "rope_scaling" not in c and "rope_parameters" not in c
    W = {k: v.astype(np.float64) for k, v in load_file(os.path.join(d, "model.safetensors")).items()}
    H, nh, nkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or H // nh
    eps = c["rms_norm_eps"]
    n = len(ids)
    inv = 1.0 / (c["rope_theta"] ** (np.arange(0, hd, 2) / hd))
    ang = np.arange(n)[:, None] * inv
    ang = np.concatenate([ang, ang], -1)
    cos, sin = np.cos(ang), np.sin(ang)
    emb = W.get("embed_tokens.weight", target_embed)[ids]
    if "midlayer.hidden_norm.weight" in W:  # EAGLE-3
        p = "midlayer."
        h = hidden_in @ W["fc.weight"].T
        x = np.concatenate([_rms(emb, W[p + "input_layernorm.weight"], eps),
                            _rms(h, W[p + "hidden_norm.weight"], eps)], -1)
    else:  # EAGLE-1: fc([embed, feature]) (+ bias), no input norm
        p = "layers.0."
        h = np.concatenate([emb, hidden_in], -1) @ W["fc.weight"].T + W.get("fc.bias", 0.0)
        x = h

    def proj(name, heads):
        y = x @ W[p + f"self_attn.{name}_proj.weight"].T + W.get(p + f"self_attn.{name}_proj.bias", 0.0)
        return y.reshape(n, heads, hd)

    q, k, v = proj("q", nh), proj("k", nkv), proj("v", nkv)
    q = q * cos[:, None] + _rot_half(q) * sin[:, None]
    k = k * cos[:, None] + _rot_half(k) * sin[:, None]
    k, v = np.repeat(k, nh // nkv, 1), np.repeat(v, nh // nkv, 1)
    s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    h1 = h + np.einsum("hqk,khd->qhd", s, v).reshape(n, nh * hd) @ W[p + "self_attn.o_proj.weight"].T
    z = _rms(h1, W[p + "post_attention_layernorm.weight"], eps)
    g, u = z @ W[p + "mlp.gate_proj.weight"].T, z @ W[p + "mlp.up_proj.weight"].T
    return h1 + ((g / (1 + np.exp(-g))) * u) @ W[p + "mlp.down_proj.weight"].T


# ------------------------------------------------------------------- heads built by jaxspec's helpers


def _biased(cfg, params, seed, zero):
    """``params`` with random nonzero q/k/v biases (zeros when ``zero``)."""
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    rng = np.random.default_rng(seed)
    bqkv = np.zeros(width, np.float32) if zero else rng.standard_normal(width).astype(np.float32)
    return dict(params, layer=dict(params["layer"], bqkv=jnp.asarray(bqkv)))


def write_eagle3(d, zero=False):
    tgt = target()
    cfg = dataclasses.replace(eagle3_config_for(tgt.config, draft_vocab_size=96), rope=ROPE, attention_bias=True)
    params = _biased(cfg, init_eagle_params(cfg, 1, tgt.params, scale=0.2), 11, zero)
    export_eagle3(str(d), params, cfg, target_num_layers=tgt.config.num_layers)
    return params, cfg.feature_size


def write_eagle1(d, zero=False):
    """SafeAILab EAGLE-1 layout (``layers.0.*``, ``fc.bias``) with ``qkv_bias: true``."""
    tgt = target()
    c = tgt.config
    cfg = EagleConfig(version=1, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                      rms_norm_eps=c.rms_norm_eps, rope=ROPE, vocab_size=c.vocab_size,
                      draft_vocab_size=c.vocab_size, target_hidden_size=c.hidden_size, fc_bias=True,
                      attention_bias=True)
    params = _biased(cfg, init_eagle_params(cfg, 2, tgt.params, scale=0.2), 12, zero)
    params["fc_bias"] = jnp.asarray(np.random.default_rng(13).standard_normal(c.hidden_size).astype(np.float32) * 0.1)
    os.makedirs(d, exist_ok=True)
    save_file(export_params(eagle_table(cfg, "layers.0."), params, np.float32), os.path.join(d, "model.safetensors"))
    write_json(os.path.join(d, "config.json"), {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **decoder_fields(cfg, 1),
        **rope_fields(cfg.rope), "vocab_size": cfg.vocab_size, "bias": True, "qkv_bias": True})
    return params, cfg.feature_size


HEADS = {"eagle3": write_eagle3, "eagle1": write_eagle1}


def head_output(d, feature):
    """Loads the head at ``d`` (warnings are errors) and runs it over T rows: [T, H]."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        draft = js.load_draft(str(d), target())
    cfg = draft.config
    rng = np.random.default_rng(5)
    ids = rng.integers(0, cfg.vocab_size, T)
    hidden_in = rng.standard_normal((T, feature)).astype(np.float32)
    pool = cfg.create_pool(num_pages=2, page_size=16, dtype=jnp.float32)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    attn = AttentionInputs.build(jnp.asarray([[1]], jnp.int32), jnp.zeros((1,), jnp.int32), pos, 16)
    h, _, _ = cfg.forward(draft.params, jnp.asarray(ids[None], jnp.int32), jnp.asarray(hidden_in[None]), pos, pool,
                          attn, None, from_target=True)
    return draft, np.asarray(h[0]), ids, hidden_in


@pytest.mark.parametrize("kind", list(HEADS))
def test_qkv_biases_are_read_and_change_the_output(tmp_path, kind):
    params, feature = HEADS[kind](tmp_path / "biased")
    _, feature = HEADS[kind](tmp_path / "unbiased", zero=True)
    draft, out, ids, hidden_in = head_output(tmp_path / "biased", feature)
    assert draft.config.model.attention_bias
    np.testing.assert_allclose(np.asarray(draft.params["layer"]["bqkv"]), np.asarray(params["layer"]["bqkv"]),
                               rtol=0, atol=0)  # the export round trip keeps them
    ref = reference_head(tmp_path / "biased", ids, hidden_in.astype(np.float64),
                         np.asarray(target().params["embed"], np.float64))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    _, plain, _, _ = head_output(tmp_path / "unbiased", feature)
    assert np.abs(out - plain).max() > 1e-2  # the same head without the biases differs


def test_export_writes_the_bias_flag(tmp_path):
    write_eagle3(tmp_path)
    c = json.load(open(tmp_path / "config.json"))
    assert c["qkv_bias"] is True and c["attention_bias"] is False
    names = load_file(str(tmp_path / "model.safetensors"))
    assert {f"midlayer.self_attn.{p}_proj.bias" for p in "qkv"} <= set(names)


def _copy_golden(tmp_path, name):
    d = tmp_path / name
    shutil.copytree(os.path.join(GOLDEN, name), d)
    return d


def _edit(d, tensors=None, **fields):
    if tensors:
        t = load_file(str(d / "model.safetensors"))
        t.update(tensors)
        save_file(t, str(d / "model.safetensors"))
    c = json.loads((d / "config.json").read_text())
    c.update(fields)
    (d / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("name", ["eagle1", "eagle3_midlayer", "eagle3_layers0"])
def test_golden_heads_load_without_a_warning(name):  # embed_tokens, fc.bias, d2t read; t2d ignored
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        js.load_draft(os.path.join(GOLDEN, name), target())


@pytest.mark.parametrize("name,extra", [
    ("eagle3_midlayer", "midlayer.self_attn.o_proj.bias"),  # no attention_bias: nothing reads it
    ("eagle3_midlayer", "midlayer.mlp.extra_norm.weight"),
    ("eagle1", "layers.0.self_attn.q_proj.bias"),  # no qkv_bias / attention_bias
])
def test_a_head_tensor_nothing_reads_is_named(tmp_path, name, extra):
    d = _copy_golden(tmp_path, name)
    _edit(d, {extra: np.zeros((64,), np.float32)})
    with pytest.warns(UserWarning, match=r"1 checkpoint tensor\(s\) are not read by jaxspec's EAGLE head model.*: "
                                         + extra.replace(".", r"\.") + "$"):
        js.load_draft(str(d), target())


@pytest.mark.parametrize("name,tensors,fields,match", [
    ("eagle3_midlayer", {f"midlayer.self_attn.{p}_proj.bias": 64 if p == "o" else {"q": 64}.get(p, 32)
                         for p in "qkvo"}, dict(attention_bias=True), r"midlayer\.self_attn\.o_proj\.bias"),
    ("eagle3_midlayer", {}, dict(mlp_bias=True), "mlp_bias"),
    ("eagle1", {}, dict(mlp_bias=True), "mlp_bias"),
], ids=["eagle3-o_proj-bias", "eagle3-mlp-bias", "eagle1-mlp-bias"])
def test_biases_the_layer_cannot_apply_are_refused(tmp_path, name, tensors, fields, match):
    d = _copy_golden(tmp_path, name)
    _edit(d, {k: np.ones((n,), np.float32) for k, n in tensors.items()}, **fields)
    with pytest.raises(ValueError, match=match):
        js.load_draft(str(d), target())
