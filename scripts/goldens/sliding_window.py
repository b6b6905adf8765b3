#!/usr/bin/env python
"""Build tiny random Gemma 4 (and sliding-window Mistral) checkpoints with HF transformers and record
reference outputs in tests/data/golden/sliding_window/ (its own manifest.json; see its README.md).

NOT run in CI: it needs torch + transformers (the committed files were made with torch 2.13.0 CPU and
transformers 5.23.0, as for scripts/goldens/targets.py, whose helpers it reuses):

    VENV/bin/python scripts/goldens/sliding_window.py

Cases:
  gemma4_text        Gemma4ForCausalLM: layers [S, S, F] x 2, window 6, sliding head_dim 16 / 2 KV heads,
                     full head_dim 32 / 1 KV head with attention_k_eq_v, final_logit_softcapping 30, tied;
                     config in the transformers-5 form (per_layer_config). Prompts longer than the window.
  gemma4_condgen     Gemma4ForConditionalGeneration (tiny vision tower, no audio): text layers [S, F] x 2,
                     window 5, full head_dim 32 with the sliding layers' 2 KV heads (no k_eq_v), no softcap;
                     config.json rewritten to the published form (text_config.global_head_dim, no
                     per_layer_config). Goldens: text-only logits / greedy tokens.
  gemma4_moe         Gemma4ForCausalLM with MoE blocks (the 26B-A4B kind): layers [S, F] x 2, window 6, every layer
                     a dense MLP plus 8 experts (top 2, moe_intermediate_size 32), untied head; router scale and
                     per-expert scales random. Seeds searched for a routing gap >= 1e-4 too.
  gemma4_ple         Gemma4ForCausalLM of the E2B / E4B kind: layers [S, S, F, S, S, F], window 6, per-layer inputs
                     (hidden_size_per_layer_input 8 over the whole vocabulary), the last 2 layers sharing K/V
                     (num_kv_shared_layers 2: layer 4 reads layer 3's, layer 5 layer 2's) with double-wide MLPs.
  gemma4_assistant   Gemma4AssistantForCausalLM for gemma4_text, layers [S, F], ordered-embeddings head
                     (16 centroids, top 4); goldens: 4 draft steps per prompt given the target's KV.
  gemma4_assistant_plain   the same without ordered embeddings (plain tied lm_head), layers [S, S, F].
  gemma4_ple_assistant     a plain-head assistant for gemma4_ple, layers [S, F]: it reads the K/V of the target's
                     "store" layers (3 and 2, the last of each type before the K/V-sharing layers).
  mistral_swa        MistralForCausalLM with sliding_window 6 (2 layers): logits / greedy tokens.

transformers 5.23.0 cannot build an assistant, nor make a target without KV sharing publish the K/V an
assistant reads (Gemma4TextConfig.kv_sharing_modes). This script patches that property (test harness only):
every layer "reuse" when all layers are shared (the assistant), else, with no sharing, "store" on the last
layer of each layer type (publishes K/V, changes no numerics).
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from scripts.goldens.common import (  # noqa: E402
    GOLDEN, MAX_SEED_TRIES, MIN_DISTINCT, MIN_MARGIN, NEW_TOKENS, VOCAB, arguments, eos_ids, f32, forward_capture,
    greedy, i64, list_files, make_prompts, no_grad, reinit_, start, text_model, write_manifest,
)

DEFAULT_OUT = GOLDEN / "sliding_window"
ATOL = 2e-4
RTOL = 2e-4
# Gemma 4's sandwich norms renormalize every branch output, which amplifies float32 rounding: an
# independent float32 implementation lands within ~2e-4 of HF on hidden states of values up to ~7.
GEMMA_ATOL = GEMMA_RTOL = 5e-4
DRAFT_STEPS = 4
MIN_GEMMA_MARGIN = 1e-2  # smallest top-1 minus top-2 logit gap over every recorded greedy step
S, F = "sliding_attention", "full_attention"
# gemma4_moe: smallest gap between the k-th and (k+1)-th router probability (f32 rounding is about 1e-7), and
# the factor on router.proj's draw that makes the router logits about unit size.
MIN_MOE_ROUTING_GAP = 1e-4
ROUTER_GAIN = 8.0

# ---------------------------------------------------------------------------------------------- HF patch


@functools.cache
def patch_kv_sharing() -> None:
    """transformers 5.23.0's Gemma4TextConfig.kv_sharing_modes, patched once (module docstring): every
    layer "reuse" when all layers are shared, "store" on the last layer of each type when none is."""
    from transformers.models.gemma4 import configuration_gemma4

    original = configuration_gemma4.Gemma4TextConfig.kv_sharing_modes

    def kv_sharing_modes(self):
        n, shared = self.num_hidden_layers, self.num_kv_shared_layers or 0
        if shared == n:
            return ["reuse"] * n
        if shared == 0:
            modes = [None] * n
            for t in set(self.layer_types):
                modes[max(i for i, lt in enumerate(self.layer_types) if lt == t)] = "store"
            return modes
        return original.fget(self)

    configuration_gemma4.Gemma4TextConfig.kv_sharing_modes = property(kv_sharing_modes)

# ---------------------------------------------------------------------------------------------- helpers


@no_grad
def gemma_reinit_(model, gen) -> None:
    """Random weights that tell w from (1 + w) and exercise layer_scalar: every 1-D float tensor (norms,
    layer_scalar) 1 + 0.3 N(0, 1), the final norm 3 (1 + 0.3 N); embeddings 0.05 N; other matrices
    N(0, 1) / sqrt(fan_in) (an MoE router's times ROUTER_GAIN). With a tied head, small embeddings keep
    the residual stream from echoing the input token (greedy would repeat it) and the larger final
    norm keeps the logits peaky."""
    import torch


    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    tensors = dict(model.named_parameters())
    tensors.update({k: b for k, b in model.named_buffers() if k.endswith("layer_scalar")})
    for name, p in tensors.items():
        if name.endswith("model.norm.weight") or name.endswith("language_model.norm.weight"):
            new = 3.0 * (1.0 + 0.3 * randn(p.shape))
        elif p.ndim == 1 or name.endswith("layer_scalar"):
            new = 1.0 + 0.3 * randn(p.shape)
        elif name.endswith("embed_tokens.weight"):
            new = 0.05 * randn(p.shape)
        elif p.ndim >= 2:
            new = randn(p.shape) / math.sqrt(p.shape[-1])
        else:
            raise ValueError(f"no init rule for {name} {tuple(p.shape)}")
        if name.endswith("router.proj.weight"):  # MoE router logits of about unit size: decisions away from ties
            new = new * ROUTER_GAIN
        p.copy_(new.to(p.dtype))


def gemma_capture(model, prompt: list[int]) -> dict:
    """No-cache forward: logits, and the final-normed hidden state (checked against the norm's output and
    the logits: softcap(lm_head(hidden)))."""
    import torch

    ids = torch.tensor([prompt])
    tm = text_model(model)
    seen = {}
    hook = tm.norm.register_forward_hook(lambda mod, inp, out: seen.setdefault("out", out.detach().clone()))
    out = model(input_ids=ids, output_hidden_states=True)
    hook.remove()
    hidden = seen["out"][0]
    cap = tm.config.final_logit_softcapping
    logits = hidden @ tm.embed_tokens.weight.T if model.config.get_text_config().tie_word_embeddings else \
        model.lm_head(hidden)
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    torch.testing.assert_close(logits, out.logits[0], rtol=0, atol=1e-5)
    return {"logits": out.logits[0], "hidden_final": hidden}


def goldens(model, prompts, capture, greedy_fn, *, final: bool = True,
            min_margin: float = MIN_MARGIN) -> tuple[dict[str, np.ndarray], float]:
    """Goldens for every prompt, longest first; while searching (``final`` False) it stops at the first
    prompt that misses the margin and skips the HF generate() cross-check."""
    arrays, margin = {}, float("inf")
    for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):
        p = prompts[i]
        cap = capture(model, p)
        toks, m = greedy_fn(model, p, NEW_TOKENS, check_generate=final)
        if len(set(toks)) < MIN_DISTINCT or eos_ids(model.config.get_text_config()) & set(toks):
            m = float("-inf")
        margin = min(margin, m)
        if not final and margin < min_margin:
            return arrays, margin
        arrays[f"prompt_{i}"] = i64(p)
        arrays[f"logits_{i}"] = f32(cap["logits"])
        arrays[f"greedy_{i}"] = i64(toks)
        arrays[f"hidden_final_{i}"] = f32(cap["hidden_final"])
    return arrays, margin


def check_reload(cls, case_dir: Path, arrays, prompts, capture, atol: float = 0.0) -> None:
    """The saved checkpoint reloaded reproduces the goldens (bit for bit unless ``atol``)."""
    import torch

    m = cls.from_pretrained(case_dir, dtype=torch.float32, attn_implementation="eager").eval()
    for i, p in enumerate(prompts):
        cap = capture(m, p)
        for key in ("logits", "hidden_final"):
            err = float(np.abs(f32(cap[key]) - arrays[f"{key}_{i}"]).max())
            assert err <= atol, f"{case_dir.name}: reloaded {key}_{i} differs by {err}"


def search(build, prompts_for, capture, greedy_fn, seed0: int, min_margin: float = MIN_GEMMA_MARGIN):
    for attempt in range(MAX_SEED_TRIES):
        seed = seed0 + attempt
        model = build(seed)
        prompts = prompts_for(seed)
        _, margin = goldens(model, prompts, capture, greedy_fn, final=False, min_margin=min_margin)
        print(f"  seed {seed}: margin {margin:.4f}", flush=True)
        if margin >= min_margin:
            arrays, margin = goldens(model, prompts, capture, greedy_fn)
            return seed, model, prompts, arrays, margin
    raise RuntimeError("no seed with the required greedy margin")


def searched_case(out: Path, name: str, cls, build, seed0: int, *, capture=None, greedy_fn=None,
                  min_margin: float = MIN_GEMMA_MARGIN, after_save=None):
    """``search``, then the model saved under ``out/name`` (``after_save(case_dir)`` may rewrite
    it), reloaded with ``cls`` to check the goldens, and the goldens written: (seed, model,
    prompts, arrays, margin)."""
    capture, greedy_fn = capture or gemma_capture, greedy_fn or greedy
    seed, model, prompts, arrays, margin = search(build, longer_prompts, capture, greedy_fn, seed0, min_margin)
    case_dir = out / name
    model.save_pretrained(case_dir)
    if after_save is not None:
        after_save(case_dir)
    check_reload(cls, case_dir, arrays, prompts, capture)
    np.savez(case_dir / "golden.npz", **arrays)
    return seed, model, prompts, arrays, margin


def base_case(name, model, seed, prompts, margin, notes, **extra) -> dict:
    tc = model.config.get_text_config()
    gemma = name.startswith("gemma4")
    return {
        "name": name, "kind": "target", "dir": name, "dtype": "float32", "atol": GEMMA_ATOL if gemma else ATOL,
        "rtol": GEMMA_RTOL if gemma else RTOL,
        "architecture": type(model).__name__, "model_type": model.config.model_type,
        "num_hidden_layers": tc.num_hidden_layers, "sliding_window": tc.sliding_window,
        "layer_types": list(getattr(tc, "layer_types", None) or []),
        "tie_word_embeddings": bool(tc.tie_word_embeddings), "seed": seed, "prompts": prompts,
        "greedy_new_tokens": NEW_TOKENS, "min_greedy_margin": margin, "eos_token_ids": sorted(eos_ids(tc)),
        "keys": [f"{k}_{i}" for i in range(len(prompts)) for k in ("prompt", "logits", "greedy", "hidden_final")],
        "notes": notes, **extra,
    }


def longer_prompts(seed: int) -> list[list[int]]:
    """make_prompts' lengths (5, 11, 17): two of them longer than every window here."""
    return make_prompts(seed)


# ---------------------------------------------------------------------------------------------- targets

GEMMA_TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
    layer_types=[S, S, F, S, S, F], sliding_window=6, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
    final_logit_softcapping=30.0, max_position_embeddings=512,
)


