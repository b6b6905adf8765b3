"""KV bytes per token of a Gemma-4-31B-shaped target (or an E2B- / E4B-shaped one, whose last
layers share K/V) at a long context, counted from the engine's own page accounting (host only: no
model, no device).

One request runs through the scheduler's admission and per-call page grants exactly as
``jaxspec.generate`` drives them (``Scheduler`` + the window pool's ``WindowPages``), with every
decode call advancing it by its most (every draft accepted), up to the context length. The pages
each pool holds at the end, times the bytes a page holds, are the KV it costs; the same request
with every layer keeping its own K/V in the full pool is the baseline.

    .venv/bin/python benchmarks/sliding_kv.py [--shape 31b|e2b|e4b] [--context 32768] [--page-size 16] [--steps 5]
"""

from __future__ import annotations

import argparse

import numpy as np

from jaxspec.config import SamplingParams, SpecConfig
from jaxspec.spec.plan import Plan
from jaxspec.engine.scheduler import Request, Scheduler
from jaxspec.engine.window import window_pages_for
from jaxspec.kvcache.paging import pages_needed
from jaxspec.model.config import RopeConfig
from jaxspec.model.drafts.assistant import FrozenKVAssistant, gemma4_assistant_config
from jaxspec.model.targets.gemma4_config import FULL, SLIDING, AttentionShape, Gemma4Config, PerLayerInputs


def gemma4_31b_shape() -> Gemma4Config:
    """The dense 31B class as commonly reported (read a real config.json for a real checkpoint):
    60 layers (5 sliding : 1 full), hidden 5376, 32 query heads; sliding layers 16 KV heads of
    width 256, window 1024; full layers 4 KV heads of width 512 (attention_k_eq_v)."""
    types = tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(60))
    return Gemma4Config(
        vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_layers=60, num_heads=32,
        layer_types=types, sliding_window=1024,
        sliding=AttentionShape(head_dim=256, num_kv_heads=16, rope=RopeConfig()),
        full=AttentionShape(head_dim=512, num_kv_heads=4, k_eq_v=True,
                            rope=RopeConfig(theta=1e6, kind="proportional", partial_rotary_factor=0.25)),
        final_logit_softcapping=30.0,
    )


def gemma4_small_shape(kind: str) -> Gemma4Config:
    """E2B / E4B as commonly reported (read a real config.json for a real checkpoint): E2B 35 layers
    (4 sliding : 1 full), hidden 1536, 8 query heads, 1 KV head, the last 20 layers sharing K/V,
    double-wide MLPs; E4B 42 layers (5 : 1), hidden 2560, 2 KV heads, the last 18 sharing. Both:
    sliding heads 256 wide with window 512, full heads 512 wide, per-layer inputs 256 wide."""
    layers, period, hidden, kv, shared, inter = {"e2b": (35, 5, 1536, 1, 20, 6144),
                                                 "e4b": (42, 6, 2560, 2, 18, 10240)}[kind]
    types = tuple(FULL if (i + 1) % period == 0 else SLIDING for i in range(layers))
    return Gemma4Config(
        vocab_size=262144, hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=8,
        layer_types=types, sliding_window=512,
        sliding=AttentionShape(head_dim=256, num_kv_heads=kv, rope=RopeConfig()),
        full=AttentionShape(head_dim=512, num_kv_heads=kv,
                            rope=RopeConfig(theta=1e6, kind="proportional", partial_rotary_factor=0.25)),
        final_logit_softcapping=30.0, per_layer_inputs=PerLayerInputs(width=256, vocab_size=262144),
        num_kv_shared_layers=shared, shared_intermediate_size=inter * (2 if kind == "e2b" else 1),
    )


