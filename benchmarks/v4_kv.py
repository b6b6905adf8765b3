"""KV bytes per token of a DeepSeek-V4-Flash-shaped target at 128k and 1M positions, counted from the
engine's own page accounting (host only: no model, no device).

One request runs through the scheduler's admission and per-call page grants as ``jaxspec.generate``
drives them: the window pool's ring (``WindowPages``, keeping the committed positions the sliding
window and the open compressor windows read) and one entry pool per compression rate (``EntryPages``),
every decode call advancing the request by its most (every draft accepted). The pages each pool holds
at the end, times the bytes a page holds (from the pool's buffer shapes), are what the request costs.
The baseline keeps every layer's K = V row of every position (one 512-wide head: what a plain paged
pool of the same attention would hold).

    .venv/bin/python benchmarks/v4_kv.py [--contexts 131072 1048576] [--page-size 64] [--steps 3]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import SamplingParams, SpecConfig
from jaxspec.spec.plan import Plan
from jaxspec.engine.entries import EntryPages
from jaxspec.engine.scheduler import Request, Scheduler
from jaxspec.engine.window import window_pages_for
from jaxspec.kvcache.paging import pages_needed
from jaxspec.model.config import RopeConfig
from jaxspec.model.drafts.deepseek_v4_mtp import V4MtpConfig, V4MtpDraft
from jaxspec.kvcache.compressed import entry_pages_for
from jaxspec.model.targets.deepseek_v4 import create_v4_pool
from jaxspec.model.targets.deepseek_v4_config import CSA, HASH, HCA, SLIDING, TOPK, DeepseekV4Config


def v4_flash_shape() -> DeepseekV4Config:
    """DeepSeek-V4-Flash as its config.json gives it: 43 layers (compress_ratios 0, 0, then 4 / 128
    alternating, the last 4), hidden 4096, 64 heads of 512 with 64 RoPE dims, window 128, CSA rate 4
    with a 64 x 128 indexer picking 512, HCA rate 128, 4 streams, 256 experts (6 routed), 3 hash layers."""
    kinds = (SLIDING, SLIDING) + tuple(CSA if i % 2 == 0 else HCA for i in range(41))
    return DeepseekV4Config(
        vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_layers=43, num_heads=64, head_dim=512,
        q_lora_rank=1024, rope_dim=64, layer_kinds=kinds, mlp_kinds=(HASH,) * 3 + (TOPK,) * 40, csa_rate=4,
        hca_rate=128, main_rope=RopeConfig(theta=10000.0), compress_rope=RopeConfig(theta=160000.0), hc_mult=4,
        num_experts=256, num_experts_per_tok=6, sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64,
        index_head_dim=128, index_topk=512, num_nextn_predict_layers=1)


def held_pages(cfg: DeepseekV4Config, plan: Plan, *, context: int, new_tokens: int, page_size: int,
               steps_per_call: int) -> dict:
    prompt = context - new_tokens
    req = Request(0, [0] * prompt, SamplingParams(max_new_tokens=new_tokens), (), np.zeros(2, np.uint32))
    growth = steps_per_call * plan.max_accept
    width = pages_needed(context + plan.lookahead, page_size)
    window = window_pages_for(cfg.sliding_window, batch=1, width=width, page_size=page_size,
                              ahead=growth + plan.lookahead, span=cfg.window_span)
    num_pages = width + 1
    entries = tuple(EntryPages(rate=m, batch=1, width=pages_needed(width * page_size // m + 2, page_size),
                               pages_per_shard=entry_pages_for(num_pages, 1, m), page_size=page_size)
                    for m in cfg.entry_rates)
    sched = Scheduler([req], batch=1, width=width, num_pages=num_pages, page_size=page_size, lookahead=plan.lookahead,
                      step_growth=growth, window=window, entries=entries)
    sched.admit()
    seq = np.array([prompt], np.int32)
    while True:
        sched.grant_ahead(seq)
        if seq[0] >= context:
            break
        seq[0] = min(context, seq[0] + growth)
    held = {"window": len(window.allocator.pages_of(0)), "ring": window.ring,
            "entries": [len(e.allocators[0].pages_of(0)) for e in entries], "entry_pages": [e.num_pages for e in entries],
            "window_pages": window.num_pages}
    sched.retire(0, [], [])
    sched.check()
    return held


def page_bytes(pool, page_size: int) -> tuple[int, list[int]]:
    """Bytes of one page of the ring part and of each entry part (all their buffers, every layer)."""
    def per_slot(buffers):
        return sum(int(np.prod(b.shape[:1] + b.shape[2:])) * b.dtype.itemsize for b in buffers if b is not None)
    return per_slot(pool.window.buffers) * page_size, [per_slot(e.buffers) * page_size for e in pool.entries]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[131072, 1048576])
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="MTP chain depth (0: plain decoding only)")
    ap.add_argument("--steps-per-call", type=int, default=8)
    args = ap.parse_args()
    cfg = v4_flash_shape()
    P = args.page_size
    shape = jax.eval_shape(lambda: create_v4_pool(cfg, num_pages=2, page_size=P, dtype=jnp.bfloat16))
    ring_page, entry_page = page_bytes(shape, P)
    mtp = jax.eval_shape(lambda: create_v4_pool(cfg, num_pages=2, page_size=P, dtype=jnp.bfloat16, kinds=(SLIDING,)))
    mtp_page, _ = page_bytes(mtp, P)
    dense = cfg.num_layers * cfg.head_dim * 2  # every layer's K = V row, bf16
    print(f"DeepSeek-V4-Flash shape: {cfg.num_layers} layers ({len(cfg.layers_of(SLIDING))} sliding, "
          f"{cfg.num_csa_layers} CSA at rate {cfg.csa_rate}, {cfg.num_hca_layers} HCA at rate {cfg.hca_rate}), "
          f"one K = V head of {cfg.head_dim}, indexer keys of {cfg.index_head_dim}, window {cfg.sliding_window}; "
          f"bf16; page {P}")
    print(f"bytes per page: ring {ring_page:,} (K = V rows of every layer + compressor inputs of the compressed "
          f"layers), CSA entries {entry_page[0]:,}, HCA entries {entry_page[1]:,}; MTP ring {mtp_page:,}\n")
    print("| context | decode | ring pages | CSA entry pages | HCA entry pages | KV bytes / token | of which ring "
          "| of which entries | every layer's K=V row of every position | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    modes = [("plain", None, None)]
    if args.steps:
        modes.append((f"MTP chain S={args.steps}", V4MtpDraft(model=V4MtpConfig(target=cfg)), SpecConfig.chain(args.steps)))
    for context in args.contexts:
        for name, draft, spec in modes:
            plan = Plan(target=cfg, draft=draft, spec=spec, page_size=P, steps_per_call=args.steps_per_call)
            held = held_pages(cfg, plan, context=context, new_tokens=args.new_tokens, page_size=P,
                              steps_per_call=args.steps_per_call)
            ring = held["window"] * (ring_page + (mtp_page if draft is not None else 0))
            ent = sum(n * b for n, b in zip(held["entries"], entry_page))
            total = (ring + ent) / context
            print(f"| {context:,} | {name} | {held['window']} | {held['entries'][0]} | {held['entries'][1]} | "
                  f"{total:,.0f} | {ring / context:,.0f} | {ent / context:,.0f} | {dense:,} | {dense / total:.1f}x |")


if __name__ == "__main__":
    main()
