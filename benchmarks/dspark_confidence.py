"""DSpark's confidence-scheduled verification against verifying the whole block, in one run.

    PYTHONPATH=. python benchmarks/dspark_confidence.py                        # the golden drafts
    PYTHONPATH=. python benchmarks/dspark_confidence.py --target demo/target --draft demo/dspark \\
        --chain 7 --thresholds 0.3,0.5,0.7                                       # the demo pair

For every draft: plain decoding, the whole chain (``SpecConfig.chain(S)``) and the chain verified per
request as far as the confidence head predicts (``confidence_threshold`` c, for each c), over the same
prompts and batch sizes, greedy, exactly ``--new-tokens`` tokens per request. Reports the mean accept
length, the tokens verified per request per step (the root included), the time of one step and
tokens/s, with the step time and tokens/s as ratios to the whole chain's in the same run (``jaxspec
bench``'s ``run_sweep``: warm-up, then rounds over the configurations, medians).

Prompts: with a tokenizer, held-out stdlib files (as ``jaxspec bench``); without one (the golden
target), the golden drafts' own prompts and random ones.
"""

from __future__ import annotations

import argparse
import json
import os
import random

import jaxspec as js
from jaxspec.bench import device_name, parse_config, run_sweep

GOLDEN = "tests/data/golden/dspark"
GOLDEN_DRAFTS = ("dspark_vanilla", "dspark_rnn", "dspark_gated_dv")


def golden_prompts(count: int, seed: int = 0) -> list[list[int]]:
    with open(os.path.join(GOLDEN, "manifest.json")) as f:
        cases = json.load(f)["cases"]
    prompts = [p for c in cases for p in c["prompts"]]
    rng = random.Random(seed)
    while len(prompts) < count:
        prompts.append([rng.randrange(255) for _ in range(rng.randint(5, 17))])
    return prompts[:count]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="tests/data/golden/dflash/target")
    ap.add_argument("--draft", action="append", help="DSpark draft directories (default: the golden drafts)")
    ap.add_argument("--chain", type=int, default=None, help="S (default: each draft's num_speculative_tokens)")
    ap.add_argument("--thresholds", default="0.3,0.5,0.7")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/dspark_confidence.json")
    args = ap.parse_args()
    target = js.load_model(args.target, dtype="float32", progress=False)
    drafts = args.draft or [os.path.join(GOLDEN, n) for n in GOLDEN_DRAFTS]
    batches = [int(b) for b in args.batches.split(",")]
    if target.tokenizer is not None:
        from jaxspec.bench import load_prompts

        prompts = load_prompts(argparse.Namespace(batches=batches, prompts="stdlib", num_prompts=16,
                                                  prompt_tokens=64, ext=".py"), target.tokenizer)
    else:
        prompts = golden_prompts(max(batches))
    named = {os.path.basename(d.rstrip("/")): js.load_draft(d, target) for d in drafts}
    configs = [parse_config("plain")]
    for name, d in named.items():
        S = args.chain or d.config.model.num_speculative_tokens
        configs.append(parse_config(f"{name}:chain{S}"))
        configs += [parse_config(f"{name}:chain{S}c{c}") for c in args.thresholds.split(",")]
    rows = run_sweep(target, named, prompts, configs, batches, max_new_tokens=args.new_tokens, repeats=args.repeats)
    print(f"device {device_name()}; {args.new_tokens} new tokens, greedy, {args.repeats} repeats")
    head = (f"{'config':<32}{'batch':>6}{'accept':>8}{'verified':>10}{'ms/step':>9}{'step vs whole':>15}"
            f"{'tokens/s':>10}{'vs whole':>10}")
    print(head + "\n" + "-" * len(head))
    whole = {}
    for r in rows:
        if r.get("confidence") is None and r["draft"]:
            whole[(r["batch"], r["draft"])] = r
    for r in rows:
        w = whole.get((r["batch"], r["draft"]))
        step = f"{r['ms_per_step'] / w['ms_per_step']:.2f}x" if w else "-"
        tps = f"{r['tokens_per_s'] / w['tokens_per_s']:.2f}x" if w else "-"
        print(f"{r['config']:<32}{r['batch']:>6}{r['mean_accept_len']:>8.2f}{r['mean_verified']:>10.2f}"
              f"{r['ms_per_step']:>9.1f}{step:>15}{r['tokens_per_s']:>10.1f}{tps:>10}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=device_name(), target=args.target, drafts=drafts, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
