#!/usr/bin/env python
"""Build tiny random Hugging Face checkpoints and record reference outputs ("goldens").

The JAX implementation is tested against these files (tests/data/golden). This script is NOT run in
CI; it needs torch + transformers. Set-up used to produce the committed files (a Python 3.11 venv):

    python3.11 -m venv VENV && VENV/bin/pip install torch==2.13.0 transformers safetensors numpy
    VENV/bin/python scripts/goldens/targets.py            # rewrites tests/data/golden/<case>/ + manifest.json

(The committed files were made with transformers 5.23.0; the exact versions are in manifest.json.)

Cases (see tests/data/golden/README.md for the file layout and array shapes):
  targets   llama3, llama2, qwen2, qwen2_yarn, qwen3, mistral   HF *ForCausalLM, logits / greedy / hidden goldens
  MLA       deepseek_v3_dense, deepseek_v3_moe           the same, plus an MTP (NextN) layer and its golden
  drafts    eagle3_midlayer, eagle3_layers0, eagle1      our own small PyTorch re-implementation of the
                                                         published EAGLE-3 / EAGLE-1 heads (no HF class)

Weights are re-initialised with a larger scale than HF's default (std 0.02 gives near-uniform logits, so
greedy argmax would hinge on 1e-6 differences). Seeds are searched so that every recorded greedy step has
a top-1 minus top-2 logit margin >= MIN_MARGIN (and, for MoE, every routing decision a margin >=
MIN_ROUTING_MARGIN); the minimum is written to the manifest.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from scripts.goldens.common import (  # noqa: E402
    ATOL, GOLDEN, HIDDEN, INTER, MAX_SEED_TRIES, MIN_DISTINCT, MIN_MARGIN, MIN_ROUTING_MARGIN, NEW_TOKENS, RTOL, VOCAB,
    arguments, config_rope_form, eagle3_taps, eos_ids, f32, forward_capture, greedy, i64, list_files, make_prompts,
    reinit_, rewrite_config_classic, start, write_manifest,
)

HEAD_T = 9  # tokens fed to the draft heads


# ----------------------------------------------------------------------------------------------------
# MoE routing margins (DeepSeek-V3 sigmoid + group-limited routing)
# ----------------------------------------------------------------------------------------------------


class RoutingProbe:
    """Forward-pre-hooks on every DeepseekV3TopkRouter; records the smallest decision margin seen."""

    def __init__(self, modules):
        self.min_margin = float("inf")
        self.handles = []
        for mod in modules:
            if type(mod).__name__ in ("DeepseekV3TopkRouter", "DeepseekV32TopkRouter"):
                self.handles.append(mod.register_forward_pre_hook(self._hook))

    def _hook(self, mod, args):
        import torch
        import torch.nn.functional as F

        x = args[0].reshape(-1, mod.hidden_dim).float()
        scores = torch.sigmoid(F.linear(x, mod.weight.float()))
        choice = scores + mod.e_score_correction_bias.float()
        n, e, g = choice.shape[0], mod.num_experts, mod.num_group
        group_scores = choice.view(n, g, e // g).topk(2, dim=-1).values.sum(-1)  # [n, g]
        margins = []
        if mod.topk_group < g:
            gs = group_scores.sort(dim=-1, descending=True).values
            margins.append(gs[:, mod.topk_group - 1] - gs[:, mod.topk_group])
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(mod.topk_group, dim=-1).indices, 1.0)
        keep = keep.bool().unsqueeze(-1).expand(n, g, e // g).reshape(n, e)
        masked = choice.masked_fill(~keep, float("-inf")).sort(dim=-1, descending=True).values
        if masked.shape[1] > mod.top_k:
            nxt = masked[:, mod.top_k]
            m = masked[:, mod.top_k - 1] - nxt
            margins.append(torch.where(torch.isinf(nxt), torch.full_like(m, float("inf")), m))
        for m in margins:
            self.min_margin = min(self.min_margin, float(m.min()))

    def remove(self):
        for h in self.handles:
            h.remove()


# ----------------------------------------------------------------------------------------------------
# target forward / greedy
# ----------------------------------------------------------------------------------------------------


def target_goldens(model, prompts) -> tuple[dict[str, np.ndarray], float, list[list[int]]]:
    """Goldens for all prompts. The returned margin is -inf when a greedy continuation is degenerate (fewer
    than MIN_DISTINCT distinct tokens) or contains an EOS id of the config, so the seed search skips it: the
    goldens then hold whether or not an engine stops on the config's EOS."""
    arrays: dict[str, np.ndarray] = {}
    min_margin = float("inf")
    greedies = []
    for i, p in enumerate(prompts):
        cap = forward_capture(model, p)
        toks, m = greedy(model, p, NEW_TOKENS)
        if len(set(toks)) < MIN_DISTINCT or eos_ids(model.config) & set(toks):
            m = float("-inf")
        min_margin = min(min_margin, m)
        greedies.append(toks)
        arrays[f"prompt_{i}"] = i64(p)
        arrays[f"logits_{i}"] = f32(cap["logits"])
        arrays[f"greedy_{i}"] = i64(toks)
        arrays[f"hidden_final_{i}"] = f32(cap["hidden_final"])
        if cap["aux"] is not None:
            arrays[f"aux_{i}"] = f32(cap["aux"])
    return arrays, min_margin, greedies