def build_gemma(fields: dict, seed: int):
    """A ``Gemma4ForCausalLM`` of the config ``fields`` with the goldens' weight draws."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    cfg = Gemma4TextConfig(**fields)
    cfg._attn_implementation = "eager"
    model = Gemma4ForCausalLM(cfg).eval()
    gemma_reinit_(model, torch.Generator().manual_seed(seed))
    return model


build_gemma_text = functools.partial(build_gemma, GEMMA_TEXT)


def make_gemma_text(out: Path) -> tuple[dict, object]:
    from transformers import AutoModelForCausalLM

    def transformers_5_form(case_dir: Path) -> None:
        raw = json.loads((case_dir / "config.json").read_text())
        assert "per_layer_config" in raw and "global_head_dim" not in raw

    seed, model, prompts, arrays, margin = searched_case(out, "gemma4_text", AutoModelForCausalLM, build_gemma_text,
                                                         11000, after_save=transformers_5_form)
    notes = [
        "Layers [S, S, F, S, S, F] (S = sliding_attention, F = full_attention); sliding_window 6: a query at "
        "position p sees keys p-5..p.",
        "Sliding layers: head_dim 16, 2 KV heads, RoPE default theta 1e4. Full layers: head_dim 32, 1 KV head "
        "(num_global_key_value_heads, applied because attention_k_eq_v), no v_proj (V = v_norm(raw k_proj)), "
        "proportional RoPE theta 1e6 with partial_rotary_factor 0.25 (4 of 16 frequencies rotate).",
        "config.json in the transformers-5 form: per_layer_config {'2': {head_dim 32, num_key_value_heads 1}, "
        "'5': ...}, no global_head_dim.",
        "Attention scale 1.0; q_norm/k_norm (weights) and a weightless v_norm; norms are x * w (not 1 + w); "
        "sandwich norms; GELU-tanh gated MLP; layer_scalar (random, not 1) multiplies the residual after each layer.",
        "Embedding scaled by sqrt(64) = 8; tied head; final_logit_softcapping 30: logits = 30 tanh(h.E / 30).",
        "Weights: every 1-D tensor (norms, layer_scalar) 1 + 0.3 N(0, 1) except the final norm, 3 (1 + 0.3 N); "
        "embeddings 0.05 N; other matrices N(0, 1) / sqrt(fan_in). Seeds searched for a greedy top-1 minus top-2 "
        "margin >= 1e-2 over every step.",
    ]
    return base_case("gemma4_text", model, seed, prompts, margin, notes, config_form="per_layer_config"), model


GEMMA_MOE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=32, layer_types=[S, F, S, F], sliding_window=6,
    hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=30.0,
    max_position_embeddings=512, tie_word_embeddings=False, enable_moe_block=True, num_experts=8, top_k_experts=2,
    moe_intermediate_size=32,
)


build_gemma_moe = functools.partial(build_gemma, GEMMA_MOE)


def routing_gap(model, sequences) -> float:
    """Smallest gap between the k-th and (k+1)-th router probability over every token of ``sequences``
    (prompt + greedy tokens, one no-cache forward each) and every layer: how far each routing decision
    is from a tie."""
    import torch

    gaps = []
    k = model.config.get_text_config().top_k_experts

    def hook(mod, inp, out):
        top = torch.topk(out[0].float(), k + 1, dim=-1).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    handles = [layer.router.register_forward_hook(hook) for layer in text_model(model).layers]
    for seq in sequences:
        model(input_ids=torch.tensor([seq]))
    for h in handles:
        h.remove()
    return min(gaps)


def make_gemma_moe(out: Path) -> dict:
    from transformers import AutoModelForCausalLM

    for attempt in range(MAX_SEED_TRIES):
        seed = 16000 + attempt
        model, prompts = build_gemma_moe(seed), longer_prompts(seed)
        arrays, margin = goldens(model, prompts, gemma_capture, greedy, final=False, min_margin=MIN_GEMMA_MARGIN)
        if margin < MIN_GEMMA_MARGIN:  # stopped at the first prompt below the margin
            print(f"  seed {seed}: margin {margin:.4f}", flush=True)
            continue
        routing = routing_gap(model, [arrays[f"prompt_{i}"].tolist() + arrays[f"greedy_{i}"].tolist()
                                      for i in range(len(prompts))])
        print(f"  seed {seed}: margin {margin:.4f}, routing gap {routing:.2e}", flush=True)
        if margin >= MIN_GEMMA_MARGIN and routing >= MIN_MOE_ROUTING_GAP:
            arrays, margin = goldens(model, prompts, gemma_capture, greedy)
            break
    else:
        raise RuntimeError("no seed with the required greedy margin and routing gap")
    case_dir = out / "gemma4_moe"
    model.save_pretrained(case_dir)
    # Reloaded, transformers runs the experts through another implementation (summed in another order).
    check_reload(AutoModelForCausalLM, case_dir, arrays, prompts, gemma_capture, atol=5e-5)
    np.savez(case_dir / "golden.npz", **arrays)
    notes = [
        "Layers [S, F, S, F], window 6; sliding head_dim 16 / 2 KV heads, full head_dim 32 / 2 KV heads with v_proj.",
        "Every layer (enable_moe_block): m1 = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(x))); the "
        "router reads the residual x: r = rms(x) * router.scale / sqrt(H) (rms without weight), probabilities "
        "softmax(r @ router.proj) in f32, the top 2 renormalized to sum 1, then times router.per_expert_scale; "
        "m2 = post_feedforward_layernorm_2(sum_k w_k expert_k(pre_feedforward_layernorm_2(x))), each expert "
        "down(gelu_tanh(gate) * up) from experts.gate_up_proj [E, 2I, H] (gate rows first) and experts.down_proj "
        "[E, H, I]; x = x + post_feedforward_layernorm(m1 + m2).",
        "Untied lm_head; softcap 30. Weights as gemma4_text's (1-D tensors, router scales included, 1 + 0.3 N).",
        f"Smallest gap between the 2nd and 3rd router probability over every prompt + greedy token and layer: "
        f"{routing:.3e} (>= {MIN_MOE_ROUTING_GAP}). router.proj drawn as the other matrices, then times "
        f"{ROUTER_GAIN} (router logits of about unit size).",
    ]
    return base_case("gemma4_moe", model, seed, prompts, margin, notes, config_form="per_layer_config",
                     min_routing_gap=routing)


GEMMA_PLE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=32, layer_types=[S, S, F, S, S, F], sliding_window=6,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2, use_double_wide_mlp=True,
    final_logit_softcapping=30.0, max_position_embeddings=512,
)


build_gemma_ple = functools.partial(build_gemma, GEMMA_PLE)


def make_gemma_ple(out: Path) -> dict:
    from transformers import AutoModelForCausalLM

    seed, model, prompts, arrays, margin = searched_case(out, "gemma4_ple", AutoModelForCausalLM, build_gemma_ple,
                                                         17000)
    notes = [
        "The E2B / E4B kind. Layers [S, S, F, S, S, F], window 6; sliding head_dim 16 / 2 KV heads, full head_dim "
        "32 / 2 KV heads with v_proj; tied head, softcap 30.",
        "Per-layer inputs (hidden_size_per_layer_input 8, vocab_size_per_layer_input 256): e = "
        "(per_layer_projection_norm(reshape(per_layer_model_projection(x0) * 64^-0.5, [6, 8])) + "
        "reshape(embed_tokens_per_layer[token] * sqrt(8), [6, 8])) * 2^-0.5, x0 the scaled token embedding; each "
        "layer after its MLP residual: x = x + post_per_layer_input_norm(per_layer_projection(gelu_tanh("
        "per_layer_input_gate(x)) * e[layer])), then times layer_scalar.",
        "num_kv_shared_layers 2: layers 4 (sliding) and 5 (full) have no k_proj / v_proj / k_norm and attend over "
        "the K/V of the last earlier layer of their type (3 and 2: HF's 'store' layers); their MLPs are "
        "double-wide (use_double_wide_mlp: intermediate 128 against 64).",
        "Weights as gemma4_text's (embed_tokens_per_layer and the projections as other matrices, N(0, 1) / "
        "sqrt(fan_in)).",
    ]
    return base_case("gemma4_ple", model, seed, prompts, margin, notes, config_form="per_layer_config")


def build_condgen(seed: int):
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, attention_k_eq_v=False,
                layer_types=[S, F, S, F], sliding_window=5, hidden_size_per_layer_input=0,
                vocab_size_per_layer_input=0, max_position_embeddings=512)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, position_embedding_size=64)
    cfg = Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    model = Gemma4ForConditionalGeneration(cfg).eval()
    gemma_reinit_(model, torch.Generator().manual_seed(seed))
    return model


def rewrite_published_form(case_dir: Path) -> None:
    """Google's published checkpoints carry text_config.global_head_dim (and num_global_key_value_heads)
    instead of per_layer_config."""
    path = case_dir / "config.json"
    raw = json.loads(path.read_text())
    tc = raw["text_config"]
    plc = tc.pop("per_layer_config")
    dims = {v["head_dim"] for v in plc.values()}
    assert len(dims) == 1 and all(set(v) == {"head_dim"} for v in plc.values()), plc
    tc["global_head_dim"] = dims.pop()
    path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def make_condgen(out: Path) -> dict:
    from transformers import Gemma4ForConditionalGeneration

    seed, model, prompts, arrays, margin = searched_case(out, "gemma4_condgen", Gemma4ForConditionalGeneration,
                                                         build_condgen, 12000, after_save=rewrite_published_form)
    notes = [
        "Gemma4ForConditionalGeneration with a 1-layer vision tower (model.vision_tower.*, model.embed_vision.*: "
        "ignored by a text-only implementation) and no audio tower; text weights under model.language_model.*, "
        "text config under text_config.",
        "Text layers [S, F, S, F], sliding_window 5; sliding head_dim 16, full head_dim 32 (text_config."
        "global_head_dim, the published form: config.json rewritten, no per_layer_config); both types 2 KV heads "
        "(attention_k_eq_v false, so full layers have v_proj and num_global_key_value_heads does not apply).",
        "No final_logit_softcapping; tied head (model.language_model.embed_tokens.weight). Text-only forward: "
        "input_ids only.",
    ]
    return base_case("gemma4_condgen", model, seed, prompts, margin, notes, config_form="global_head_dim")


def build_mistral(seed: int):
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_hidden_layers=2, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                        sliding_window=6, max_position_embeddings=512,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg._attn_implementation = "eager"
    model = MistralForCausalLM(cfg).eval()
    reinit_(model, torch.Generator().manual_seed(seed))
    return model


def mistral_capture(model, prompt):
    cap = forward_capture(model, prompt)
    return {"logits": cap["logits"], "hidden_final": cap["hidden_final"]}


def mistral_greedy(model, prompt, n, check_generate=True):
    return greedy(model, prompt, n)  # always cross-checks generate()


def make_mistral(out: Path) -> dict:
    from transformers import AutoModelForCausalLM

    seed, model, prompts, arrays, margin = searched_case(out, "mistral_swa", AutoModelForCausalLM, build_mistral, 13000,
                                                         capture=mistral_capture, greedy_fn=mistral_greedy,
                                                         min_margin=MIN_MARGIN)
    notes = ["Mistral, 2 layers, GQA 4/2, sliding_window 6 (every layer): a query at position p sees keys "
             "p-5..p; prompts of 11 and 17 tokens and 16 greedy tokens run past it."]
    return base_case("mistral_swa", model, seed, prompts, margin, notes)


# ---------------------------------------------------------------------------------------------- assistant


# The assistant layers' attention fields: those of the target whose K/V they read.
TEXT_ATTENTION = dict(num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                      attention_k_eq_v=True)
PLE_ATTENTION = dict(num_key_value_heads=2, head_dim=16, global_head_dim=32)


def build_assistant(seed: int, target, *, layer_types, ordered: bool, attention: dict = TEXT_ATTENTION):
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    tc = target.config
    torch.manual_seed(seed)
    text = Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types),
        num_attention_heads=4, **attention, layer_types=list(layer_types), sliding_window=tc.sliding_window,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, max_position_embeddings=512,
        final_logit_softcapping=30.0)  # the assistant applies no softcap whatever its text config says
    kw = dict(num_centroids=16, centroid_intermediate_top_k=4) if ordered else {}
    cfg = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=tc.hidden_size,
                                use_ordered_embeddings=ordered, **kw)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    model = Gemma4AssistantForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    gemma_reinit_(model, gen)
    if ordered:
        model.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB, generator=gen))
    return model


def assistant_chain(target, assistant, prompt: list[int]) -> dict[str, np.ndarray]:
    """HF's single-position recipe: the target over the prompt (T tokens) publishes its last sliding and
    full layers' K/V; the assistant then drafts DRAFT_STEPS tokens at position_ids [[T]], fed
    [target_embed(token), hidden], token = argmax, hidden = the assistant's post-projected output."""
    import torch

    ids = torch.tensor([prompt])
    out = target(input_ids=ids, use_cache=True, return_shared_kv_states=True, output_hidden_states=True)
    shared = dict(out.shared_kv_states)
    assert set(shared) == {S, F}, shared.keys()
    tok = out.logits[:, -1].argmax(-1)  # [1]
    h = out.hidden_states[-1][:, -1:]  # [1, 1, H_t], final-normed
    T = len(prompt)
    rec = {"tokens": [], "hidden_in": [], "logits": [], "hidden_out": []}
    for _ in range(DRAFT_STEPS):
        emb = target.get_input_embeddings()(tok[:, None])  # scaled by sqrt(H_t)
        a = assistant(inputs_embeds=torch.cat([emb, h], dim=-1), position_ids=torch.tensor([[T]]),
                      shared_kv_states=shared)
        rec["tokens"].append(int(tok))
        rec["hidden_in"].append(f32(h[0, 0]))
        rec["logits"].append(f32(a.logits[0, 0]))
        rec["hidden_out"].append(f32(a.last_hidden_state[0, 0]))
        tok = a.logits[:, -1].argmax(-1)
        h = a.last_hidden_state
    return {k: np.asarray(v) for k, v in rec.items()}


