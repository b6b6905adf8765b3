#!/usr/bin/env python
"""DeepSeek's DSpark draft layout for DeepSeek-V4 (DeepSeek-V4-Flash-DSpark: stages ``mtp.{0..S-1}.*`` in the
target's checkpoint, ``dspark_*`` config fields) on the tiny V4 golden target, and its goldens from an
independent torch forward written from DeepSeek's documented one.

Not run in CI (needs torch + transformers; the set-up of scripts/goldens/deepseek_v4.py):

    VENV/bin/python scripts/goldens/deepseek_v4_dspark.py    # writes tests/data/golden/deepseek_v4_dspark/

The target is tests/data/golden/deepseek_v4 (read, not rewritten; its MTP layer ``mtp.0.*`` is left out
here). The draft: 3 stages, each an HF ``DeepseekV4DecoderLayer`` (sliding attention, top-k MoE with
shared expert) holding the weights; taps = the outputs of target layers 1, 2, 3; a block of 4 slots
(anchor + 3 noise tokens), every slot drafting; Markov rank 64; a confidence head. The reference forward
(written here, not HF's attention):

    main_x_p = RMSNorm(main_proj(concat_l mean_n out_l(p)), main_norm)             out_l: layer l's output streams
    stage s: context rows kv_s(p) = RoPE_p(kv_norm(kv_proj(main_x_p))) of the last W = 8 positions before
             the anchor; block streams x = [embed(anchor), embed(noise) ...] on every stream; the layer's
             hyper-connections, norms and MoE (HF's modules) around an attention whose queries (the layer's
             q projections, RoPE at start + k) all see the context rows, every block row (bidirectional)
             and the sink; the output's RoPE undone, the grouped output projection
    h = hc_head(x) (the last stage's);  logits_k = lm_head(RMSNorm(h_k, norm)) + W2 W1[prev_k]
    confidence_k = proj([h_k, W1[prev_k]]),  prev_0 = the anchor, prev_k = the token drafted at k - 1

Random weights as in deepseek_v4.py (sinks, biases and hyper-connection weights included). So that
acceptance varies, the Markov head is set to the target's own bigram statistics over the golden
prompts' greedy continuations (``W1`` a random invertible [V, V] embedding, ``W2`` solving
``W2 W1[a] = 12 * P(b | a)``); the backbone breaks ties. Seeds are searched until every drafted slot's
top-1 margin is >= MIN_DRAFT_MARGIN and every stage routing decision has a gap >= MIN_ROUTING_MARGIN.

Goldens (float32): for the context prompt_0 + greedy_0[:8] (20 positions, past the window) and its
anchor: the taps (flattened streams), main_x, every stage's context rows, the block's pre-norm hidden,
base logits, Markov biases, corrected logits, greedy path and confidence logits; per prompt the
reference loop's greedy tokens and per-step acceptance lengths (a chain of 4; equal to the target's
greedy tokens: checked).
"""

from __future__ import annotations

import dataclasses
import json
import functools
import math
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from scripts.goldens.common import (  # noqa: E402
    GOLDEN, arguments, f32, generator, i64, list_files, speculative_greedy, start, top2_margin, write_json,
)
from scripts.goldens.deepseek_v4 import Probes, published_block_state, randomize_  # noqa: E402

TARGET = GOLDEN / "deepseek_v4"
NAME = "deepseek_v4_dspark"
BIGRAM_SCALE = 12.0
MAX_NEW = 24
CONTEXT = 20  # the block golden's context length (> the window of 8)
MIN_DRAFT_MARGIN = 2e-3
MIN_ROUTING_MARGIN = 1e-4
MAX_SEED_TRIES = 200


@dataclasses.dataclass(frozen=True)
class Shape:
    """The draft's shape: stages, block slots, tapped target layers, Markov rank, noise token, confidence head."""

    stages: int = 3
    block: int = 4
    taps: tuple[int, ...] = (1, 2, 3)
    rank: int = 64
    noise: int = 63
    confidence: bool = True


