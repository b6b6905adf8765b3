"""KV bytes per token of a Gemma-4-31B-shaped target at a long context, counted from the engine's
own page accounting (host only: no model, no device).

One request runs through the scheduler's admission and per-call page grants exactly as
``jaxspec.generate`` drives them (``Scheduler`` + the window pool's ``WindowPages``), with every
decode call advancing it by its most (every draft accepted), up to the context length. The pages
each pool holds at the end, times the bytes a page holds, are the KV it costs; the same request
with every layer in the full pool is the baseline.

    .venv/bin/python benchmarks/sliding_kv.py [--context 32768] [--page-size 16] [--steps 5]
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
from jaxspec.model.targets.gemma4_config import FULL, SLIDING, AttentionShape, Gemma4Config


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
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5, help="chain depth of the speculative rows (0: plain decoding)")
    ap.add_argument("--steps-per-call", type=int, default=8)
    ap.add_argument("--dtype-bytes", type=int, default=2)
    args = ap.parse_args()
    cfg = gemma4_31b_shape()
    P, nbytes = args.page_size, args.dtype_bytes
    per_pos = {  # KV bytes of one position in each pool (K and V, every layer of the pool)
        "full": (cfg.num_layers - cfg.num_sliding_layers) * 2 * cfg.full.num_kv_heads * cfg.full.head_dim * nbytes,
        "window": cfg.num_sliding_layers * 2 * cfg.sliding.num_kv_heads * cfg.sliding.head_dim * nbytes,
    }
    print(f"Gemma-4-31B shape: {cfg.num_sliding_layers} sliding layers ({cfg.sliding.num_kv_heads} x "
          f"{cfg.sliding.head_dim}, window {cfg.sliding_window}), {cfg.num_layers - cfg.num_sliding_layers} full "
          f"layers ({cfg.full.num_kv_heads} x {cfg.full.head_dim}); KV bytes per position: full layers "
          f"{per_pos['full']:,}, sliding layers {per_pos['window']:,} ({nbytes}-byte KV)")
    print(f"context {args.context}, page size {P}, {args.steps_per_call} steps per call\n")
    print("| decode | ring pages | full-pool pages | window-pool pages | pages returned while running "
          "| KV bytes / token (window pool) | KV bytes / token (all layers in the full pool) | saved / token |")
    print("|---|---|---|---|---|---|---|---|")
    modes = [("plain", None)] + ([(f"chain S={args.steps} (assistant)", SpecConfig.chain(args.steps))]
                                 if args.steps else [])
    for name, spec in modes:
        draft = None
        if spec is not None:
            a = gemma4_assistant_config(cfg, hidden_size=1024, intermediate_size=4096, num_heads=32,
                                        layer_types=(SLIDING, SLIDING, SLIDING, FULL), sliding=cfg.sliding,
                                        full=cfg.full, window=cfg.sliding_window)
            draft = FrozenKVAssistant(model=a)
        plan = Plan(target=cfg, draft=draft, spec=spec, page_size=P, steps_per_call=args.steps_per_call)
        held = held_pages(cfg, plan, context=args.context, new_tokens=args.new_tokens, page_size=P,
                          steps_per_call=args.steps_per_call)
        with_window = (held["full"] * per_pos["full"] + held["window"] * per_pos["window"]) * P / args.context
        all_full = held["full"] * P * (per_pos["full"] + per_pos["window"]) / args.context
        print(f"| {name} | {held['ring']} | {held['full']} | {held['window']} | {held['returned']} "
              f"| {with_window:,.0f} | {all_full:,.0f} | {all_full - with_window:,.0f} "
              f"({100 * (1 - with_window / all_full):.1f}%) |")


if __name__ == "__main__":
    main()
