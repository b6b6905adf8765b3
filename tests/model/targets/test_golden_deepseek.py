"""DeepSeek-V3 MLA targets and their NextN/MTP heads against HF transformers (goldens), plus
the V3.2 indexer key buffer and clear errors for bad configs and checkpoints."""

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxspec as js
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.checkpoints.checkpoint import CheckpointError, CheckpointTensors
from jaxspec.model.config import ConfigError
from jaxspec.model.checkpoints.deepseek import init_deepseek_params
from jaxspec.model.targets.deepseek import create_mla_pool, deepseek_forward
from jaxspec.model.targets.deepseek_config import DeepseekConfig, deepseek_config_from_hf
from jaxspec.model.drafts.mtp import create_mtp_pool, mtp_forward, mtp_logits
from jaxspec.model.checkpoints.mtp import load_mtp_params
from jaxspec.model.targets import forward_sequence
from tests.conftest import engine
from tests.model.golden import arrays, case_dir, cases

DEEPSEEK = [c for c in cases("target") if c["model_type"] == "deepseek_v3"]  # V3.2: test_golden_dsa.py
IDS = [c["name"] for c in DEEPSEEK]


@functools.cache
def load(name):
    case = next(c for c in DEEPSEEK if c["name"] == name)
    return case, js.load_model(case_dir(case), dtype="float32", progress=False), arrays(case)


def test_both_cases_are_present():
    assert sorted(IDS) == ["deepseek_v3_dense", "deepseek_v3_moe"]


@pytest.mark.parametrize("name", IDS)
def test_logits_and_hidden_match_hf(name):
    case, model, ref = load(name)
    assert isinstance(model.config, DeepseekConfig)
    for i, prompt in enumerate(case["prompts"]):
        logits, hidden, _ = forward_sequence(model, np.asarray([prompt]))
        np.testing.assert_allclose(np.asarray(logits[0]), ref[f"logits_{i}"], atol=case["atol"], rtol=case["rtol"])
        np.testing.assert_allclose(np.asarray(hidden[0]), ref[f"hidden_final_{i}"], atol=case["atol"], rtol=case["rtol"])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", IDS)
def test_greedy_tokens_match_hf(name, page_size):
    case, model, ref = load(name)
    n = case["greedy_new_tokens"]
    sampling = js.SamplingParams(max_new_tokens=n, stop_token_ids=())
    eng = engine(page_size, max_batch=4, max_seq_len=64)
    batched = js.generate(model, case["prompts"], sampling=sampling, engine=eng)  # batch 3 (ragged)
    for i in range(len(case["prompts"])):
        assert batched.token_ids[i] == ref[f"greedy_{i}"].tolist(), f"prompt {i}"
    single = js.generate(model, case["prompts"][:1], sampling=sampling, engine=eng)  # batch 1
    assert single.token_ids[0] == ref["greedy_0"].tolist()


@pytest.mark.parametrize("name", IDS)
def test_mtp_head_matches_hf(name):
    check_mtp_head(*load(name))


def check_mtp_head(case, model, ref):
    """The checkpoint's MTP layer over the golden sequence equals HF's block (hidden and logits)."""
    ckpt = CheckpointTensors(case_dir(case))
    params, cfg = load_mtp_params(ckpt, model.config, np.float32, target_params=model.params)
    assert cfg.indexer == case["mtp"].get("indexer", False)
    assert cfg.layer_index == case["mtp"]["layer_index"]
    assert cfg.moe == (case["mtp"]["block"] == "moe")
    T = case["mtp"]["T"]
    pool = create_mtp_pool(cfg, num_pages=2, page_size=T, dtype=jnp.float32)
    positions = jnp.asarray(ref["mtp_positions"], jnp.int32)[None]  # [1, T]
    attn = AttentionInputs.build(jnp.array([[1]], jnp.int32), jnp.zeros((1,), jnp.int32), positions, T)
    tokens = jnp.asarray(ref["mtp_input_ids"], jnp.int32)[None]
    hidden, pool = mtp_forward(params, cfg, tokens, jnp.asarray(ref["mtp_hidden_in"])[None], positions, pool, attn)
    np.testing.assert_allclose(np.asarray(hidden[0]), ref["mtp_hidden_out"], atol=case["atol"], rtol=case["rtol"])
    logits = mtp_logits(params, cfg, hidden)
    np.testing.assert_allclose(np.asarray(logits[0]), ref["mtp_logits"], atol=case["atol"], rtol=case["rtol"])