def make_assistant(out: Path, name: str, target, prompts, *, layer_types, ordered: bool, seed: int,
                   target_name: str = "gemma4_text", attention: dict = TEXT_ATTENTION) -> dict:
    import torch
    from transformers import Gemma4AssistantForCausalLM

    model = build_assistant(seed, target, layer_types=layer_types, ordered=ordered, attention=attention)
    case_dir = out / name
    model.save_pretrained(case_dir)
    arrays = {}
    for i, p in enumerate(prompts):
        for k, v in assistant_chain(target, model, p).items():
            arrays[f"{k}_{i}"] = v.astype(np.int64) if k == "tokens" else v
    reloaded = Gemma4AssistantForCausalLM.from_pretrained(case_dir, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    for i, p in enumerate(prompts):  # not bit for bit: the reloaded tied head runs a different matmul path
        again = assistant_chain(target, reloaded, p)
        for k in ("logits", "hidden_out"):
            err = float(np.abs(again[k] - arrays[f"{k}_{i}"]).max())
            assert err <= 1e-4, f"{name}: reloaded {k}_{i} differs by {err}"
    np.savez(case_dir / "golden.npz", **arrays)
    tc = model.config.text_config
    stores = ("layers 3 (sliding) and 2 (full), the last of each type before its 2 K/V-sharing layers: their K/V"
              if target_name == "gemma4_ple" else "last sliding layer (3) and last full layer (5) K/V")
    notes = [
        f"Target: {target_name} (same prompts). Step j of prompt i (T = len(prompt), position_ids [[T]] at every "
        f"step): inputs_embeds = cat({target_name}'s scaled embedding of tokens_i[j], hidden_in_i[j]); hidden_in_i[0] "
        "is the target's final-normed hidden at position T-1, tokens_i[0] the target's greedy token after the "
        "prompt; later steps feed the previous step's argmax and its hidden_out.",
        f"shared_kv_states: the target's {stores} over the prompt "
        "(K after k_norm + RoPE, V after v_norm); assistant sliding layers see the last sliding_window + 1 = 7 of "
        "them, full layers all.",
        "logits_i [K, V]: with use_ordered_embeddings, tokens outside the top centroid_intermediate_top_k clusters "
        "hold HF's fill value, min(selected logits) - 1 over the whole call; hidden_out_i [K, 64] = "
        "post_projection(norm(h)). No softcap on assistant logits.",
        "Weights: 1-D tensors 1 + 0.3 N, the final norm 3 (1 + 0.3 N), embed_tokens (its tied head) 0.05 N, other "
        "matrices N / sqrt(fan_in); token_ordering a random permutation.",
    ]
    return {
        "name": name, "kind": "gemma4_assistant", "dir": name, "target": target_name, "dtype": "float32",
        "atol": GEMMA_ATOL, "rtol": GEMMA_RTOL, "architecture": type(model).__name__, "model_type": model.config.model_type,
        "layer_types": list(tc.layer_types), "use_ordered_embeddings": ordered,
        "num_centroids": model.config.num_centroids if ordered else None,
        "centroid_intermediate_top_k": model.config.centroid_intermediate_top_k if ordered else None,
        "draft_steps": DRAFT_STEPS, "position": "len(prompt) at every step", "seed": seed, "prompts": prompts,
        "keys": [f"{k}_{i}" for i in range(len(prompts)) for k in ("tokens", "hidden_in", "logits", "hidden_out")],
        "files": list_files(case_dir), "notes": notes,
    }


def main() -> None:
    ap = arguments(__doc__, out=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*", default=None,
                    help="remake only these cases (the others are kept, with their manifest entries)")
    args = ap.parse_args()
    start()
    patch_kv_sharing()
    import torch
    from transformers import AutoModelForCausalLM

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    kept = {}
    if args.only:
        kept = {c["name"]: c for c in json.loads((out / "manifest.json").read_text())["cases"]}
    redo = (lambda name: True) if not args.only else (lambda name: name in args.only)
    for d in out.iterdir():
        if d.is_dir() and redo(d.name):
            shutil.rmtree(d)
    cases = {}
    if redo("gemma4_text"):
        cases["gemma4_text"], target = make_gemma_text(out)
    else:
        target = AutoModelForCausalLM.from_pretrained(out / "gemma4_text", dtype=torch.float32,
                                                      attn_implementation="eager").eval()
    if redo("gemma4_condgen"):
        cases["gemma4_condgen"] = make_condgen(out)
    if redo("mistral_swa"):
        cases["mistral_swa"] = make_mistral(out)
    if redo("gemma4_moe"):
        cases["gemma4_moe"] = make_gemma_moe(out)
    if redo("gemma4_ple"):
        cases["gemma4_ple"] = make_gemma_ple(out)
    if redo("gemma4_ple_assistant"):
        ple = AutoModelForCausalLM.from_pretrained(out / "gemma4_ple", dtype=torch.float32,
                                                   attn_implementation="eager").eval()
        cases["gemma4_ple_assistant"] = make_assistant(
            out, "gemma4_ple_assistant", ple, (cases.get("gemma4_ple") or kept["gemma4_ple"])["prompts"],
            layer_types=[S, F], ordered=False, seed=18000, target_name="gemma4_ple", attention=PLE_ATTENTION)
    prompts = (cases.get("gemma4_text") or kept["gemma4_text"])["prompts"]
    if redo("gemma4_assistant"):
        cases["gemma4_assistant"] = make_assistant(out, "gemma4_assistant", target, prompts, layer_types=[S, F],
                                                   ordered=True, seed=14000)
    if redo("gemma4_assistant_plain"):
        cases["gemma4_assistant_plain"] = make_assistant(out, "gemma4_assistant_plain", target, prompts,
                                                         layer_types=[S, S, F], ordered=False, seed=15000)
    order = ["gemma4_text", "gemma4_condgen", "mistral_swa", "gemma4_moe", "gemma4_ple", "gemma4_assistant",
             "gemma4_assistant_plain", "gemma4_ple_assistant"]
    cases = [cases.get(n) or kept[n] for n in order]
    for c in cases:
        c["files"] = list_files(out / c["dir"])
        print(f"{c['name']}: seed {c['seed']}" + (f", min greedy margin {c['min_greedy_margin']:.4f}"
                                                  if "min_greedy_margin" in c else ""))
    write_manifest(out, cases, __file__)


if __name__ == "__main__":
    main()
