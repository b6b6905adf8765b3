"""Independent check of the engine under memory pressure on the demo pair (not run in CI): more
requests than fit, in a small pool with optimistic admission, forced preemption and the prefix cache,
against a large pool that reserves every request's worst case with no cache. Every output must match.

Prompts: held-out stdlib files cut at 24-200 tokens, half of them behind a shared 96-token prefix (so the
cache has something to share); greedy, float32; each draft setup runs both ways:

    PYTHONPATH=. python scripts/check_pressure.py [--requests 24] [--max-new 96] [--pool-share 0.2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import jaxspec as js
from jaxspec.kvcache.paging import pages_needed
from jaxspec.train.corpus import file_prompts, spread_by_package, stdlib_files


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pool-share", type=float, default=0.2, help="small pool: this share of the batch's worst case")
    p.add_argument("--preempt-every", type=int, default=3)
    args = p.parse_args(argv)

    target = js.load_model("demo/target", dtype="float32", progress=False)
    eagle = js.load_draft("demo/eagle3", target)
    dflash = js.load_draft("demo/dflash", target)
    files = spread_by_package(stdlib_files("heldout"))
    rng = np.random.default_rng(0)
    texts = file_prompts(target.tokenizer, files, args.requests + 1, 200)
    shared = texts[-1][:96]
    prompts = [(shared if i % 2 else []) + t[: int(rng.integers(24, 200))] for i, t in enumerate(texts[:-1])]
    sampling = js.SamplingParams(max_new_tokens=args.max_new)
    longest = max(len(q) for q in prompts) + args.max_new
    setups = {
        "plain": (None, None),
        "eagle3 chain 4": (eagle, js.SpecConfig.chain(4)),
        "eagle3 tree 4x2x8": (eagle, js.SpecConfig(num_steps=4, topk=2, num_draft_tokens=8)),
        "dflash chain 7": (dflash, js.SpecConfig.chain(7)),
        "ngram tree 3x3x8": (js.NgramDraft(max_ngram=3), js.SpecConfig(num_steps=3, topk=3, num_draft_tokens=8)),
    }
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
          f"({len(prompts) // 2} behind a shared {len(shared)}-token prefix), {args.max_new} new tokens, "
          f"batch {args.batch}, float32")
    print(f"| setup | small pool (pages) | preemptions | cached tokens | outputs equal | seconds large / small |")
    print("|---|---:|---:|---:|---:|---|")
    bad = 0
    for name, (draft, spec) in setups.items():
        base = dict(page_size=16, max_batch=args.batch, max_seq_len=longest + 80)
        large = js.EngineConfig(**base, admission="reserve", prefix_cache=False)
        t0 = time.perf_counter()
        ref = js.generate(target, prompts, draft=draft, spec=spec, sampling=sampling, engine=large, progress=False)
        t1 = time.perf_counter()
        worst = pages_needed(longest + 80, 16)
        pool = max(int(args.pool_share * args.batch * worst), worst) + 1
        small = js.EngineConfig(**base, num_pages=pool, preempt_every=args.preempt_every, check_pages=True)
        out = js.generate(target, prompts, draft=draft, spec=spec, sampling=sampling, engine=small, progress=False)
        t2 = time.perf_counter()
        equal = sum(a == b for a, b in zip(out.token_ids, ref.token_ids))
        bad += equal != len(prompts)
        print(f"| {name} | {pool - 1} | {sum(s.preemptions for s in out.stats)} | "
              f"{sum(s.cached_tokens for s in out.stats)} | {equal} of {len(prompts)} | {t1 - t0:.1f} / {t2 - t1:.1f} |")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