def held_pages(cfg: Gemma4Config, plan: Plan, *, context: int, new_tokens: int, page_size: int,
               steps_per_call: int) -> dict[str, int]:
    """Pages the request holds in each pool once its context reaches ``context`` positions."""
    prompt = context - new_tokens
    req = Request(0, [0] * prompt, SamplingParams(max_new_tokens=new_tokens), (), np.zeros(2, np.uint32))
    growth = steps_per_call * plan.max_accept
    width = pages_needed(context + plan.lookahead, page_size)
    window = window_pages_for(cfg.sliding_window, batch=1, width=width, page_size=page_size,
                              ahead=growth + plan.lookahead)
    sched = Scheduler([req], batch=1, width=width, num_pages=width + 1, page_size=page_size,
                      lookahead=plan.lookahead, step_growth=growth, window=window)
    sched.admit()
    seq = np.array([prompt], np.int32)
    while True:
        sched.grant_ahead(seq)
        if seq[0] >= context:
            break
        seq[0] = min(context, seq[0] + growth)  # one decode call, every draft accepted
    held = {"full": len(sched.allocators[0].pages_of(0)), "window": len(window.allocator.pages_of(0)),
            "returned": window.returned_early, "ring": window.ring}
    sched.retire(0, [], [])
    sched.check()
    window.allocator.check()
    return held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("31b", "e2b", "e4b"), default="31b")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5, help="chain depth of the speculative rows (0: plain decoding)")
    ap.add_argument("--steps-per-call", type=int, default=8)
    ap.add_argument("--dtype-bytes", type=int, default=2)
    args = ap.parse_args()
    cfg = gemma4_31b_shape() if args.shape == "31b" else gemma4_small_shape(args.shape)
    P, nbytes = args.page_size, args.dtype_bytes

    def kv_bytes(t: str, layers: int) -> int:  # K and V of one position in ``layers`` layers of type t
        return layers * 2 * cfg.shape_of(t).num_kv_heads * cfg.shape_of(t).head_dim * nbytes

    per_pos = {"full": kv_bytes(FULL, cfg.num_full_layers), "window": kv_bytes(SLIDING, cfg.num_sliding_layers)}
    own_kv = kv_bytes(FULL, len(cfg.layers_of(FULL))) + kv_bytes(SLIDING, len(cfg.layers_of(SLIDING)))
    print(f"Gemma-4-{args.shape.upper()} shape: {cfg.num_sliding_layers} sliding layers ({cfg.sliding.num_kv_heads} x "
          f"{cfg.sliding.head_dim}, window {cfg.sliding_window}), {cfg.num_full_layers} full "
          f"layers ({cfg.full.num_kv_heads} x {cfg.full.head_dim}) keep K/V"
          f"{f' ({cfg.num_kv_shared_layers} more share it)' if cfg.num_kv_shared_layers else ''}; KV bytes per "
          f"position: full layers {per_pos['full']:,}, sliding layers {per_pos['window']:,} ({nbytes}-byte KV)")
    print(f"context {args.context}, page size {P}, {args.steps_per_call} steps per call\n")
    print("| decode | ring pages | full-pool pages | window-pool pages | pages returned while running "
          "| KV bytes / token (window pool) | KV bytes / token (every layer its own, in the full pool) "
          "| saved / token |")
    print("|---|---|---|---|---|---|---|---|")
    modes = [("plain", None)] + ([(f"chain S={args.steps} (assistant)", SpecConfig.chain(args.steps))]
                                 if args.steps else [])
    for name, spec in modes:
        draft = None
        if spec is not None:
            a = gemma4_assistant_config(cfg, hidden_size=1024, intermediate_size=4096, num_heads=cfg.num_heads,
                                        layer_types=(SLIDING, SLIDING, SLIDING, FULL), sliding=cfg.sliding,
                                        full=cfg.full, window=cfg.sliding_window)
            draft = FrozenKVAssistant(model=a)
        plan = Plan(target=cfg, draft=draft, spec=spec, page_size=P, steps_per_call=args.steps_per_call)
        held = held_pages(cfg, plan, context=args.context, new_tokens=args.new_tokens, page_size=P,
                          steps_per_call=args.steps_per_call)
        with_window = (held["full"] * per_pos["full"] + held["window"] * per_pos["window"]) * P / args.context
        all_full = held["full"] * P * own_kv / args.context
        print(f"| {name} | {held['ring']} | {held['full']} | {held['window']} | {held['returned']} "
              f"| {with_window:,.0f} | {all_full:,.0f} | {all_full - with_window:,.0f} "
              f"({100 * (1 - with_window / all_full):.1f}%) |")


if __name__ == "__main__":
    main()
