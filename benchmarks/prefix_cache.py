"""Time to first token and total time with the prefix cache on and off, for requests that share a
long prefix (a system prompt or a document asked several questions).

The demo pair (EAGLE-3 chain), ``--requests`` prompts = the same ``--prefix``-token stdlib text + a
distinct ``--tail``-token one, greedy. Each policy runs on a persistent ``jaxspec.Engine``: a warm-up
call (compiles; with the cache on it also leaves the prefix's pages in the cache, as an earlier call
of a serving engine would), then ``--repeats`` timed streamed calls, alternated. Time to first token
is per request, from the call's start to its first streamed event; medians over calls of the mean
over requests. The outputs are checked equal.

``--same-round``: every call (the warm-up and each timed one) has a prefix of its own, so nothing
is cached from an earlier call and the requests of a call share only among themselves (the first
is prefilled, the others wait one round and find its pages); the positions each policy prefilled
are counted on one more call.

    PYTHONPATH=. python benchmarks/prefix_cache.py [--requests 16] [--prefix 1024] [--tail 32] [--same-round]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jaxspec as js
from jaxspec.train.corpus import file_prompts, spread_by_package, stdlib_files


def timed(engine: js.Engine, prompts, sampling) -> tuple[float, float, list[list[int]]]:
    t0 = time.perf_counter()
    first, tokens = {}, [[] for _ in prompts]
    for ev in engine.generate_stream(prompts, sampling=sampling):
        first.setdefault(ev.index, time.perf_counter() - t0)
        tokens[ev.index] += ev.token_ids
    return statistics.mean(first.values()), time.perf_counter() - t0, tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="demo/target")
    p.add_argument("--draft", default="demo/eagle3")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--tail", type=int, default=32)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--steps", type=int, default=4, help="EAGLE-3 chain depth")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", help="the dtype the pair is loaded in")
    p.add_argument("--same-round", action="store_true", help="a new prefix for every call (see above)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    target = js.load_model(args.target, dtype=args.dtype, progress=False)
    draft = js.load_draft(args.draft, target)
    files = spread_by_package(stdlib_files("heldout"))
    calls = args.repeats + 2 if args.same_round else 1  # the warm-up, the timed calls, the count
    prefixes = file_prompts(target.tokenizer, files, calls, args.prefix)
    tails = file_prompts(target.tokenizer, files[calls:], args.requests, args.tail)

    def prompts_of(call: int) -> list[list[int]]:
        return [prefixes[call if args.same_round else 0] + t for t in tails]

    prompts, shared = prompts_of(0), prefixes[0]
    sampling = js.SamplingParams(max_new_tokens=args.max_new)
    config = dict(page_size=16, max_batch=args.requests, max_seq_len=args.prefix + args.tail + args.max_new + 64)
    engines = {name: js.Engine(target, draft=draft, spec=js.SpecConfig.chain(args.steps),
                               engine=js.EngineConfig(**config, prefix_cache=cache))
               for name, cache in (("cache off", False), ("cache on", None))}
    print(f"{len(prompts)} requests: a shared {len(shared)}-token prefix + {args.tail} tokens each, "
          f"{args.max_new} new tokens, batch {args.requests}, page 16, EAGLE-3 chain {args.steps}")
    outs, ttft, total = {}, {k: [] for k in engines}, {k: [] for k in engines}
    for name, eng in engines.items():
        outs[name] = eng.generate(prompts, sampling=sampling, progress=False)  # warm-up
    for r in range(args.repeats):
        for name, eng in engines.items():
            t_first, t_all, tokens = timed(eng, prompts_of(1 + r), sampling)
            ttft[name].append(t_first)
            total[name].append(t_all)
            outs[name] = tokens
    same = outs["cache off"] == outs["cache on"]
    differ = sum(a != b for a, b in zip(outs["cache off"], outs["cache on"]))
    rows = {name: dict(ttft=statistics.median(ttft[name]), total=statistics.median(total[name])) for name in engines}
    if args.same_round:
        counted = {name: eng.generate(prompts_of(calls - 1), sampling=sampling, progress=False).stats
                   for name, eng in engines.items()}
        cached = counted["cache on"][1].cached_tokens  # a follower's
        for name, stats in counted.items():
            print(f"{name:>9}: {sum(s.prefilled_tokens for s in stats)} positions prefilled for "
                  f"{sum(len(q) for q in prompts_of(calls - 1))} prompt tokens")
    else:
        cached = engines["cache on"].generate(prompts[:1], sampling=sampling, progress=False).stats[0].cached_tokens
    for name, row in rows.items():
        print(f"{name:>9}: time to first token {row['ttft'] * 1e3:8.1f} ms, total {row['total']:6.2f} s")
    r_ttft = rows["cache off"]["ttft"] / rows["cache on"]["ttft"]
    r_total = rows["cache off"]["total"] / rows["cache on"]["total"]
    print(f"cache on: {cached} prompt tokens a request from the cache; time to first token {r_ttft:.2f}x "
          f"shorter, total {r_total:.2f}x shorter; outputs equal: {same} ({differ} of {len(prompts)} differ)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows, cached_tokens=cached, outputs_equal=same, differ=differ), f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