def check_reload(case_dir: Path, arrays: dict[str, np.ndarray], prompts, extra_check=None) -> None:
    """Load the saved checkpoint back with AutoModelForCausalLM and reproduce its own goldens."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(case_dir, dtype=torch.float32, attn_implementation="eager")
    m.eval()
    for i, p in enumerate(prompts):
        cap = forward_capture(m, p)
        for key, val in (("logits", cap["logits"]), ("hidden_final", cap["hidden_final"]), ("aux", cap["aux"])):
            if val is None:
                assert f"{key}_{i}" not in arrays
                continue
            ref = arrays[f"{key}_{i}"]
            err = float(np.abs(f32(val) - ref).max())
            assert err == 0.0, f"{case_dir.name}: reloaded {key}_{i} differs by {err}"
        toks, _ = greedy(m, p, NEW_TOKENS)
        assert toks == arrays[f"greedy_{i}"].tolist(), f"{case_dir.name}: reloaded greedy_{i} differs"
    if extra_check is not None:
        extra_check(m)


# ----------------------------------------------------------------------------------------------------
# Llama-family targets
# ----------------------------------------------------------------------------------------------------

COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=4,
              max_position_embeddings=512)

TARGET_NAMES = ("llama3", "llama2", "qwen2", "qwen2_yarn", "qwen3", "mistral")  # the manifest's order


def targets() -> dict:
    """The Llama-family target cases, in TARGET_NAMES' order (each case draws from its own seeds).

    The llama3 case is the EAGLE target and gets 7 layers, so that its EAGLE-3 taps (2, 3, 4) are distinct.
    The other Llama-family targets use 2 layers to keep tests/data/golden near 6 MB; with L < 4 the taps
    (2, L//2, L-3) are meaningless, so those cases record no aux_{i} and "eagle3_aux_layers": null."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    return {
        "llama3": dict(
            cls=LlamaForCausalLM, seed=1000, rope_form="rope_parameters", shard=None,
            config=lambda: LlamaConfig(
                **COMMON, num_hidden_layers=7, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
            notes=["llama3 rope scaling with original_max_position_embeddings 64: with head_dim 16 and theta 5e5 the "
                   "first frequency is unchanged, the second is smoothed, the rest are divided by 8."],
        ),
        "llama2": dict(
            cls=LlamaForCausalLM, seed=2000, rope_form="classic", shard=None,
            config=lambda: LlamaConfig(
                **COMMON, num_hidden_layers=2, num_key_value_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
            notes=["MHA; tie_word_embeddings true: the file has no lm_head.weight, logits use model.embed_tokens.weight.",
                   "config.json rewritten by hand to the classic form (rope_theta, rope_scaling null, torch_dtype)."],
        ),
        "qwen2": dict(
            cls=Qwen2ForCausalLM, seed=3000, rope_form="classic", shard=None,
            config=lambda: Qwen2Config(
                **COMMON, num_hidden_layers=2, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
            notes=["q/k/v_proj have biases (o_proj none), randomised non-zero.",
                   "config.json rewritten by hand to the classic form (rope_theta 1e6, rope_scaling null, torch_dtype)."],
        ),
        "qwen2_yarn": dict(
            cls=Qwen2ForCausalLM, seed=3500, rope_form="classic", shard=None,
            config=lambda: Qwen2Config(
                **{**COMMON, "max_position_embeddings": 256}, num_hidden_layers=2, num_key_value_heads=2,
                rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64}),
            notes=["YaRN RoPE in the classic form Qwen2.5 documents for long context: rope_scaling {type: yarn, "
                   "factor 4, original_max_position_embeddings 64} (max_position_embeddings 256 = factor x original).",
                   "HF _compute_yarn_parameters: frequencies blended between 1/theta^(2j/D) and that / factor over the "
                   "beta_fast 32 .. beta_slow 1 correction band; cos and sin scaled by attention_factor = "
                   "0.1 ln(4) + 1 = 1.1386."],
        ),
        "qwen3": dict(
            cls=Qwen3ForCausalLM, seed=4000, rope_form="rope_parameters", shard=None,
            config=lambda: Qwen3Config(
                **COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
            notes=["head_dim 32 != hidden/heads (16): q_proj [128, 64], k/v_proj [64, 64], o_proj [64, 128].",
                   "q_norm/k_norm ([head_dim]) are per-head RMSNorms applied after the head reshape, before RoPE; "
                   "randomised (not ones). tie_word_embeddings true."],
        ),
        "mistral": dict(
            cls=MistralForCausalLM, seed=5000, rope_form="rope_parameters", shard="200KB",
            config=lambda: MistralConfig(
                **COMMON, num_hidden_layers=2, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
            notes=["sliding_window null; saved sharded (model-0000i-of-0000N.safetensors + model.safetensors.index.json)."],
        ),
    }


def build_target(name: str, spec: dict, seed: int):
    import torch

    torch.manual_seed(seed)
    cfg = spec["config"]()
    cfg._attn_implementation = "eager"
    model = spec["cls"](cfg).eval()
    reinit_(model, torch.Generator().manual_seed(seed))
    return model


def make_target_case(out: Path, name: str, spec: dict) -> dict:
    for attempt in range(MAX_SEED_TRIES):
        seed = spec["seed"] + attempt
        model = build_target(name, spec, seed)
        prompts = make_prompts(seed)
        arrays, margin, greedies = target_goldens(model, prompts)
        if margin >= MIN_MARGIN:
            break
    else:
        raise RuntimeError(f"{name}: no seed with greedy margin >= {MIN_MARGIN}")
    case_dir = out / name
    kwargs = {"max_shard_size": spec["shard"]} if spec["shard"] else {}
    model.save_pretrained(case_dir, **kwargs)
    if spec["rope_form"] == "classic":
        rewrite_config_classic(case_dir)
    assert config_rope_form(case_dir) == spec["rope_form"]
    if spec["shard"]:
        shards = sorted(case_dir.glob("model-*-of-*.safetensors"))
        assert len(shards) >= 2 and (case_dir / "model.safetensors.index.json").exists(), shards
    keys = all_tensor_names(case_dir)
    assert ("lm_head.weight" in keys) == (not model.config.tie_word_embeddings)
    check_reload(case_dir, arrays, prompts)
    np.savez(case_dir / "golden.npz", **arrays)
    n_layers = model.config.num_hidden_layers
    return {
        "name": name, "kind": "target", "dir": name, "dtype": "float32", "atol": ATOL, "rtol": RTOL,
        "architecture": type(model).__name__, "model_type": model.config.model_type,
        "num_hidden_layers": n_layers, "rope_form": spec["rope_form"],
        "tie_word_embeddings": bool(model.config.tie_word_embeddings), "sharded": bool(spec["shard"]),
        "files": list_files(case_dir), "seed": seed, "prompts": prompts, "greedy_new_tokens": NEW_TOKENS,
        "min_greedy_margin": margin, "eagle3_aux_layers": eagle3_taps(n_layers),
        "eos_token_ids": sorted(eos_ids(model.config)),
        "keys": golden_keys(len(prompts), with_aux=eagle3_taps(n_layers) is not None), "notes": spec["notes"],
    }


def all_tensor_names(case_dir: Path) -> set[str]:
    from safetensors import safe_open

    names = set()
    for p in case_dir.glob("*.safetensors"):
        with safe_open(p, "pt") as f:
            names.update(f.keys())
    return names


def golden_keys(n: int, with_aux: bool) -> list[str]:
    keys = []
    for i in range(n):
        keys += [f"prompt_{i}", f"logits_{i}", f"greedy_{i}", f"hidden_final_{i}"]
        if with_aux:
            keys.append(f"aux_{i}")
    return keys


# ----------------------------------------------------------------------------------------------------
# DeepSeek-V3 (MLA) targets with an MTP / NextN layer
# ----------------------------------------------------------------------------------------------------

DS_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                 n_shared_experts=1, moe_intermediate_size=32, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                 norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False, num_nextn_predict_layers=1)

DS_NOTES_COMMON = [
    "MLA: q = q_proj(x) (or q_b_proj(q_a_layernorm(q_a_proj(x))) with q_lora_rank), split per head into "
    "[qk_nope 16 | qk_rope 8]; kv_a_proj_with_mqa(x) -> [kv_lora 32 | k_rope 8]; kv_a_layernorm on the 32-wide "
    "latent only; kv_b_proj(latent) -> per head [k_nope 16 | v 16]; k_rope (one head) is shared by all heads; "
    "o_proj over heads*v_head_dim.",
    "RoPE acts on the 8 rope dims only and uses INTERLEAVED pairs (x0,x1),(x2,x3),... (config rope_interleave "
    "true, HF default; DeepSeek's reference uses complex pairs): pair j rotates by pos*inv_freq[j]. HF writes the "
    "rotated result de-interleaved (evens then odds) for both q and k, which leaves q.k unchanged.",
    "softmax scale = (qk_nope+qk_rope)^-0.5 = 24^-0.5, times mscale^2 when rope is scaled (see the yarn note).",
    "config.json written by transformers 5 carries head_dim = qk_rope_head_dim (8) and qk_head_dim (24); "
    "head_dim is NOT the attention head size for MLA.",
    "MoE gate: router logits = x @ gate.weight^T in float32; scores = sigmoid(logits); choice = scores + "
    "e_score_correction_bias (selection only); group score = sum of the top-2 choice values in each of n_group "
    "groups; keep the topk_group best groups; top num_experts_per_tok experts among them by choice; weights = "
    "the plain sigmoid scores of those experts, divided by their sum (+1e-20) when norm_topk_prob, then times "
    "routed_scaling_factor; output = sum_k w_k * expert_k(x) + shared_experts(x) (shared intermediate = "
    "moe_intermediate_size * n_shared_experts). Experts are SwiGLU; on disk per expert: "
    "mlp.experts.{e}.{gate,up,down}_proj.weight.",
    "Layer i uses MoE iff i >= first_k_dense_replace.",
    "MTP (NextN) layer stored as model.layers.{num_hidden_layers}.* (here 3), ignored by HF's model: at position p "
    "h = eh_proj(cat(enorm(embed(token_{p+1})), hnorm(h_p))) (embedding FIRST), then one full decoder block "
    "(causal attention over the MTP positions, its own KV, RoPE position p), mtp_hidden_out = block output, "
    "mtp_logits = shared_head.head(shared_head.norm(mtp_hidden_out)). h_p is the main model's hidden state AFTER "
    "the final model.norm (what SGLang stores from the target forward for NEXTN, what vLLM's DeepseekV2Model "
    "returns, and what HF 5's MTP candidate generator feeds: hidden_states[-1], i.e. the normed state). For "
    "chained MTP steps SGLang feeds back the block output BEFORE shared_head.norm.",
    "MTP golden: sequence s = prompt_0 + greedy_0 (21 tokens), T = len(s) - 1 = 20 positions; mtp_input_ids[p] = "
    "s[p+1], mtp_hidden_in[p] = main hidden_final at p (forward over all of s), mtp_positions = 0..T-1. No "
    "position-0 masking (SGLang/HF do not mask; vLLM's deepseek_mtp zeroes the token embedding at position 0 "
    "before enorm, which would change these numbers).",
    "shared_head.head.weight is a copy of lm_head.weight (as in the real DeepSeek-V3 checkpoint; SGLang and HF "
    "use the target lm_head, vLLM loads shared_head.head).",
]

DS_NAMES = ("deepseek_v3_dense", "deepseek_v3_moe")


def ds_cases() -> dict:
    from transformers import DeepseekV3Config

    return {
        "deepseek_v3_dense": dict(
            seed=6000, rope_form="rope_parameters", mtp_block="dense", mtp_embed=False,
            config=lambda: DeepseekV3Config(
                **DS_COMMON, q_lora_rank=32, first_k_dense_replace=4, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
            notes=["All layers dense. first_k_dense_replace is 4 (> num_hidden_layers 3), not 3, so that the MTP layer "
                   "(index 3) is dense under the usual index rule (HF/vLLM build layer i as MoE iff i >= "
                   "first_k_dense_replace; SGLang's NextN always builds MoE, HF's MtpModel forces MoE). Safer: pick the "
                   "MTP block type from the tensors present (mlp.gate.weight => MoE).",
                   "q LoRA path: q_a_proj [32, 64] -> q_a_layernorm [32] -> q_b_proj [96, 64->32]. No rope scaling; "
                   "config in the transformers-5 rope_parameters form.",
                   "MTP layer has no embed_tokens.weight (use the main model's)."],
        ),
        "deepseek_v3_moe": dict(
            seed=7000, rope_form="classic", mtp_block="moe", mtp_embed=True,
            config=lambda: DeepseekV3Config(
                **DS_COMMON, q_lora_rank=None, first_k_dense_replace=1, max_position_embeddings=256,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                                 "mscale": 1.0, "mscale_all_dim": 1.0}),
            notes=["Layer 0 dense, layers 1-2 and the MTP layer MoE (4 routed experts in 2 groups, top-1 group, top-2 "
                   "experts, 1 shared expert).",
                   "No q LoRA (q_lora_rank null): q_proj [96, 64] directly.",
                   "config.json rewritten to the classic DeepSeek-V3 form: rope_theta + rope_scaling {type: yarn, factor "
                   "4, original_max_position_embeddings 64, beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 1}, "
                   "torch_dtype; head_dim/qk_head_dim removed (transformers derives them). max_position_embeddings = "
                   "factor * original (256).",
                   "YaRN (HF _compute_yarn_parameters, dim = qk_rope_head_dim 8): pos_freqs = theta^(2j/8); "
                   "low/high = floor/ceil of d(b) = dim*ln(orig/(b*2*pi))/(2*ln(theta)) for b = beta_fast/beta_slow, "
                   "clamped to [0, dim-1] (here 0 and 2); ramp_j = clamp((j - low)/(high - low), 0, 1) over j < dim/2; "
                   "inv_freq = (1/(factor*pos_freqs))*ramp + (1/pos_freqs)*(1-ramp) = [1, 0.0625, 0.0025, 0.00025]. "
                   "cos/sin are multiplied by attention_factor = mscale(factor, mscale)/mscale(factor, mscale_all_dim) "
                   "= 1 here, with mscale(s, m) = 0.1*m*ln(s) + 1. The softmax scale is 24^-0.5 * "
                   "mscale(factor, mscale_all_dim)^2 = 24^-0.5 * (1 + 0.1*ln 4)^2.",
                   "e_score_correction_bias (model.layers.i.mlp.gate.e_score_correction_bias, float32) is randomised "
                   "non-zero; it changes expert choice but not the weights.",
                   "MTP layer also ships embed_tokens.weight (a copy of model.embed_tokens.weight), as DeepSeek-V3 does."],
        ),
    }


def ds_block_state_for_disk(block, prefix: str) -> dict:
    """State dict of an HF DeepseekV3DecoderLayer in the on-disk (per-expert) naming."""
    out = {}
    for k, v in block.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = v[e, :inter].clone()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = v[e, inter:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = v[e].clone()
        else:
            out[prefix + k] = v.clone()
    return out


def rms(x, w, eps: float):
    import torch

    xf = x.float()
    return w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


def causal_mask(t: int):
    import torch

    m = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)
    return m[None, None]


def mtp_forward(main, block, w: dict, input_ids, h_prev, positions):
    """Our MTP implementation: HF's decoder block, the rest by hand. input_ids/positions [T], h_prev [T, H]."""
    import torch

    eps = main.config.rms_norm_eps
    emb = main.model.embed_tokens.weight[input_ids]
    x = torch.cat([rms(emb, w["enorm.weight"], eps), rms(h_prev, w["hnorm.weight"], eps)], dim=-1)
    x = x @ w["eh_proj.weight"].T
    pos_emb = main.model.rotary_emb(x[None], positions[None])
    y = block(x[None], attention_mask=causal_mask(x.shape[0]), position_ids=positions[None],
              position_embeddings=pos_emb)
    y = y[0] if isinstance(y, tuple) else y
    hidden_out = y[0]
    logits = rms(hidden_out, w["shared_head.norm.weight"], eps) @ w["shared_head.head.weight"].T
    return hidden_out, logits


def mtp_weights(model, gen) -> dict:
    """The MTP layer's own tensors around its decoder block; the head is a copy of the target's."""
    import torch

    return {
        "enorm.weight": 1.0 + 0.1 * torch.randn(HIDDEN, generator=gen),
        "hnorm.weight": 1.0 + 0.1 * torch.randn(HIDDEN, generator=gen),
        "eh_proj.weight": 1.5 / math.sqrt(2 * HIDDEN) * torch.randn(HIDDEN, 2 * HIDDEN, generator=gen),
        "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(HIDDEN, generator=gen),
        "shared_head.head.weight": model.lm_head.weight.detach().clone(),
    }


def mtp_state(model, block, mtp_w: dict, prefix: str, *, embed: bool) -> dict:
    """The MTP layer's tensors as DeepSeek ships them under ``prefix`` (``embed``: with a copy of the
    target's embedding)."""
    state = ds_block_state_for_disk(block, prefix)
    state.update({prefix + k: v.contiguous() for k, v in mtp_w.items()})
    if embed:
        state[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    return state


def read_mtp(path: Path, prefix: str, names, n_experts: int | None) -> tuple[dict, dict]:
    """The MTP layer back from the safetensors file: (its decoder block's state dict, experts fused as
    HF holds them when ``n_experts``; its own tensors ``names``)."""
    import torch
    from safetensors.torch import load_file

    sd = {k[len(prefix):]: v for k, v in load_file(path).items() if k.startswith(prefix)}
    w = {k: sd.pop(k) for k in list(names)}
    sd.pop("embed_tokens.weight", None)
    if n_experts:
        sd["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd.pop(f"mlp.experts.{i}.gate_proj.weight"), sd.pop(f"mlp.experts.{i}.up_proj.weight")])
             for i in range(n_experts)])
        sd["mlp.experts.down_proj"] = torch.stack([sd.pop(f"mlp.experts.{i}.down_proj.weight") for i in range(n_experts)])
    return sd, w


def make_deepseek_case(out: Path, name: str, spec: dict) -> dict:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    for attempt in range(MAX_SEED_TRIES):
        seed = spec["seed"] + attempt
        torch.manual_seed(seed)
        cfg = spec["config"]()
        cfg._attn_implementation = "eager"
        model = DeepseekV3ForCausalLM(cfg).eval()
        gen = torch.Generator().manual_seed(seed)
        reinit_(model, gen)
        n_layers = cfg.num_hidden_layers
        block = DeepseekV3DecoderLayer(cfg, layer_idx=n_layers).eval()
        is_moe_block = type(block.mlp).__name__ == "DeepseekV3MoE"
        assert is_moe_block == (spec["mtp_block"] == "moe")
        reinit_(block, gen)
        mtp_w = mtp_weights(model, gen)
        probe = RoutingProbe(list(model.modules()) + list(block.modules()))
        prompts = make_prompts(seed)
        arrays, margin, greedies = target_goldens(model, prompts)
        # MTP over prompt_0 + greedy_0
        seq = prompts[0] + greedies[0]
        h_final = forward_capture(model, seq)["hidden_final"]  # post-norm main hidden states [len, H]
        mtp_ids = torch.tensor(seq[1:])
        mtp_h = h_final[:-1]
        mtp_pos = torch.arange(len(seq) - 1)
        mtp_hidden_out, mtp_logits = mtp_forward(model, block, mtp_w, mtp_ids, mtp_h, mtp_pos)
        probe.remove()
        routing_margin = probe.min_margin
        if margin >= MIN_MARGIN and routing_margin >= MIN_ROUTING_MARGIN:
            break
    else:
        raise RuntimeError(f"{name}: no seed with the required margins")

    arrays.update({
        "mtp_input_ids": i64(mtp_ids), "mtp_positions": i64(mtp_pos), "mtp_hidden_in": f32(mtp_h),
        "mtp_logits": f32(mtp_logits), "mtp_hidden_out": f32(mtp_hidden_out),
    })
    case_dir = out / name
    model.save_pretrained(case_dir)
    # add the MTP layer to the safetensors file (HF's model does not hold it)
    st_path = case_dir / "model.safetensors"
    state = load_file(st_path)
    pfx = f"model.layers.{n_layers}."
    for k in state:
        assert not k.startswith(pfx)
    # sanity: the on-disk expert naming matches the split we use for the MTP block
    if cfg.first_k_dense_replace < n_layers:
        mem = model.model.layers[n_layers - 1].mlp.experts.gate_up_proj
        inter = mem.shape[1] // 2
        assert torch.equal(state[f"model.layers.{n_layers - 1}.mlp.experts.1.gate_proj.weight"], mem[1, :inter])
        assert torch.equal(state[f"model.layers.{n_layers - 1}.mlp.experts.1.up_proj.weight"], mem[1, inter:])
    state.update(mtp_state(model, block, mtp_w, pfx, embed=spec["mtp_embed"]))
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, st_path, metadata={"format": "pt"})
    if spec["rope_form"] == "classic":
        rewrite_config_classic(case_dir, strip=("head_dim", "qk_head_dim"))
    assert config_rope_form(case_dir) == spec["rope_form"]
    assert json.loads((case_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1

    def extra(m):
        # the reloaded config parses the rope settings the same way
        # (the classic form leaves a redundant legacy "type" key next to "rope_type")
        loaded = {k: v for k, v in m.config.rope_parameters.items() if k != "type"}
        assert loaded == model.config.rope_parameters, (m.config.rope_parameters, model.config.rope_parameters)
        # recompute the MTP golden from the files only (block rebuilt from the safetensors)
        blk = DeepseekV3DecoderLayer(m.config, layer_idx=n_layers).eval()
        sd, w = read_mtp(st_path, pfx, mtp_w, m.config.n_routed_experts if is_moe_block else None)
        blk.load_state_dict(sd, strict=True)
        h2, lg = mtp_forward(m, blk, w, mtp_ids, torch.from_numpy(arrays["mtp_hidden_in"]), mtp_pos)
        assert float((h2 - mtp_hidden_out).abs().max()) <= 1e-5
        assert float((lg - mtp_logits).abs().max()) <= 1e-5
        if is_moe_block:
            hf_mtp_crosscheck(m, case_dir, n_layers, mtp_ids, mtp_h, mtp_pos, mtp_logits)

    check_reload(case_dir, arrays, prompts, extra_check=extra)
    np.savez(case_dir / "golden.npz", **arrays)
    return {
        "name": name, "kind": "target", "dir": name, "dtype": "float32", "atol": ATOL, "rtol": RTOL,
        "architecture": "DeepseekV3ForCausalLM", "model_type": "deepseek_v3", "num_hidden_layers": n_layers,
        "rope_form": spec["rope_form"], "tie_word_embeddings": False, "sharded": False,
        "files": list_files(case_dir), "seed": seed, "prompts": prompts, "greedy_new_tokens": NEW_TOKENS,
        "min_greedy_margin": margin, "eos_token_ids": sorted(eos_ids(model.config)),
        "min_routing_margin": None if math.isinf(routing_margin) else routing_margin,
        "eagle3_aux_layers": eagle3_taps(n_layers),
        "mtp": {"layer_index": n_layers, "block": spec["mtp_block"], "has_embed_tokens": spec["mtp_embed"],
                "source": "prompt_0 + greedy_0", "T": int(mtp_ids.shape[0]), "hidden_in": "post_final_norm",
                "position0_masked": False},
        "keys": golden_keys(len(prompts), with_aux=False)
        + ["mtp_input_ids", "mtp_positions", "mtp_hidden_in", "mtp_logits", "mtp_hidden_out"],
        "notes": spec["notes"] + DS_NOTES_COMMON,
    }


def hf_mtp_crosscheck(main, case_dir, n_layers, ids, h, pos, ref_logits):
    """Independent check with transformers' own MtpModel (it builds the MTP block as MoE, so only the MoE
    case). HF only scans its hard-coded DeepSeek-V3 MTP layer index (61), so point it at ours."""
    from transformers.modeling_layers import MtpModel

    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n_layers}\..*"]
    main.config.name_or_path = str(case_dir)
    mtp = MtpModel.from_pretrained(main).eval()
    hidden = mtp.forward_layer(0, h[None], pos[None], None, input_ids=ids[None])
    logits = mtp._project_to_logits(hidden)[0]
    err = float((logits - ref_logits).abs().max())
    assert err <= 1e-4, f"HF MtpModel disagrees with our MTP by {err}"
    print(f"  HF MtpModel cross-check: max |logits diff| = {err:.2e}")


# ----------------------------------------------------------------------------------------------------
# EAGLE draft heads: our own small PyTorch implementation
# ----------------------------------------------------------------------------------------------------


def rope_cos_sin(positions, head_dim: int, theta: float):
    import torch

    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    ang = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([ang, ang], dim=-1)  # rotate-half layout
    return emb.cos(), emb.sin()


def rotate_half(x):
    import torch

    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def attend(q, k, v, q_pos, k_pos):
    """q [Hq, Tq, D]; k, v [Hkv, Tk, D]; causal by position; GQA (kv head j serves q heads j*rep..)."""
    import torch

    rep = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(rep, dim=0)
    v = v.repeat_interleave(rep, dim=0)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~(k_pos[None, :] <= q_pos[:, None]), float("-inf"))
    return torch.softmax(s.float(), dim=-1) @ v


class DraftCfg:
    def __init__(self, cfg_json: dict):
        self.hidden = cfg_json["hidden_size"]
        self.heads = cfg_json["num_attention_heads"]
        self.kv_heads = cfg_json.get("num_key_value_heads", self.heads)
        self.head_dim = cfg_json.get("head_dim") or self.hidden // self.heads
        self.eps = cfg_json["rms_norm_eps"]
        self.theta = float(cfg_json.get("rope_theta", 10000.0))  # LlamaConfig default when absent


def self_attention(w, p, cfg: DraftCfg, x, positions, past):
    import torch

    t = x.shape[0]
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(t, cfg.heads, cfg.head_dim).transpose(0, 1)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(t, cfg.kv_heads, cfg.head_dim).transpose(0, 1)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, cfg.kv_heads, cfg.head_dim).transpose(0, 1)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.theta)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k_pos = positions
    if past is not None:
        pk, pv, ppos = past
        k, v, k_pos = torch.cat([pk, k], 1), torch.cat([pv, v], 1), torch.cat([ppos, positions])
    a = attend(q, k, v, positions, k_pos).transpose(0, 1).reshape(t, cfg.heads * cfg.head_dim)
    return a @ w[p + "self_attn.o_proj.weight"].T, (k, v, k_pos)


