#!/usr/bin/env python
"""A tiny random DeepSeek-V4 checkpoint (HF ``DeepseekV4ForCausalLM``, transformers 5.24) mixing the three
layer kinds, its MTP layer, and their goldens: the sibling of ``scripts/goldens/deepseek_v32.py`` for V4.

Not run in CI (needs torch + transformers); the set-up is targets.py's, with transformers 5.24.0:

    VENV/bin/python scripts/goldens/deepseek_v4.py     # rewrites tests/data/golden/deepseek_v4{,_modules}/, merges manifest.json

The model: 4 layers (CSA, sliding, HCA, CSA), hash routing in layer 0 and top-k routing after, window 8,
CSA rate 2 (overlapping windows of 4 tokens, ``index_topk`` 4 of up to 32 entries), HCA rate 4, two
residual streams, YaRN on the compressed layers. Prompts of 13 / 29 / 40 tokens and 24 greedy tokens
reach 64 positions: far past the window and many compression windows. HF initializes the attention
sinks, the compressors' position biases, ``tid2eid``, the router biases and the hyper-connection biases
to zero, which would hide those paths: every parameter and buffer is drawn at random here.

Goldens (float32): each prompt's no-cache logits; its greedy continuation by repeated no-cache
forwards (the model as a function), checked against HF's cached ``generate``; the no-cache logits over
prompt + continuation; the MTP layer (``mtp.0.*``, DeepSeek's published names, which HF drops) over
prompt_0 + greedy_0, computed by an independent torch forward written from DeepSeek's documented one
(``e = enorm(embed(t_{p+1}))``, ``x = e_proj(e) + h_proj(hnorm(streams_p))`` on every stream, one
sliding-window block -- HF's own ``DeepseekV4DecoderLayer`` --, ``logits = head(norm(hc_head(x)))`` with
the layer's own ``hc_head``), fed the target's last-layer streams (before ``hc_head``).

Seeds are searched until every greedy step has a top-1 margin >= MIN_MARGIN, every top-k routing
decision a gap >= MIN_ROUTING_MARGIN, and every query row that sees more than ``index_topk`` compressed
entries a gap >= MIN_INDEX_MARGIN between its k-th and (k+1)-th index score: random ReLU scores tie at
exactly 0, and torch's ``topk`` breaks such ties differently from jaxspec (which keeps the lower entry).

A second directory, ``deepseek_v4_modules``, holds the same weights written with
``save_pretrained(save_original_format=False)`` (HF module names, fused experts).
"""

from __future__ import annotations

import copy
import math
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from scripts.goldens.common import (  # noqa: E402
    GOLDEN, arguments, f32, i64, list_files, make_prompts, no_grad, replace_cases, start, top2_margin,
)

VOCAB, HIDDEN = 64, 32
PROMPT_LENS = (13, 29, 40)
NEW_TOKENS = 24
MIN_MARGIN = 2e-2
MIN_ROUTING_MARGIN = 1e-4
MIN_INDEX_MARGIN = 1e-5
MIN_DISTINCT = 6
MAX_SEED_TRIES = 300
ATOL = RTOL = 2e-4
NAME = "deepseek_v4"


def v4_config():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
        head_dim=32, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4,
        layer_types=["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], sliding_window=8, o_groups=2, o_lora_rank=8,
        index_n_heads=8, index_head_dim=16, index_topk=4, partial_rotary_factor=0.25, hc_mult=2,
        max_position_embeddings=256, routed_scaling_factor=1.5, swiglu_limit=3.0, eos_token_id=None,
        bos_token_id=None, rope_theta=10000.0, compress_rope_theta=40000.0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "rope_theta": 10000.0},
    )


