"""Throughput of optimistic admission (with preemption) against worst-case reservation, in a pool
a fraction of the batch's worst case, with ``max_new_tokens`` far above what requests generate.

The demo pair (EAGLE-3 chain), held-out stdlib prompts, greedy; each request stops at a stop string
(a blank line, where a code block ends) long before ``--max-new``. Both policies run the same
requests on a persistent ``jaxspec.Engine`` each (warm-up call first: compiles), alternated over
``--repeats`` timed calls; the outputs are checked equal. One line per policy and their ratio.

    PYTHONPATH=. python benchmarks/admission.py [--requests 32] [--batch 16] [--max-new 512] [--pool-share 0.25]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jaxspec as js
from jaxspec.kvcache.paging import pages_needed
from jaxspec.train.corpus import file_prompts, spread_by_package, stdlib_files


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="demo/target")
    p.add_argument("--draft", default="demo/eagle3")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new", type=int, default=512)
    p.add_argument("--stop", default="\n\n", help="stop string that ends a request early")
    p.add_argument("--pool-share", type=float, default=0.25, help="pool size as a share of the batch's worst case")
    p.add_argument("--steps", type=int, default=4, help="EAGLE-3 chain depth")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    target = js.load_model(args.target, progress=False)
    draft = js.load_draft(args.draft, target)
    spec = js.SpecConfig.chain(args.steps)
    prompts = file_prompts(target.tokenizer, spread_by_package(stdlib_files("heldout")), args.requests,
                           args.prompt_tokens)
    sampling = js.SamplingParams(max_new_tokens=args.max_new, stop=(args.stop,) if args.stop else None)
    page, max_seq_len = 16, args.prompt_tokens + args.max_new + 64
    worst = pages_needed(max_seq_len, page)  # a request's worst case (its lookahead included)
    num_pages = max(int(args.pool_share * args.batch * worst), worst) + 1
    engines = {policy: js.Engine(target, draft=draft, spec=spec, engine=js.EngineConfig(
        page_size=page, max_batch=args.batch, max_seq_len=max_seq_len, num_pages=num_pages, admission=policy))
        for policy in ("reserve", "optimistic")}
    print(f"{len(prompts)} requests of {args.prompt_tokens} tokens, max_new_tokens {args.max_new}, stop "
          f"{args.stop!r}; batch {args.batch}; pool {num_pages - 1} pages of {page} = {args.pool_share:g} x the "
          f"batch's worst case ({worst} pages a request)")
    outs, secs = {}, {k: [] for k in engines}
    for policy, eng in engines.items():  # warm-up: compiles
        outs[policy] = eng.generate(prompts, sampling=sampling, progress=False)
    for _ in range(args.repeats):
        for policy, eng in engines.items():
            t0 = time.perf_counter()
            outs[policy] = eng.generate(prompts, sampling=sampling, progress=False)
            secs[policy].append(time.perf_counter() - t0)
    same = outs["reserve"].token_ids == outs["optimistic"].token_ids
    rows = {}
    for policy, out in outs.items():
        tokens = sum(s.num_tokens for s in out.stats)
        t = statistics.median(secs[policy])
        rows[policy] = dict(seconds=t, tokens=tokens, tokens_per_s=tokens / t,
                            preemptions=sum(s.preemptions for s in out.stats),
                            mean_tokens=tokens / len(out.stats), mean_accept=out.mean_accept_len)
        print(f"{policy:>10}: {t:7.2f} s, {tokens} tokens ({tokens / len(out.stats):.0f} a request), "
              f"{tokens / t:7.1f} tok/s, mean accept {out.mean_accept_len:.2f}, {rows[policy]['preemptions']} "
              f"preemptions")
    ratio = rows["optimistic"]["tokens_per_s"] / rows["reserve"]["tokens_per_s"]
    print(f"optimistic / reserve throughput: {ratio:.2f}x; outputs equal: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows, ratio=ratio, outputs_equal=same), f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