def swiglu(w, p, x):
    import torch.nn.functional as F

    return (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ \
        w[p + "mlp.down_proj.weight"].T


def eagle3_forward(w, p, cfg: DraftCfg, embed, input_ids, hidden, positions, past=None):
    """EAGLE-3 head. hidden: [T, 3H] target aux features (-> fc) or [T, H] own previous output (skips fc)."""
    import torch

    if hidden.shape[-1] != cfg.hidden:
        hidden = hidden @ w["fc.weight"].T
    emb = embed[input_ids]
    x = torch.cat([rms(emb, w[p + "input_layernorm.weight"], cfg.eps),
                   rms(hidden, w[p + "hidden_norm.weight"], cfg.eps)], dim=-1)  # [T, 2H], embedding first
    a, kv = self_attention(w, p, cfg, x, positions, past)
    h = hidden + a  # residual is the (post-fc) hidden
    h = h + swiglu(w, p, rms(h, w[p + "post_attention_layernorm.weight"], cfg.eps))
    logits = rms(h, w["norm.weight"], cfg.eps) @ w["lm_head.weight"].T
    return h, logits, kv


def eagle1_forward(w, cfg: DraftCfg, embed, lm_head, input_ids, feat, positions, past=None):
    """EAGLE-1 head: fc(cat(embed, feature)) (+bias), one Llama layer without input_layernorm, no final norm,
    logits = target lm_head(output)."""
    import torch

    x = torch.cat([embed[input_ids], feat], dim=-1) @ w["fc.weight"].T
    if "fc.bias" in w:
        x = x + w["fc.bias"]
    a, kv = self_attention(w, "layers.0.", cfg, x, positions, past)
    h = x + a
    h = h + swiglu(w, "layers.0.", rms(h, w["layers.0.post_attention_layernorm.weight"], cfg.eps))
    return h, h @ lm_head.T, kv


def random_linear(gen, out_f, in_f, gain=1.5):
    import torch

    return gain / math.sqrt(in_f) * torch.randn(out_f, in_f, generator=gen)


def random_norm(gen, n):
    import torch

    return 1.0 + 0.1 * torch.randn(n, generator=gen)


def llama_layer_weights(gen, p, cfg: DraftCfg, in_dim, input_norm: bool):
    hd = cfg.head_dim
    w = {
        p + "self_attn.q_proj.weight": random_linear(gen, cfg.heads * hd, in_dim),
        p + "self_attn.k_proj.weight": random_linear(gen, cfg.kv_heads * hd, in_dim),
        p + "self_attn.v_proj.weight": random_linear(gen, cfg.kv_heads * hd, in_dim),
        p + "self_attn.o_proj.weight": random_linear(gen, cfg.hidden, cfg.heads * hd),
        p + "post_attention_layernorm.weight": random_norm(gen, cfg.hidden),
        p + "mlp.gate_proj.weight": random_linear(gen, INTER, cfg.hidden),
        p + "mlp.up_proj.weight": random_linear(gen, INTER, cfg.hidden),
        p + "mlp.down_proj.weight": random_linear(gen, cfg.hidden, INTER),
    }
    if input_norm:
        w[p + "input_layernorm.weight"] = random_norm(gen, cfg.hidden)
        w[p + "hidden_norm.weight"] = random_norm(gen, cfg.hidden)
    return w


def eagle_config_json(architectures, *, draft_vocab=None, rope_theta=None, extra=None) -> dict:
    import transformers

    cfg = {
        "architectures": architectures, "model_type": "llama", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": INTER,
        "max_position_embeddings": 2048, "num_attention_heads": 4, "num_hidden_layers": 1,
        "num_key_value_heads": 2, "pad_token_id": 0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "torch_dtype": "float32", "transformers_version": transformers.__version__, "use_cache": True,
        "vocab_size": VOCAB,
    }
    if draft_vocab is not None:
        cfg["draft_vocab_size"] = draft_vocab
    if rope_theta is not None:
        cfg["rope_theta"] = rope_theta
    cfg.update(extra or {})
    return dict(sorted(cfg.items()))


def write_head(case_dir: Path, cfg_json: dict, tensors: dict) -> dict:
    from safetensors.torch import load_file, save_file

    case_dir.mkdir(parents=True)
    (case_dir / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, case_dir / "model.safetensors",
              metadata={"format": "pt"})
    return load_file(case_dir / "model.safetensors")  # compute goldens from what is on disk


def hf_check_rope_attention(cfg: DraftCfg, w, p, x, positions):
    """Cross-check our RoPE + GQA attention (2H-wide input for EAGLE-3) against transformers' LlamaAttention."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    in_dim = x.shape[-1]
    hcfg = LlamaConfig(hidden_size=in_dim, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                       head_dim=cfg.head_dim, vocab_size=VOCAB, intermediate_size=INTER,
                       rope_parameters={"rope_type": "default", "rope_theta": cfg.theta})
    hcfg._attn_implementation = "eager"
    attn = LlamaAttention(hcfg, layer_idx=0).eval()
    o = w[p + "self_attn.o_proj.weight"]
    pad = torch.zeros(in_dim - o.shape[0], o.shape[1])
    attn.load_state_dict({
        "q_proj.weight": w[p + "self_attn.q_proj.weight"], "k_proj.weight": w[p + "self_attn.k_proj.weight"],
        "v_proj.weight": w[p + "self_attn.v_proj.weight"], "o_proj.weight": torch.cat([o, pad])})
    pe = LlamaRotaryEmbedding(hcfg)(x[None], positions[None])
    ref = attn(x[None], position_embeddings=pe, attention_mask=causal_mask(x.shape[0]))[0][0, :, : o.shape[0]]
    ours, _ = self_attention(w, p, cfg, x, positions, None)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def make_eagle3_case(out: Path, name: str, target_dir: Path, *, layout: str, seed: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    p = "midlayer." if layout == "midlayer" else "layers.0."
    if layout == "midlayer":
        cfg_json = eagle_config_json(["LlamaForCausalLM"], draft_vocab=96)
        draft_vocab = 96
    else:
        cfg_json = eagle_config_json(["LlamaForCausalLMEagle3"], draft_vocab=VOCAB, rope_theta=500000.0)
        draft_vocab = VOCAB
    cfg = DraftCfg(cfg_json)
    t = {"fc.weight": random_linear(gen, HIDDEN, 3 * HIDDEN)}
    t.update(llama_layer_weights(gen, p, cfg, 2 * HIDDEN, input_norm=True))
    t["norm.weight"] = random_norm(gen, HIDDEN)
    t["lm_head.weight"] = 0.5 * torch.randn(draft_vocab, HIDDEN, generator=gen)
    if draft_vocab < VOCAB:
        ids = torch.sort(torch.randperm(VOCAB, generator=gen)[:draft_vocab]).values
        t["d2t"] = (ids - torch.arange(draft_vocab)).to(torch.int64)
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[ids] = True
        t["t2d"] = t2d
    if layout != "midlayer":
        t["embed_tokens.weight"] = 0.5 * torch.randn(VOCAB, HIDDEN, generator=gen)  # its own, != target's
    case_dir = out / name
    w = write_head(case_dir, cfg_json, t)
    target_embed = load_target_tensor(target_dir, "model.embed_tokens.weight")
    embed = w.get("embed_tokens.weight", target_embed)
    if "embed_tokens.weight" in w:
        assert not torch.allclose(embed, target_embed)

    input_ids = torch.randint(0, VOCAB, (HEAD_T,), generator=gen)
    hidden_in = 1.5 * torch.randn(HEAD_T, 3 * HIDDEN, generator=gen)
    positions = torch.arange(HEAD_T)
    h_out, logits, kv = eagle3_forward(w, p, cfg, embed, input_ids, hidden_in, positions)
    # recurrent step: position T, token = target id of the draft argmax at T-1, hidden = h'[T-1] (skips fc)
    top = int(torch.argmax(logits[-1]))
    next_id = top + int(w["d2t"][top]) if "d2t" in w else top
    if "t2d" in w:
        assert bool(w["t2d"][next_id])
    next_pos = torch.tensor([HEAD_T])
    nh, nl, _ = eagle3_forward(w, p, cfg, embed, torch.tensor([next_id]), h_out[-1:], next_pos, past=kv)

    # consistency checks
    fc_h = hidden_in @ w["fc.weight"].T
    hf_check_rope_attention(cfg, w, p, torch.cat([rms(embed[input_ids], w[p + "input_layernorm.weight"], cfg.eps),
                                                  rms(fc_h, w[p + "hidden_norm.weight"], cfg.eps)], -1), positions)
    full_h, full_l, _ = eagle3_forward(w, p, cfg, embed, torch.cat([input_ids, torch.tensor([next_id])]),
                                       torch.cat([fc_h, h_out[-1:]]), torch.arange(HEAD_T + 1))
    torch.testing.assert_close(full_h[-1:], nh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full_l[-1:], nl, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full_h[:-1], h_out, rtol=1e-5, atol=1e-5)

    arrays = {"input_ids": i64(input_ids), "hidden_in": f32(hidden_in), "positions": i64(positions),
              "hidden_out": f32(h_out), "logits": f32(logits), "next_id": i64(next_id),
              "next_position": i64(HEAD_T), "next_logits": f32(nl[0]), "next_hidden_out": f32(nh[0])}
    np.savez(case_dir / "golden.npz", **arrays)
    return {
        "name": name, "kind": "eagle3", "dir": name, "dtype": "float32", "atol": ATOL, "rtol": RTOL,
        "target": "llama3", "layout": layout, "architecture": cfg_json["architectures"][0],
        "draft_vocab_size": draft_vocab, "has_d2t": "d2t" in w, "uses_own_embedding": "embed_tokens.weight" in w,
        "rope_theta_effective": cfg.theta, "T": HEAD_T, "seed": seed, "files": list_files(case_dir),
        "keys": sorted(arrays),
        "notes": ([
            "Official SafeAILab EAGLE-3 layout: midlayer.*, d2t/t2d, no rope_theta in config.json (10000 applies), "
            "no embed_tokens (use the llama3 target's model.embed_tokens.weight). logits are over the 96-token "
            "draft vocab, before d2t: target_id = draft_id + d2t[draft_id]."]
            if layout == "midlayer" else [
            "SpecForge/vLLM-speculators style naming layers.0.*, architectures LlamaForCausalLMEagle3, "
            "draft_vocab_size == vocab_size (no d2t/t2d), rope_theta 500000, ships its OWN embed_tokens.weight "
            "(random, different from the target's): the golden uses it."]) + [
            "h = fc(hidden_in) (3H -> H, no bias); x = cat(input_layernorm(embed(ids)), hidden_norm(h)); "
            "q/k/v_proj on the 2H-wide x; RoPE rotate-half over positions; causal GQA attention; "
            "h1 = h + o_proj(attn); hidden_out = h1 + mlp(post_attention_layernorm(h1)); "
            "logits = lm_head(norm(hidden_out)).",
            "Recurrent step: position T (= next_position) with token next_id (target id of argmax logits[T-1]) "
            "and hidden = hidden_out[T-1] (H wide, skips fc), attending to the K/V of positions 0..T."],
    }


def load_target_tensor(target_dir: Path, name: str):
    from safetensors import safe_open

    for path in sorted(target_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise KeyError(name)


def make_eagle1_case(out: Path, name: str, target_dir: Path, *, seed: int) -> dict:
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    gen = torch.Generator().manual_seed(seed)
    cfg_json = eagle_config_json(["LlamaForCausalLM"], rope_theta=500000.0,
                                 extra={"bias": True, "attention_bias": False, "mlp_bias": False})
    cfg = DraftCfg(cfg_json)
    target_embed = load_target_tensor(target_dir, "model.embed_tokens.weight")
    lm_head = load_target_tensor(target_dir, "lm_head.weight")
    t = {"fc.weight": random_linear(gen, HIDDEN, 2 * HIDDEN), "fc.bias": 0.2 * torch.randn(HIDDEN, generator=gen),
         "embed_tokens.weight": target_embed.clone()}
    t.update(llama_layer_weights(gen, "layers.0.", cfg, HIDDEN, input_norm=False))
    case_dir = out / name
    w = write_head(case_dir, cfg_json, t)
    embed = w["embed_tokens.weight"]

    input_ids = torch.randint(0, VOCAB, (HEAD_T,), generator=gen)
    hidden_in = torch.randn(HEAD_T, HIDDEN, generator=gen)
    positions = torch.arange(HEAD_T)
    h_out, logits, kv = eagle1_forward(w, cfg, embed, lm_head, input_ids, hidden_in, positions)
    next_id = int(torch.argmax(logits[-1]))
    nh, nl, _ = eagle1_forward(w, cfg, embed, lm_head, torch.tensor([next_id]), h_out[-1:],
                               torch.tensor([HEAD_T]), past=kv)

    # cross-check against transformers' LlamaDecoderLayer with input_layernorm replaced by identity
    hcfg = LlamaConfig(**{k: v for k, v in cfg_json.items() if k not in ("architectures", "bias", "torch_dtype",
                                                                          "transformers_version")})
    hcfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(hcfg, layer_idx=0).eval()
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")}, strict=True)
    x = torch.cat([embed[input_ids], hidden_in], -1) @ w["fc.weight"].T + w["fc.bias"]
    pe = LlamaRotaryEmbedding(hcfg)(x[None], positions[None])
    ref = layer(x[None], attention_mask=causal_mask(HEAD_T), position_embeddings=pe, position_ids=positions[None])
    ref = ref[0] if isinstance(ref, tuple) else ref
    torch.testing.assert_close(ref[0], h_out, rtol=1e-5, atol=1e-5)
    full_h, full_l, _ = eagle1_forward(w, cfg, embed, lm_head, torch.cat([input_ids, torch.tensor([next_id])]),
                                       torch.cat([hidden_in, h_out[-1:]]), torch.arange(HEAD_T + 1))
    torch.testing.assert_close(full_h[-1:], nh, rtol=1e-5, atol=1e-5)

    arrays = {"input_ids": i64(input_ids), "hidden_in": f32(hidden_in), "positions": i64(positions),
              "hidden_out": f32(h_out), "logits": f32(logits), "next_id": i64(next_id),
              "next_position": i64(HEAD_T), "next_logits": f32(nl[0]), "next_hidden_out": f32(nh[0])}
    np.savez(case_dir / "golden.npz", **arrays)
    return {
        "name": name, "kind": "eagle1", "dir": name, "dtype": "float32", "atol": ATOL, "rtol": RTOL,
        "target": "llama3", "layout": "layers.0", "architecture": "LlamaForCausalLM", "draft_vocab_size": VOCAB,
        "has_d2t": False, "uses_own_embedding": True, "rope_theta_effective": cfg.theta, "T": HEAD_T,
        "seed": seed, "files": list_files(case_dir), "keys": sorted(arrays),
        "notes": [
            "SafeAILab EAGLE-1 layout (saved as safetensors here; the real ones are pytorch_model.bin). "
            "config.json is a plain classic LlamaConfig with num_hidden_layers 1, \"bias\": true (fc has a bias), "
            "rope_theta 500000 and no rope scaling (the draft's own RoPE, not the llama3 target's scaled one).",
            "hidden_in plays the target's final-normed feature f_i; x = fc(cat(embed(ids), f)) + fc.bias "
            "(embedding first); one Llama layer with NO input_layernorm; no final norm; hidden_out is the layer "
            "output; logits = llama3 target lm_head.weight @ hidden_out. embed_tokens.weight is a copy of the "
            "target's.",
            "Recurrent step: position T with token next_id = argmax logits[T-1] and feature hidden_out[T-1]."],
    }


# ----------------------------------------------------------------------------------------------------


def main() -> None:
    ap = arguments(__doc__, out=GOLDEN)
    ap.add_argument("--cases", help="comma-separated target cases to (re)build alone; the others stay as they are")
    args = ap.parse_args()
    if args.cases and (unknown := set(args.cases.split(",")) - set(TARGET_NAMES)):
        ap.error(f"--cases takes Llama-family target cases ({', '.join(TARGET_NAMES)}); got {sorted(unknown)}")
    start()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    specs = targets()
    if args.cases:
        cases = []
        for name in args.cases.split(","):
            shutil.rmtree(out / name, ignore_errors=True)
            cases.append(make_target_case(out, name, specs[name]))
            print(f"{name}: seed {cases[-1]['seed']}, min greedy margin {cases[-1]['min_greedy_margin']:.4f}")
        write_manifest(out, cases, __file__)
        return
    names = list(TARGET_NAMES) + list(DS_NAMES) + ["eagle3_midlayer", "eagle3_layers0", "eagle1"]
    for n in names:
        if (out / n).exists():
            shutil.rmtree(out / n)

    cases = []
    for name, spec in specs.items():
        cases.append(make_target_case(out, name, spec))
        print(f"{name}: seed {cases[-1]['seed']}, min greedy margin {cases[-1]['min_greedy_margin']:.4f}")
    for name, spec in ds_cases().items():
        cases.append(make_deepseek_case(out, name, spec))
        print(f"{name}: seed {cases[-1]['seed']}, min greedy margin {cases[-1]['min_greedy_margin']:.4f}, "
              f"min routing margin {cases[-1]['min_routing_margin']}")
    target_dir = out / "llama3"
    cases.append(make_eagle3_case(out, "eagle3_midlayer", target_dir, layout="midlayer", seed=8000))
    cases.append(make_eagle3_case(out, "eagle3_layers0", target_dir, layout="layers.0", seed=8100))
    cases.append(make_eagle1_case(out, "eagle1", target_dir, seed=9000))
    write_manifest(out, cases, __file__)


if __name__ == "__main__":
    main()