def rms(x, w, eps):
    import torch

    xf = x.float()
    return (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


class DSpark:
    """The draft's weights: stages (HF decoder layers) and DeepSeek's first- and last-stage tensors;
    ``gen`` the torch.Generator that draws them, ``bigram`` [V, V] the Markov head's target."""

    def __init__(self, model, gen, bigram, shape: Shape):
        import torch
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

        cfg = model.config
        STAGES, TAPS, RANK = shape.stages, shape.taps, shape.rank
        self.shape = shape
        L, H, N, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
        block_cfg = type(cfg).from_dict(cfg.to_dict())
        block_cfg.layer_types = list(cfg.layer_types) + ["sliding_attention"] * STAGES
        block_cfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["moe"] * STAGES
        block_cfg._attn_implementation = "eager"
        self.stages = torch.nn.ModuleList([DeepseekV4DecoderLayer(block_cfg, layer_idx=L + s).eval()
                                           for s in range(STAGES)])
        for st in self.stages:
            randomize_(st, gen, cfg)
        r = lambda *s, std=1.0: torch.randn(s, generator=gen) * std  # noqa: E731
        w1 = r(V, RANK, std=1.0)
        w2 = torch.linalg.lstsq(w1, BIGRAM_SCALE * bigram).solution.T  # [V, r]: exact when r = V
        self.w = {
            "main_proj": r(H, len(TAPS) * H, std=1.5 / math.sqrt(len(TAPS) * H)), "main_norm": 1 + 0.1 * r(H),
            "norm": 1 + 0.1 * r(H), "hc_head_fn": r(N, N * H, std=0.5 / math.sqrt(N * H)),
            "hc_head_base": r(N, std=0.5), "hc_head_scale": 1 + 0.2 * r(1),
            "markov_w1": w1, "markov_w2": w2.contiguous(),
            "confidence": r(1, H + RANK, std=1.0 / math.sqrt(H + RANK)),
        }
        self.cfg = cfg

    def state(self) -> dict:
        """DeepSeek's published names."""
        last, w = f"mtp.{self.shape.stages - 1}.", self.w
        out = {"mtp.0.main_proj.weight": w["main_proj"], "mtp.0.main_norm.weight": w["main_norm"],
               last + "norm.weight": w["norm"], last + "hc_head_fn": w["hc_head_fn"],
               last + "hc_head_base": w["hc_head_base"], last + "hc_head_scale": w["hc_head_scale"],
               last + "markov_head.markov_w1.weight": w["markov_w1"],
               last + "markov_head.markov_w2.weight": w["markov_w2"]}
        if self.shape.confidence:
            out[last + "confidence_head.proj.weight"] = w["confidence"]
        for s, st in enumerate(self.stages):
            out.update(published_block_state(st, self.cfg, f"mtp.{s}."))
        return {k: v.contiguous() for k, v in out.items()}


def taps_of(model, seq: list[int], taps: tuple[int, ...]):
    """The outputs of the tapped target layers over ``seq``: [T, n, N, H]."""
    import torch

    got = {}
    hooks = [model.model.layers[l].register_forward_hook(lambda m, a, y, l=l: got.__setitem__(l, y.detach()[0]))
             for l in taps]
    model(torch.tensor([seq]), use_cache=False)
    for h in hooks:
        h.remove()
    return torch.stack([got[l] for l in taps], dim=1)


def main_x_of(draft: DSpark, taps):  # [T, n, N, H] -> [T, H]
    import torch.nn.functional as F

    eps = draft.cfg.rms_norm_eps
    return rms(F.linear(taps.mean(dim=2).flatten(1), draft.w["main_proj"]), draft.w["main_norm"], eps)


@functools.cache
def attention_class():
    """The module that stands in for a stage's ``self_attn`` (a torch.nn.Module, made on first use)."""
    import torch

    class Attention(torch.nn.Module):
        """A stage's DSpark attention around the HF layer's projections: every block query sees the
        context rows, every block row and the sink."""

        def __init__(self, attn, ctx_kv, rope_blk):
            super().__init__()
            self.attn, self.ctx_kv, self.rope_blk = attn, ctx_kv, rope_blk  # ctx_kv [1, 1, C, D]

        forward = attention_forward

    return Attention


def attention_forward(self, hidden_states, **kwargs):
    """``Attention.forward``: queries of the block at its RoPE positions over the context rows, the
    block's own rows and the sink; the output's RoPE undone, the grouped output projection."""
    import torch
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    a, (cos, sin) = self.attn, self.rope_blk
    B, Q, _ = hidden_states.shape
    q = a.q_b_proj(a.q_a_norm(a.q_a_proj(hidden_states))).view(B, Q, -1, a.head_dim).transpose(1, 2)
    q = apply_rotary_pos_emb(a.q_b_norm(q), cos, sin)  # [B, Hq, Q, D]
    kv = a.kv_norm(a.kv_proj(hidden_states)).view(B, Q, 1, a.head_dim).transpose(1, 2)
    kv = apply_rotary_pos_emb(kv, cos, sin)  # [B, 1, Q, D]
    keys = torch.cat([self.ctx_kv, kv], dim=2)  # [B, 1, C + Q, D]
    s = torch.matmul(q, keys.transpose(2, 3)) * a.scaling  # [B, Hq, Q, C + Q]
    sinks = a.sinks.reshape(1, -1, 1, 1).expand(B, -1, Q, 1)
    p = torch.softmax(torch.cat([s, sinks], dim=-1), dim=-1)[..., :-1]
    o = torch.matmul(p, keys)  # [B, Hq, Q, D]
    o = apply_rotary_pos_emb(o, cos, -sin)  # the values' RoPE undone at the query's position
    grouped = a.o_a_proj(o.transpose(1, 2).reshape(B, Q, a.config.o_groups, -1)).flatten(2)
    return a.o_b_proj(grouped), None


def block_forward(model, draft: DSpark, main_x, anchor: int, start: int):
    """main_x [start, H] (context rows at 0..start-1) -> (h [Q, H] pre-norm, base logits [Q, V], per stage
    context rows [C, D])."""
    import torch
    import torch.nn.functional as F
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    cfg = model.config
    W, N = cfg.sliding_window, cfg.hc_mult
    lo, BLOCK = max(0, start - W), draft.shape.block
    tokens = torch.tensor([[anchor] + [draft.shape.noise] * (BLOCK - 1)])
    x = model.model.embed_tokens(tokens)[:, :, None, :].repeat(1, 1, N, 1)  # [1, Q, N, H]
    rot = model.model.rotary_emb
    rope_blk = rot(x, position_ids=torch.arange(start, start + BLOCK)[None], layer_type="main")
    rope_ctx = rot(x, position_ids=torch.arange(lo, start)[None], layer_type="main")
    ctx_rows = []
    for st in draft.stages:
        a = st.self_attn
        ctx = a.kv_norm(a.kv_proj(main_x[lo:start]))[None, None]  # [1, 1, C, D]
        ctx = apply_rotary_pos_emb(ctx, *rope_ctx)
        ctx_rows.append(ctx[0, 0])
        orig = st.self_attn
        st.self_attn = attention_class()(orig, ctx, rope_blk)
        try:
            x = st(x, input_ids=tokens)
        finally:
            st.self_attn = orig
    w, eps = draft.w, cfg.rms_norm_eps
    flat = x.flatten(2).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    pre = torch.sigmoid(F.linear(flat, w["hc_head_fn"]) * w["hc_head_scale"] + w["hc_head_base"]) + cfg.hc_eps
    h = (pre[..., None] * x).sum(2)[0]  # [Q, H]
    return h, model.lm_head(rms(h, w["norm"], eps)), ctx_rows


def draft_block(model, draft: DSpark, main_x, anchor: int, start: int):
    """The block and the Markov-corrected greedy choice, slot by slot."""
    import torch
    import torch.nn.functional as F

    h, base, ctx_rows = block_forward(model, draft, main_x, anchor, start)
    w = draft.w
    prev, path, biases, logits, margin, prevs = anchor, [], [], [], math.inf, []
    for k in range(draft.shape.block):
        bias = F.linear(w["markov_w1"][prev], w["markov_w2"])
        lg = base[k] + bias
        margin = min(margin, float(top2_margin(lg)))
        prevs.append(prev)
        prev = int(lg.argmax())
        path.append(prev)
        biases.append(bias)
        logits.append(lg)
    conf = F.linear(torch.cat([h, w["markov_w1"][torch.tensor(prevs)]], dim=-1), w["confidence"])[:, 0]
    return dict(h=h, base=base, ctx_rows=ctx_rows, path=path, bias=torch.stack(biases), logits=torch.stack(logits),
                confidence=conf), margin


def generate(model, draft: DSpark, prompt: list[int], greedy: list[int]):
    """Greedy speculative decoding with the reference loop: (tokens, accept lengths, min draft margin)."""
    import torch

    def propose(ids, bonus):  # context rows at 0 .. len(ids) - 1
        out, m = draft_block(model, draft, main_x_of(draft, taps_of(model, ids, draft.shape.taps)), bonus, len(ids))
        return out["path"], m

    new, accepts, margin = speculative_greedy(lambda seq: model(torch.tensor([seq]), use_cache=False).logits[0],
                                              propose, prompt, draft.shape.block, MAX_NEW)
    if new != greedy:
        raise AssertionError("the reference loop's greedy output differs from the target's")
    return new, accepts, margin


def bigram(golden, vocab: int):
    """P(b | a) over the golden prompts' greedy continuations (each prompt's last token included)."""
    import torch

    counts = torch.zeros(vocab, vocab)
    for i in range(3):
        seq = [int(golden[f"prompt_{i}"][-1])] + golden[f"greedy_{i}"].tolist()
        for a, b in zip(seq, seq[1:]):
            counts[a, b] += 1
    return counts / counts.sum(-1, keepdim=True).clamp(min=1)


def write_case(out_dir: Path, model, golden: dict, shape: Shape, seed_base: int, log=print) -> dict:
    """Searches seeds from ``seed_base`` for a draft of ``shape`` with the required margins; writes the
    target's weights (its MTP layer left out) with the draft's stages, the config and ``golden.npz`` to
    ``out_dir``; returns the manifest."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = model.config
    table = bigram(golden, cfg.vocab_size)
    for attempt in range(MAX_SEED_TRIES):
        seed = seed_base + attempt
        draft = DSpark(model, torch.Generator().manual_seed(seed), table, shape)
        probes = Probes(list(draft.stages.modules()), cfg.index_topk, 2)
        try:
            arrays, accepts, margin = {}, [], math.inf
            for i in range(3):
                toks, acc, m = generate(model, draft, golden[f"prompt_{i}"].tolist(), golden[f"greedy_{i}"].tolist())
                margin = min(margin, m)
                accepts.append(acc)
                arrays[f"generate/p{i}/tokens"], arrays[f"generate/p{i}/accept"] = i64(toks), i64(acc)
            seq = golden["prompt_0"].tolist() + golden["greedy_0"].tolist()
            taps = taps_of(model, seq[:CONTEXT], shape.taps)
            main_x = main_x_of(draft, taps)
            anchor = seq[CONTEXT]
            out, m = draft_block(model, draft, main_x, anchor, CONTEXT)
            margin = min(margin, m)
        finally:
            probes.remove()
        log(f"  seed {seed}: draft margin {margin:.3g}, routing {probes.routing_margin:.3g}, accepts {accepts}")
        if margin >= MIN_DRAFT_MARGIN and probes.routing_margin >= MIN_ROUTING_MARGIN:
            break
    else:
        raise RuntimeError("no seed with the required margins")
    arrays.update({"block/taps": f32(taps.flatten(2)), "block/main_x": f32(main_x), "block/anchor": i64(anchor),
                   "block/context_rows": f32(torch.stack(out["ctx_rows"])), "block/hidden": f32(out["h"]),
                   "block/base_logits": f32(out["base"]), "block/markov_bias": f32(out["bias"]),
                   "block/logits": f32(out["logits"]), "block/path": i64(out["path"]),
                   "block/confidence": f32(out["confidence"])})
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    state = {k: v for k, v in load_file(TARGET / "model.safetensors").items() if not k.startswith("mtp.")}
    state.update(draft.state())
    save_file(dict(sorted(state.items())), out_dir / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((TARGET / "config.json").read_text())
    raw.update({"n_mtp_layers": shape.stages, "dspark_block_size": shape.block, "dspark_noise_token_id": shape.noise,
                "dspark_target_layer_ids": list(shape.taps), "dspark_markov_rank": shape.rank,
                "enable_confidence_head": shape.confidence})
    write_json(out_dir / "config.json", raw, indent=2)
    np.savez(out_dir / "golden.npz", **arrays)
    manifest = {
        "generator": generator(__file__), "target": "tests/data/golden/deepseek_v4 (its mtp.0 left out)",
        "seed": seed, "stages": shape.stages, "block_size": shape.block, "noise_token": shape.noise,
        "target_layer_ids": list(shape.taps), "markov_rank": shape.rank, "confidence_head": shape.confidence,
        "context": CONTEXT, "min_draft_margin": margin, "min_routing_margin": probes.routing_margin,
        "acceptance_lengths": accepts, "atol": 2e-4, "rtol": 2e-4,
        "notes": ["Markov head set to the target's bigram statistics over the golden greedy continuations "
                  "(W2 W1[a] = 12 P(b | a), least squares below rank V), so acceptance varies; the backbone "
                  "and the confidence head are random.",
                  "taps: outputs of the target layers (HF layer forward hooks), flattened [n, N * H]."],
    }
    manifest["files"] = sorted(["manifest.json"] + list_files(out_dir))
    write_json(out_dir / "manifest.json", manifest, indent=2)
    return manifest


def load_target():
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32, attn_implementation="eager").eval()
    return model, dict(np.load(TARGET / "golden.npz"))


def main() -> None:
    arguments(__doc__).parse_args()
    start()
    model, golden = load_target()
    m = write_case(GOLDEN / NAME, model, golden, Shape(), 61_000, log=lambda s: print(s, flush=True))
    print(f"{NAME}: seed {m['seed']}, draft margin {m['min_draft_margin']:.4f}, routing margin "
          f"{m['min_routing_margin']:.2e}, acceptance lengths {m['acceptance_lengths']}")


if __name__ == "__main__":
    main()
