"""P-EAGLE against the ``speculators`` library's model classes (goldens by
``scripts/goldens/peagle.py``; see tests/data/golden/peagle/README.md): loading the library's
layout, every context row's logits after the extend, the anchor row's and the parallel mask rows'
hidden states and logits, the greedy chain, and the reference drafting loop's greedy tokens and
per-step acceptance lengths (heads trained briefly with the library's own training forward on the
DFlash goldens' target, so acceptance varies); and the same heads in the library's plain EAGLE-3
layout (``speculators_model_type`` "eagle3", no mask token) drafting token by token."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from safetensors.numpy import load_file, save_file

import jaxspec as js
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.drafts.base import DraftSeed
from jaxspec.model.targets import forward_sequence
from tests.model.golden_drafts import GoldenDrafts, target

DRAFTS = GoldenDrafts("peagle")
manifest, golden, draft, case = DRAFTS.manifest, DRAFTS.golden, DRAFTS.draft, DRAFTS.case

NAMES = [c["name"] for c in manifest()["cases"]]
TOL = dict(atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("name", NAMES)
def test_loads_the_speculators_layout(name):
    """Detected by ``speculators_model_type`` "peagle": its layers (Llama or Qwen3, one or more),
    the taps as HF ``hidden_states`` indices, its draft vocabulary, its own trained embedding,
    and the chain it was trained for as ``block_size - 1``."""
    c, d = case(name), draft(name)
    m = d.config.model
    assert d.kind == "peagle" and d.config.proposer == "block"
    assert m.num_layers == c["num_layers"] and m.qk_norm == (c["layer_model_type"] == "qwen3")
    assert list(d.config.aux_layers) == c["eagle_aux_hidden_state_layer_ids"]
    assert m.draft_vocab_size == c["draft_vocab_size"] and m.num_speculative_tokens == c["num_speculative_tokens"]
    assert d.block_size == c["num_speculative_tokens"] + 1
    assert not np.allclose(np.asarray(d.params["embed"]), np.asarray(target().params["embed"]))


def rows(name: str):
    """The extend over the golden's context (row p: the token at p + 1, the last one the bonus; the
    target's features at p) at positions 0..C-1, then the mask rows at C..C+K-2.
    Returns (context rows' hidden [1, C, H], proposal hidden [1, K, H]: the seed then the mask rows)."""
    d, g, c = draft(name), golden(), case(name)
    ctx = jnp.asarray(g[f"{name}/block/context"])[None]  # [1, C, F]
    C, K, page = ctx.shape[1], c["num_speculative_tokens"], 4
    tokens = jnp.asarray([c["block_prompt"][1:] + [int(g[f"{name}/block/bonus"])]], jnp.int32)
    pool = d.config.create_pool(num_pages=1 + -(-(C + K) // page), page_size=page, dtype=jnp.float32)
    table = jnp.arange(1, pool.num_slots // page, dtype=jnp.int32)[None]
    pos = jnp.arange(C, dtype=jnp.int32)[None]
    h, pool = d.config.extend(d.params, tokens, ctx, pos, pool,
                              AttentionInputs.build(table, jnp.zeros(1, jnp.int32), pos, page), None)
    bpos = C + jnp.arange(K - 1, dtype=jnp.int32)[None]
    mask_rows, _ = d.config.block_forward(d.params, jnp.zeros((1, K - 1), jnp.int32), bpos, pool,
                                          AttentionInputs.build(table, jnp.full((1,), C, jnp.int32), bpos, page))
    return h, d.config.proposal_hidden(mask_rows, DraftSeed(hidden=h[:, C - 1]))


@pytest.mark.parametrize("name", NAMES)
def test_context_rows_and_parallel_rows(name):
    """The target's taps equal the library's features; every context row's logits (EAGLE-3's
    row: the token after it with the target's features), the anchor row's and the mask rows'
    hidden states (before the final norm) and logits, and the greedy chain (target ids)."""
    d, g, c = draft(name), golden(), case(name)
    _, _, aux = forward_sequence(target(), [c["block_prompt"]], aux_layers=d.config.aux_layers)
    np.testing.assert_allclose(np.asarray(aux[0]), g[f"{name}/block/context"], **TOL)
    context, hidden = rows(name)
    np.testing.assert_allclose(np.asarray(d.config.logits(d.params, context)[0]), g[f"{name}/block/context_logits"],
                               **TOL)
    np.testing.assert_allclose(np.asarray(hidden[0]), g[f"{name}/block/hidden"], **TOL)
    np.testing.assert_allclose(np.asarray(d.config.logits(d.params, hidden)[0]), g[f"{name}/block/logits"], **TOL)
    tokens, _ = d.config.candidates(d.params, hidden, None, 1)
    np.testing.assert_array_equal(np.asarray(tokens[0, :, 0]), g[f"{name}/block/path"])


@pytest.mark.parametrize("name,page", [(n, 16 if i % 2 else 1) for i, n in enumerate(NAMES)])
def test_generate_tokens_and_acceptance_lengths(name, page):
    """The reference loop's greedy tokens and the accept length of every step before the last (it
    runs whole chains, as jaxspec does, and cuts the output); a ragged batch of three prompts, the
    chain the head was trained for, pages 1 and 16."""
    DRAFTS.check_generate(name, page)


# ----------------------------------------------------------- the library's plain EAGLE-3 layout


def eagle3_head(tmp_path, name: str, drop: str = "mask_hidden", **changes):
    """Golden head ``name`` as the library writes a plain EAGLE-3 head (speculators_model_type
    "eagle3", architectures ["Eagle3Speculator"]): its weights without mask_token_id and the
    tensor ``drop`` (``mask_hidden``)."""
    changes = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
               "speculators_config.algorithm": "eagle3", **changes}
    dst = DRAFTS.copy_with(tmp_path, name, drop=("mask_token_id",), **changes)
    tensors = load_file(dst / "model.safetensors")
    del tensors[drop]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta=10000.0):  # x [T, n, D]: HF's rotate_half
    D = x.shape[-1]
    ang = pos[:, None] * theta ** (-np.arange(0, D, 2) / D)
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    return x * cos + np.concatenate([-x[..., D // 2:], x[..., :D // 2]], -1) * sin


def eagle3_reference(path, cfg: dict, tokens, feature, own: int):
    """The library's EAGLE-3 forward in numpy over the checkpoint's own (HF-named) tensors: rows
    0..own-1 read (token, target features through the fc norms and ``fc``), rows from ``own``
    (token, the previous row's output) as EAGLE-3 drafts; causal at positions 0..T-1. Returns
    (pre-norm hidden [T, H], logits [T, Vd])."""
    w = {k: v.astype(np.float64) for k, v in load_file(f"{path}/model.safetensors").items()}
    lc = cfg["transformer_layer_config"]
    n, nkv, D = lc["num_attention_heads"], lc["num_key_value_heads"], lc["head_dim"]
    x = np.asarray(feature, np.float64)
    if cfg["norm_before_fc"]:
        x = _rms(x, w["input_norm.weight"])
    if cfg["fc_norm"]:
        x = np.concatenate([_rms(c, w[f"fc_norm.{j}.weight"]) for j, c in enumerate(np.split(x, len(cfg["eagle_aux_hidden_state_layer_ids"]), -1))],
                           -1)
    fc = x @ w["fc.weight"].T
    T = len(tokens)
    pos, causal = np.arange(T), np.tril(np.ones((T, T), bool))

    def layer(i, a, residual):
        pre = f"layers.{i}."
        q, k, v = (a @ w[pre + f"self_attn.{p}_proj.weight"].T for p in "qkv")
        q, k, v = q.reshape(T, n, D), k.reshape(T, nkv, D), v.reshape(T, nkv, D)
        if pre + "self_attn.q_norm.weight" in w:
            q, k = _rms(q, w[pre + "self_attn.q_norm.weight"]), _rms(k, w[pre + "self_attn.k_norm.weight"])
        q, k = _rope(q, pos), np.repeat(_rope(k, pos), n // nkv, 1)
        s = np.where(causal[None], np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D), -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), np.repeat(v, n // nkv, 1)).reshape(T, n * D)
        h = residual + o @ w[pre + "self_attn.o_proj.weight"].T
        m = _rms(h, w[pre + "post_attention_layernorm.weight"])
        g, u = m @ w[pre + "mlp.gate_proj.weight"].T, m @ w[pre + "mlp.up_proj.weight"].T
        return h + (g / (1 + np.exp(-g)) * u) @ w[pre + "mlp.down_proj.weight"].T

    def rows(h_in):
        hn = _rms(h_in, w["layers.0.hidden_norm.weight"])
        a = np.concatenate([_rms(w["embed_tokens.weight"][tokens], w["layers.0.input_layernorm.weight"]), hn], -1)
        h = layer(0, a, hn if cfg["norm_before_residual"] else h_in)
        for i in range(1, lc["num_hidden_layers"]):
            h = layer(i, _rms(h, w[f"layers.{i}.input_layernorm.weight"]), h)
        return h

    h_in = np.concatenate([fc[:own], np.zeros((T - own, fc.shape[-1]))])
    for r in range(own, T + 1):  # rows from own read the output of the row before them
        h = rows(h_in)
        if r < T:
            h_in[r] = h[r - 1]
    return h, _rms(h, w["norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("name", NAMES)
def test_speculators_eagle3_head_drafts_as_eagle3(tmp_path, name):
    """A head in the library's plain EAGLE-3 layout loads as an "eagle3" draft (token by token,
    its taps and layers as configured; norm_before_fc, and fc_norm with norm_before_residual over
    two Llama layers). Its extend over the golden context, fed the target's own taps, gives the
    library's logits of every context row (and the P-EAGLE head's target ids through d2t); then one
    drafting row (the last row's output with its greedy token, no fc) equals a numpy EAGLE-3
    forward over the checkpoint's tensors."""
    path, c, g, p = eagle3_head(tmp_path, name), case(name), golden(), draft(name)
    d = js.load_draft(path, target())
    assert d.kind == "eagle3" and d.config.proposer == "recurrent"
    assert list(d.config.aux_layers) == c["eagle_aux_hidden_state_layer_ids"]
    assert d.config.num_layers == c["num_layers"] and d.config.model.draft_vocab_size == c["draft_vocab_size"]
    prompt = c["block_prompt"]
    C, page = len(prompt), 4
    _, _, aux = forward_sequence(target(), [prompt], aux_layers=d.config.aux_layers)
    tokens = jnp.asarray([prompt[1:] + [int(g[f"{name}/block/bonus"])]], jnp.int32)
    pool = d.config.create_pool(num_pages=1 + -(-(C + 1) // page), page_size=page, dtype=jnp.float32)
    table = jnp.arange(1, pool.num_slots // page, dtype=jnp.int32)[None]
    pos = jnp.arange(C, dtype=jnp.int32)[None]
    h, pool = d.config.extend(d.params, tokens, jnp.asarray(aux[0])[None], pos, pool,
                              AttentionInputs.build(table, jnp.zeros(1, jnp.int32), pos, page), None)
    logits = d.config.logits(d.params, h)
    np.testing.assert_allclose(np.asarray(logits[0]), g[f"{name}/block/context_logits"], **TOL)
    best = jnp.argmax(logits[0], -1)
    ids = d.config.to_target_ids(d.params, best)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(p.config.to_target_ids(p.params, best)))
    np.testing.assert_array_equal(np.argmax(np.asarray(d.config.target_vocab_logits(d.params, logits[0])), -1), ids)
    # one drafting row at position C: the greedy token after the bonus, fed the last row's output
    dpos = jnp.full((1, 1), C, jnp.int32)
    h2, _, _ = d.config.forward(d.params, ids[None, -1:], h[:, -1:], dpos, pool,
                                AttentionInputs.build(table, jnp.full((1,), C, jnp.int32), dpos, page), None,
                                from_target=False)
    ref_h, ref_logits = eagle3_reference(path, json.loads((path / "config.json").read_text()), tokens[0].tolist() + [int(ids[-1])],
                                         g[f"{name}/block/context"], own=C)
    np.testing.assert_allclose(ref_logits[:C], g[f"{name}/block/context_logits"], **TOL)  # the reference is right
    np.testing.assert_allclose(np.asarray(h2[0, 0]), ref_h[C], **TOL)
    np.testing.assert_allclose(np.asarray(d.config.logits(d.params, h2)[0, 0]), ref_logits[C], **TOL)


@pytest.mark.parametrize("name,spec", [("peagle", js.SpecConfig.chain(4)),
                                       ("peagle_llama_dv", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6))])
def test_speculators_eagle3_greedy_equals_plain_greedy(tmp_path, name, spec):
    """Greedy speculative decoding with the EAGLE-3 head (a chain; a tree over the reduced draft
    vocabulary) gives plain greedy's tokens, and its first proposals are accepted at times."""
    from tests.spec.test_dflash import greedy_lossless
    acc, _ = greedy_lossless(target(), js.load_draft(eagle3_head(tmp_path, name), target()), spec, 16)
    assert (acc > 1).mean() > 0.1, acc


@pytest.mark.parametrize("name,drop,changes,match", [
    ("peagle", "layers.0.hidden_norm.weight", {},
     r"a speculators eagle3 config, but the tensors are not an EAGLE-3 head's \(fc, layers.0.hidden_norm\)"),
    ("peagle", "mask_hidden", {"transformer_layer_config.attention_bias": True},
     "EAGLE-3 layers with attention_bias / mlp_bias are not supported"),
    ("peagle_llama_dv", "mask_hidden", {"draft_vocab_size": 300},
     "EAGLE-3 draft_vocab_size 300 exceeds the target vocabulary 256"),
    ("peagle_llama_dv", "d2t", {}, "EAGLE-3 draft_vocab_size 192 < the target's 256 but the checkpoint has no d2t map"),
    ("peagle", "mask_hidden", {"speculators_model_type": "mlp"},
     r"speculators_model_type 'mlp' is not a draft jaxspec loads from this layout; supported: .*'eagle3'"),
])
def test_speculators_eagle3_refusals_name_the_problem(tmp_path, name, drop, changes, match):
    with pytest.raises(ValueError, match=match):
        js.load_draft(eagle3_head(tmp_path, name, drop=drop, **changes), target())