class Mtp:
    """The MTP layer's own weights around its block (DeepSeek's ``MTPBlock``): ``block`` an HF
    ``DeepseekV4DecoderLayer``, ``gen`` the torch.Generator that draws the weights."""

    def __init__(self, cfg, block, gen):
        import torch

        H, N = cfg.hidden_size, cfg.hc_mult
        r = lambda *s, std=1.0: torch.randn(s, generator=gen) * std  # noqa: E731
        self.block = block
        self.w = {
            "enorm.weight": 1 + 0.1 * r(H), "hnorm.weight": 1 + 0.1 * r(H), "norm.weight": 1 + 0.1 * r(H),
            "e_proj.weight": r(H, H, std=1.5 / math.sqrt(H)), "h_proj.weight": r(H, H, std=1.5 / math.sqrt(H)),
            "hc_head_fn": r(N, N * H, std=0.5 / math.sqrt(N * H)), "hc_head_base": r(N, std=0.5),
            "hc_head_scale": 1 + 0.2 * r(1),
        }
        self.eps, self.hc_eps, self.cfg = cfg.rms_norm_eps, cfg.hc_eps, cfg

    def rms(self, x, w):  # DeepSeek's RMSNorm: normalize in f32, scale by the weight
        import torch

        xf = x.float()
        return (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)

    def __call__(self, model, tokens, streams, positions):
        """tokens i64[T] (t_{p+1}), streams f32[T, N, H] (target, before hc_head), positions i64[T]
        -> (streams out [T, N, H], logits [T, V])."""
        import torch
        import torch.nn.functional as F

        cfg, w = self.cfg, self.w
        T = tokens.shape[0]
        e = self.rms(model.model.embed_tokens(tokens), w["enorm.weight"])  # [T, H]
        x = F.linear(self.rms(streams, w["hnorm.weight"]), w["h_proj.weight"]) + F.linear(e, w["e_proj.weight"])[:, None]
        pos = positions[None]
        rot = model.model.rotary_emb
        pe = {"main": rot(x, position_ids=pos, layer_type="main"), "compress": rot(x, position_ids=pos, layer_type="compress")}
        q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
        mask = torch.where((k <= q) & (k > q - cfg.sliding_window), 0.0, float("-inf"))[None, None]
        x = self.block(x[None], position_embeddings=pe, position_ids=pos, attention_mask=mask, input_ids=None,
                       cache=None)[0]  # [T, N, H]
        flat = x.flatten(1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        pre = torch.sigmoid(F.linear(flat, w["hc_head_fn"]) * w["hc_head_scale"] + w["hc_head_base"]) + self.hc_eps
        y = (pre[..., None] * x).sum(1)
        return x, model.lm_head(self.rms(y, w["norm.weight"]))

    def state(self, prefix: str) -> dict:
        """``mtp.0.*`` under DeepSeek's published names (the block's as the trunk's published layer)."""
        out = {prefix + k: v.contiguous() for k, v in self.w.items()}
        out.update(published_block_state(self.block, self.cfg, prefix))
        return out


def published_block_state(block, cfg, prefix: str) -> dict:
    """An HF ``DeepseekV4DecoderLayer``'s weights under DeepSeek's published layer names, under ``prefix``."""
    out = {}
    rename = {"self_attn.": "attn.", "mlp.": "ffn.", "input_layernorm": "attn_norm", "post_attention_layernorm":
              "ffn_norm", "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale":
              "hc_attn_scale", "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale":
              "hc_ffn_scale", "q_a_proj": "wq_a", "q_a_norm": "q_norm", "q_b_proj": "wq_b", "kv_proj": "wkv",
              "o_a_proj": "wo_a", "o_b_proj": "wo_b", "sinks": "attn_sink", "e_score_correction_bias": "bias",
              "shared_experts.gate_proj": "shared_experts.w1", "shared_experts.up_proj": "shared_experts.w3",
              "shared_experts.down_proj": "shared_experts.w2"}
    I = cfg.moe_intermediate_size
    for k, v in block.state_dict().items():
        if k.endswith("experts.gate_up_proj"):
            for e in range(v.shape[0]):
                out[f"{prefix}ffn.experts.{e}.w1.weight"] = v[e, :I].contiguous()
                out[f"{prefix}ffn.experts.{e}.w3.weight"] = v[e, I:].contiguous()
            continue
        if k.endswith("experts.down_proj"):
            for e in range(v.shape[0]):
                out[f"{prefix}ffn.experts.{e}.w2.weight"] = v[e].contiguous()
            continue
        for a, b in rename.items():
            k = k.replace(a, b)
        out[prefix + k] = v.contiguous()
    return out


@no_grad
def randomize_(model, gen, cfg) -> None:
    """Every parameter and buffer at random (HF's zeros hide sinks, position biases, tid2eid, biases)."""
    import torch

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and p.dim() == 1:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        elif leaf in ("sinks", "position_bias", "base", "hc_base"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        elif leaf in ("scale", "hc_scale"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        elif "embed" in name:
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        else:  # matrices: gain / sqrt(fan_in)
            p.copy_(1.5 / math.sqrt(p.shape[-1]) * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[: cfg.num_experts_per_tok]
                                 for _ in range(cfg.vocab_size)]))
        elif name.endswith("e_score_correction_bias"):
            b.copy_(0.2 * torch.randn(b.shape, generator=gen))


class Probes:
    """Index-score and routing margins of every no-cache forward (rows at positions 0..S-1)."""

    def __init__(self, modules, index_topk: int, rate: int):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer, DeepseekV4TopKRouter

        self.index_margin = self.routing_margin = float("inf")
        self.sparse_rows = 0
        self.topk, self.rate, self.on = index_topk, rate, True
        self.handles = []
        for m in modules:
            if isinstance(m, DeepseekV4IndexerScorer):
                self.handles.append(m.register_forward_hook(self._index))
            if isinstance(m, DeepseekV4TopKRouter):
                self.handles.append(m.register_forward_pre_hook(self._route))

    def _index(self, mod, args, scores):  # scores [B, S, T]
        if not self.on or scores.shape[1] == 1:
            return
        for t in range(scores.shape[1]):
            vis = scores[0, t, : (t + 1) // self.rate]
            if vis.numel() <= self.topk:
                continue
            v = vis.sort(descending=True).values
            self.sparse_rows += 1
            self.index_margin = min(self.index_margin, float(v[self.topk - 1] - v[self.topk]))

    def _route(self, mod, args):
        import torch.nn.functional as F

        x = args[0].reshape(-1, mod.hidden_dim).float()
        s = mod.score_fn(F.linear(x, mod.weight.float())) + mod.e_score_correction_bias
        v = s.sort(dim=-1, descending=True).values
        self.routing_margin = min(self.routing_margin, float((v[:, mod.top_k - 1] - v[:, mod.top_k]).min()))

    def remove(self):
        for h in self.handles:
            h.remove()


def build(seed: int):
    import torch
    from transformers import DeepseekV4ForCausalLM
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

    torch.manual_seed(seed)
    cfg = v4_config()
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    randomize_(model, gen, cfg)
    L = cfg.num_hidden_layers
    block_cfg = copy.deepcopy(cfg)
    block_cfg.layer_types = list(cfg.layer_types) + ["sliding_attention"]
    block_cfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["moe"]
    block = DeepseekV4DecoderLayer(block_cfg, layer_idx=L).eval()
    randomize_(block, gen, cfg)
    return model, Mtp(cfg, block, gen)


def streams_of(model, seq: list[int]):
    """The last layer's output streams [T, N, H] (what hc_head collapses)."""
    import torch

    out = {}
    h = model.model.layers[-1].register_forward_hook(lambda mod, args, y: out.setdefault("x", y.detach().clone()))
    model(torch.tensor([seq]), use_cache=False)
    h.remove()
    return out["x"][0]


def greedy(model, prompt: list[int], n: int):
    """Greedy continuation by repeated no-cache forwards; (tokens, smallest margin, logits over
    prompt + tokens), -inf margin when HF's cached generate disagrees or the tokens degenerate."""
    import torch
    from transformers import GenerationConfig

    seq = list(prompt)
    margin = float("inf")
    for _ in range(n):
        lg = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
        margin = min(margin, float(top2_margin(lg)))
        seq.append(int(lg.argmax()))
    toks = seq[len(prompt):]
    full = model(torch.tensor([seq]), use_cache=False).logits[0]
    gc = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0, bos_token_id=None)
    ids = torch.tensor([prompt])
    cached = model.generate(ids, generation_config=gc, attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
    if cached != toks or len(set(toks)) < MIN_DISTINCT:
        margin = float("-inf")
    return toks, margin, full


def goldens(model, mtp, prompts):
    import torch

    cfg = model.config
    probes = Probes(list(model.modules()) + list(mtp.block.modules()), cfg.index_topk,
                    cfg.compress_rates["compressed_sparse_attention"])
    arrays, margin, greedies = {}, float("inf"), []
    try:
        for i, p in enumerate(prompts):
            logits = model(torch.tensor([p]), use_cache=False).logits[0]
            probes.on = False  # generate()'s cached calls see a different set of rows
            toks, m, full = greedy(model, p, NEW_TOKENS)
            probes.on = True
            model(torch.tensor([p + toks]), use_cache=False)  # probes every row of the full sequence
            margin = min(margin, m)
            greedies.append(toks)
            arrays.update({f"prompt_{i}": i64(p), f"logits_{i}": f32(logits), f"greedy_{i}": i64(toks),
                           f"full_logits_{i}": f32(full)})
        seq = prompts[0] + greedies[0]
        st = streams_of(model, seq)  # [T, N, H]
        ids, pos = torch.tensor(seq[1:]), torch.arange(len(seq) - 1)
        out, mtp_logits = mtp(model, ids, st[:-1], pos)
        N, H = cfg.hc_mult, cfg.hidden_size
        arrays.update({"mtp_input_ids": i64(ids), "mtp_positions": i64(pos),
                       "mtp_hidden_in": f32(st[:-1].reshape(-1, N * H)), "mtp_logits": f32(mtp_logits),
                       "mtp_hidden_out": f32(out.reshape(-1, N * H))})
    finally:
        probes.remove()
    return arrays, margin, probes.routing_margin, probes.index_margin, probes.sparse_rows, greedies


def make_case(out: Path) -> dict:
    from safetensors.torch import load_file, save_file

    for attempt in range(MAX_SEED_TRIES):
        seed = 31_000 + attempt
        model, mtp = build(seed)
        prompts = make_prompts(seed, lengths=PROMPT_LENS, vocab=VOCAB, offset=40_000)
        arrays, margin, routing, index, rows, greedies = goldens(model, mtp, prompts)
        print(f"  seed {seed}: greedy margin {margin:.3g}, routing {routing:.3g}, index {index:.3g}", flush=True)
        if margin >= MIN_MARGIN and routing >= MIN_ROUTING_MARGIN and index >= MIN_INDEX_MARGIN:
            break
    else:
        raise RuntimeError("no seed with the required margins")
    case_dir, mod_dir = out / NAME, out / (NAME + "_modules")
    model.save_pretrained(case_dir)
    model.save_pretrained(mod_dir, save_original_format=False)
    st_path = case_dir / "model.safetensors"
    state = load_file(st_path)
    assert not any(k.startswith("mtp.") for k in state)
    state.update(mtp.state("mtp.0."))
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, st_path, metadata={"format": "pt"})
    reload_check(case_dir, mod_dir, arrays, prompts)
    np.savez(case_dir / "golden.npz", **arrays)
    keys = [f"{k}_{i}" for i in range(len(prompts)) for k in ("prompt", "logits", "greedy", "full_logits")]
    return {
        "name": NAME, "kind": "target", "dir": NAME, "dtype": "float32", "atol": ATOL, "rtol": RTOL,
        "architecture": "DeepseekV4ForCausalLM", "model_type": "deepseek_v4", "num_hidden_layers": 4,
        "layout": "mixed (save_pretrained default); deepseek_v4_modules: save_original_format=False",
        "files": list_files(case_dir), "seed": seed, "prompts": prompts, "greedy_new_tokens": NEW_TOKENS,
        "min_greedy_margin": margin, "min_routing_margin": routing,
        "index": {"index_topk": model.config.index_topk, "min_index_margin": index, "sparse_rows_checked": rows},
        "mtp": {"prefix": "mtp.0.", "source": "prompt_0 + greedy_0", "T": int(arrays["mtp_input_ids"].shape[0]),
                "hidden_in": "last layer's streams before hc_head, flattened [N*H]", "position0_masked": False},
        "keys": keys + ["mtp_input_ids", "mtp_positions", "mtp_hidden_in", "mtp_logits", "mtp_hidden_out"],
        "notes": [
            "DeepSeek-V4 (HF DeepseekV4ForCausalLM): layers CSA / sliding / HCA / CSA, window 8, CSA rate 2 "
            "(entries of 4 overlapping tokens, index_topk 4 of up to 32), HCA rate 4, hc_mult 2, hash routing in "
            "layer 0; every parameter and buffer random (sinks, position biases, tid2eid, router and hc biases).",
            "greedy_i: repeated no-cache forwards (equal to HF's cached generate for this seed); full_logits_i: "
            "no-cache logits over prompt_i + greedy_i.",
            "min_index_margin: smallest gap between the 4th and 5th visible index score over every row that sees "
            "more than 4 CSA entries (ties at 0 are broken differently by torch and jaxspec).",
            "MTP: mtp.0.* in DeepSeek's published names (enorm, hnorm, e_proj, h_proj, norm, hc_head_{fn,base,"
            "scale}, a sliding-window MoE block), computed by an independent torch forward around HF's "
            "DeepseekV4DecoderLayer; input row p = (streams of the target at p, token p + 1) at position p.",
        ],
    }


def reload_check(case_dir: Path, mod_dir: Path, arrays: dict, prompts) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    # The default layout must give the golden's bits; the modules layout (experts fused) runs other
    # kernels, whose last bits depend on the CPU (1.2e-6 apart on a Zen 4 machine): a tolerance there.
    for d, atol in ((case_dir, 0.0), (mod_dir, 1e-5)):
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        for i, p in enumerate(prompts):
            lg = f32(m(torch.tensor([p]), use_cache=False).logits[0])
            want = arrays[f"logits_{i}"]
            ok = np.array_equal(lg, want) if atol == 0 else np.allclose(lg, want, rtol=0, atol=atol)
            assert ok, f"{d.name}: reloaded logits_{i} differ (max {np.abs(lg - want).max():.2e})"


def main() -> None:
    args = arguments(__doc__, out=GOLDEN).parse_args()
    start()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for d in (NAME, NAME + "_modules"):
        if (out / d).exists():
            shutil.rmtree(out / d)
    case = make_case(out)
    print(f"{NAME}: seed {case['seed']}, greedy margin {case['min_greedy_margin']:.4f}, routing margin "
          f"{case['min_routing_margin']:.2e}, index margin {case['index']['min_index_margin']:.2e} over "
          f"{case['index']['sparse_rows_checked']} sparse rows")
    replace_cases(out, [case])

if __name__ == "__main__":
    main()