def test_mtp_feature_is_the_target_final_hidden():
    """The golden MTP input is the target's own post-norm hidden state over prompt_0 + greedy_0."""
    case, model, ref = load("deepseek_v3_dense")
    seq = np.concatenate([ref["prompt_0"], ref["greedy_0"]])
    _, hidden, _ = forward_sequence(model, seq[None, :-1])
    np.testing.assert_allclose(np.asarray(hidden[0]), ref["mtp_hidden_in"], atol=case["atol"], rtol=case["rtol"])


def test_config_forms_and_rope():
    """rope_parameters (dense case) and classic rope_scaling + YaRN (MoE case) both parse;
    transformers-5's head_dim (= rope width) is not taken as an attention head size."""
    (dense_case, dense, _), (moe_case, moe, _) = load("deepseek_v3_dense"), load("deepseek_v3_moe")
    assert {dense_case["rope_form"], moe_case["rope_form"]} == {"rope_parameters", "classic"}
    d, m = dense.config, moe.config
    assert d.rope.kind == "default" and d.q_lora_rank == 32 and d.moe is not None and d.num_dense_layers == 3
    assert d.qk_head_dim == 24 and d.kv_dim == 40
    np.testing.assert_allclose(d.sm_scale, 24 ** -0.5)
    assert m.rope.kind == "yarn" and m.q_lora_rank is None and m.num_dense_layers == 1 and m.num_moe_layers == 2
    np.testing.assert_allclose(m.rope.inv_freq(8), [1, 0.0625, 0.0025, 0.00025], rtol=1e-6)
    np.testing.assert_allclose(m.rope.cos_sin_scale, 1.0)
    np.testing.assert_allclose(m.sm_scale, 24 ** -0.5 * (1 + 0.1 * np.log(4)) ** 2, rtol=1e-6)
    hash(d), hash(m)  # static jit arguments


# ------------------------------------------------------------------- V3.2 indexer (DSA keys)

V32_RAW = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
    "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 16, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "head_dim": 4, "rms_norm_eps": 1e-6,
    "index_n_heads": 2, "index_head_dim": 8, "index_topk": 64, "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}


@functools.cache
def v32_model():
    cfg = deepseek_config_from_hf(V32_RAW)
    params = init_deepseek_params(cfg, jax.random.PRNGKey(3), scale=0.3)
    # Non-trivial LayerNorm affine so the oracle checks weight and bias.
    rng = np.random.default_rng(4)
    for group in ("dense", "moe"):
        lp = params[group]
        lp["idx_norm_w"] = jnp.asarray(1 + 0.1 * rng.standard_normal(lp["idx_norm_w"].shape), jnp.float32)
        lp["idx_norm_b"] = jnp.asarray(0.1 * rng.standard_normal(lp["idx_norm_b"].shape), jnp.float32)
    return cfg, params


def _index_key_oracle(cfg, lp, x, positions):
    """numpy: k = LayerNorm(rms_norm(x) @ wk); rotate-half RoPE (YaRN freqs) on the first R dims."""
    x = np.asarray(x, np.float64)
    h = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * np.asarray(lp["attn_norm"])
    k = h @ np.asarray(lp["idx_wk"], np.float64)
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
    k = k * np.asarray(lp["idx_norm_w"]) + np.asarray(lp["idx_norm_b"])
    R = cfg.qk_rope_head_dim
    ang = np.asarray(positions, np.float64)[..., None] * cfg.rope.inv_freq(R).astype(np.float64)  # [.., R/2]
    cos, sin = np.cos(ang) * cfg.rope.cos_sin_scale, np.sin(ang) * cfg.rope.cos_sin_scale
    a, b = k[..., : R // 2], k[..., R // 2 : R]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, k[..., R:]], axis=-1)


def test_v32_config_fields():
    cfg, _ = v32_model()
    assert cfg.arch == "deepseek_v32" and cfg.has_indexer
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (2, 8, 64)
    pool = create_mla_pool(cfg, num_pages=3, page_size=4, dtype=jnp.float32)
    assert pool.kv.shape == (2, 12, 20) and pool.index_k.shape == (2, 12, 8)
    v3 = deepseek_config_from_hf({**V32_RAW, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"})
    assert not v3.has_indexer


@pytest.mark.parametrize("page_size", [1, 16])
def test_indexer_keys_are_written_at_the_right_slots(page_size):
    """Two ragged requests on scrambled pages, prefilled then extended: every layer's index key
    sits at slot(b, pos) and equals the numpy oracle on that layer's input; untouched slots stay
    zero; the latent and hidden states equal a one-shot forward."""
    cfg, params = v32_model()
    lens, extra = np.array([7, 3]), 3
    W = -(-(lens.max() + extra) // page_size)
    table = (1 + np.random.default_rng(page_size).permutation(2 * W)).reshape(2, W).astype(np.int32)
    pool = create_mla_pool(cfg, num_pages=2 * W + 1, page_size=page_size, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    total = lens + extra
    tokens = rng.integers(0, cfg.vocab_size, size=(2, total.max())).astype(np.int32)
    Tp = lens.max()
    pos = np.broadcast_to(np.arange(Tp, dtype=np.int32), (2, Tp))
    write = np.where(pos < lens[:, None], pos, -1)
    attn = AttentionInputs.build(jnp.asarray(table), jnp.zeros(2, jnp.int32), jnp.asarray(write), page_size)
    out1 = deepseek_forward(params, cfg, jnp.asarray(tokens[:, :Tp]), jnp.asarray(pos), pool, attn, aux_layers=(0, 1))
    pos2 = lens[:, None] + np.arange(extra, dtype=np.int32)  # [2, extra]
    tok2 = np.take_along_axis(tokens, pos2, axis=1)
    attn2 = AttentionInputs.build(jnp.asarray(table), jnp.asarray(lens), jnp.asarray(pos2), page_size)
    out2 = deepseek_forward(params, cfg, jnp.asarray(tok2), jnp.asarray(pos2), out1.pool, attn2, aux_layers=(0, 1))
    index_k, kv = np.asarray(out2.pool.index_k), np.asarray(out2.pool.kv)
    written = np.zeros(index_k.shape[1], bool)
    H = cfg.hidden_size
    for b in range(2):
        # Layer inputs per position, from the prefill and the extension.
        aux = np.concatenate([np.asarray(out1.aux[b, : lens[b]]), np.asarray(out2.aux[b])], axis=0)  # [n, 2H]
        one = deepseek_forward(
            params, cfg, jnp.asarray(tokens[b : b + 1, : total[b]]), jnp.arange(total[b], dtype=jnp.int32)[None],
            create_mla_pool(cfg, num_pages=2, page_size=int(total[b]), dtype=jnp.float32),
            AttentionInputs.build(jnp.array([[1]], jnp.int32), jnp.zeros(1, jnp.int32),
                                  jnp.arange(total[b], dtype=jnp.int32)[None], int(total[b])),
        )
        hid = np.concatenate([np.asarray(out1.hidden[b, : lens[b]]), np.asarray(out2.hidden[b])], axis=0)
        np.testing.assert_allclose(hid, np.asarray(one.hidden[0]), atol=2e-5, rtol=2e-5)
        positions = np.arange(total[b])
        slots = table[b, positions // page_size] * page_size + positions % page_size
        written[slots] = True
        np.testing.assert_allclose(kv[:, slots], np.asarray(one.pool.kv[:, 1 * total[b] : 2 * total[b]]), atol=2e-5)
        for layer, (group, i) in enumerate([("dense", 0), ("moe", 0)]):
            lp = {k: v[i] for k, v in params[group].items()}
            want = _index_key_oracle(cfg, lp, aux[:, layer * H : (layer + 1) * H], positions)
            np.testing.assert_allclose(index_k[layer, slots], want, atol=2e-5, rtol=2e-5)
    assert not np.any(index_k[:, ~written & (np.arange(index_k.shape[1]) >= page_size)])


def test_v3_has_no_index_buffer():
    _, model, _ = load("deepseek_v3_dense")
    pool = create_mla_pool(model.config, num_pages=2, page_size=4, dtype=jnp.float32)
    assert pool.index_k is None and pool.kv.shape == (3, 8, 40)


# ------------------------------------------------------------------- clear errors


def _copy(tmp_path, name="deepseek_v3_moe"):
    dst = tmp_path / name
    shutil.copytree(case_dir(next(c for c in DEEPSEEK if c["name"] == name)), dst)
    return dst


def _edit_config(d, **fields):
    path = os.path.join(d, "config.json")
    with open(path) as f:
        raw = json.load(f)
    for k, v in fields.items():
        if v is ...:
            raw.pop(k, None)
        else:
            raw[k] = v
    with open(path, "w") as f:
        json.dump(raw, f)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(kv_lora_rank=...), "missing required field 'kv_lora_rank'"),
        (dict(qk_rope_head_dim="8"), "'qk_rope_head_dim' must be a positive int"),
        (dict(qk_rope_head_dim=7, qk_head_dim=...), "qk_rope_head_dim must be even"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "unsupported rope scaling type 'dynamic'"),
        (dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": "64"}),
         "original_max_position_embeddings"),
        (dict(n_group=3), "not a multiple of n_group"),
        (dict(scoring_func="softmax"), "scoring_func 'softmax'"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ],
)
def test_bad_config_field_is_a_clear_error(tmp_path, fields, match):
    d = _copy(tmp_path)
    _edit_config(d, **fields)
    with pytest.raises(ConfigError, match=match) as err:
        js.load_model(d, dtype="float32", progress=False)
    assert "config.json" in str(err.value)


def test_transformers5_mlp_layer_types():
    raw = {**V32_RAW, "mlp_layer_types": ["dense", "sparse"]}
    assert deepseek_config_from_hf(raw).num_dense_layers == 1
    with pytest.raises(ConfigError, match="dense layers first"):
        deepseek_config_from_hf({**V32_RAW, "mlp_layer_types": ["sparse", "dense"]})


@pytest.mark.parametrize(
    "drop",
    ["model.layers.1.mlp.experts.2.up_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight",
     "model.layers.2.mlp.gate.e_score_correction_bias"],
)
def test_missing_tensor_is_a_clear_error(tmp_path, drop):
    d = _copy(tmp_path)
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    del tensors[drop]
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=f"missing tensor '{drop}'"):
        js.load_model(d, dtype="float32", progress=False)


def test_mtp_errors(tmp_path):
    _, model, _ = load("deepseek_v3_moe")  # its MTP layer ships embed_tokens + shared_head.head
    d = _copy(tmp_path, "deepseek_v3_moe")
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.3.shared_head.head.weight"]
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match="shared_head.head.weight"):
        load_mtp_params(CheckpointTensors(str(d)), model.config, np.float32)  # no target to share
    params, _ = load_mtp_params(CheckpointTensors(str(d)), model.config, np.float32, target_params=model.params)
    np.testing.assert_array_equal(np.asarray(params["head"]), np.asarray(model.params["lm_head"]))
    del tensors["model.layers.3.eh_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match="eh_proj"):
        load_mtp_params(CheckpointTensors(str(d)), model.config, np.float32, target_params=model.params)
