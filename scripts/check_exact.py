"""The exact mode's full matrix in bf16 (not run in CI: ``tests/spec/test_exact.py`` runs a slice of
it): every draft kind the demo ships (EAGLE-3, DFlash, DSpark, P-EAGLE, n-gram, the hybrid of EAGLE-3
and n-gram) on the demo pair with a ragged batch of real prompts, and the two kinds it does not ship
on the test suite's golden checkpoints (an EAGLE-1 head with its Llama target; a PARD draft with the
DFlash goldens' target, ragged token-id prompts); chain and tree, pages 1 and 16, plus forced
preemption and prefix-cache hits. Each speculative run is compared with plain greedy decoding
of the same engine settings, tokens and raw log-probabilities bit for bit, in the exact mode
(``EngineConfig(exact=True)``) and on the default path with the Pallas kernels (the path a GPU runs,
in interpret mode here) for contrast. Prints one markdown table (``benchmarks/RESULTS.md`` keeps it):

    PYTHONPATH=. python scripts/check_exact.py [--max-new 32] [--only eagle3-chain,ngram-tree]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import jax
import numpy as np

import jaxspec as js
from jaxspec.demo import DEMO_DFLASH, DEMO_DRAFT, DEMO_DSPARK, DEMO_PEAGLE, DEMO_TARGET

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "data" / "golden"
# The golden pairs for the kinds the demo does not ship: (target, draft, spec) per method.
GOLDEN_METHODS = {
    "eagle1-tree": ("llama3", "eagle1", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)),
    "pard-chain": ("dflash/target", "pard/pard_llama", js.SpecConfig.chain(4)),
}

PROMPTS = [  # ragged: 9 to 40 tokens with the demo tokenizer
    'def read_lines(path):\n    """Return the lines of a text file."""\n    with open(path) as f:',
    "import os\n\n\ndef walk(root):\n    for dirpath, dirnames, filenames in os.walk(root):",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "x = 1",
]
SHARED = "# Utilities for reading and writing files in the working directory.\nimport json\nimport os\n\n"


def methods(target) -> dict:
    """name -> (draft, spec): every draft kind, chain and tree."""
    eagle = js.load_draft(DEMO_DRAFT, target)
    ngram = js.NgramDraft()
    tree = js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
    return {
        "eagle3-chain": (eagle, js.SpecConfig.chain(4)),
        "eagle3-tree": (eagle, tree),
        "dflash-block": (js.load_draft(DEMO_DFLASH, target), js.SpecConfig.chain(7)),
        "dspark-block": (js.load_draft(DEMO_DSPARK, target), js.SpecConfig.chain(7)),
        "peagle-chain": (js.load_draft(DEMO_PEAGLE, target), js.SpecConfig.chain(4)),
        "ngram-chain": (ngram, js.SpecConfig.chain(4)),
        "ngram-tree": (ngram, js.SpecConfig(num_steps=3, topk=3, num_draft_tokens=8)),
        "hybrid": (js.HybridDraft(eagle, ngram), js.SpecConfig(num_steps=3, topk=1, num_draft_tokens=8,
                                                                ngram_tokens=4)),
    }


def same_bits(a, b) -> bool:
    return a.token_ids == b.token_ids and all(
        np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32)) for x, y in zip(a.logprobs, b.logprobs))


def first_difference(a, b) -> str:
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x != y:
            j = next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return f"row {i} token {j}"
    return "log-probabilities only"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--only", default=None, help="comma-separated method names (default: all): "
                   "eagle3-chain, eagle3-tree, dflash-block, dspark-block, peagle-chain, ngram-chain, ngram-tree, "
                   "hybrid, eagle1-tree, pard-chain")
    p.add_argument("--no-contrast", action="store_true", help="skip the default-path runs")
    args = p.parse_args(argv)

    demo = js.load_model(DEMO_TARGET, dtype="bfloat16", progress=False)
    table = {name: (demo, *pair) for name, pair in methods(demo).items()}
    for name, (tdir, ddir, spec) in GOLDEN_METHODS.items():
        golden = js.load_model(str(GOLDEN / tdir), dtype="bfloat16", progress=False)
        table[name] = (golden, js.load_draft(str(GOLDEN / ddir), golden), spec)
    names = args.only.split(",") if args.only else list(table)
    if unknown := set(names) - set(table):
        p.error(f"unknown methods {sorted(unknown)}; choose from {list(table)}")
    sampling = js.SamplingParams(max_new_tokens=args.max_new, logprobs=2)
    rng = np.random.default_rng(0)
    golden_prompts = [rng.integers(3, 250, n).tolist() for n in (9, 31, 4, 22)]  # ragged token ids
    golden_shared = [rng.integers(3, 250, 17).tolist() + q for q in golden_prompts]
    inputs = {id(demo): ([demo.tokenizer.encode(t) for t in PROMPTS],
                         [demo.tokenizer.encode(SHARED + t) for t in PROMPTS])}
    for target, _, _ in table.values():
        inputs.setdefault(id(target), (golden_prompts, golden_shared))
    prompts = inputs[id(demo)][0]
    print(f"bf16; the demo pair's {len(prompts)} prompts of {sorted(map(len, prompts))} tokens, the golden "
          f"pairs' {sorted(map(len, golden_prompts))} token ids; {args.max_new} new tokens, greedy, "
          f"log-probabilities compared as float32 bits")
    print("| method | page | variant | exact: spec == plain | default (Pallas kernels): spec == plain | seconds exact / default |")
    print("|---|---:|---|---|---|---|")
    bad = 0
    plain_cache: dict = {}
    for name in names:
        target, draft, spec = table[name]
        prompts, shared = inputs[id(target)]
        for page in (1, 16):
            for variant in ("", "preempt", "prefix cache"):
                if variant and page == 1:
                    continue  # the variants at page 16 only: they change the pages, not the kernels
                row = [name, str(page), variant or "-"]
                times = []
                for exact in (True, False):
                    if not exact and args.no_contrast:
                        row.append("not run")
                        continue
                    preempt = variant == "preempt"  # every call, calls of 2 steps: several per request
                    cfg = js.EngineConfig(page_size=page, max_batch=4, max_seq_len=256, steps_per_call=2 if preempt else 4,
                                          exact=exact, implementation=None if exact else "pallas",
                                          preempt_every=1 if preempt else 0)
                    ps = shared if variant == "prefix cache" else prompts
                    key = (id(target), page, exact, variant == "prefix cache", cfg.steps_per_call)
                    if key not in plain_cache:
                        plain_cache[key] = js.generate(target, ps, sampling=sampling,
                                                       engine=dataclasses.replace(cfg, prefix_cache=False,
                                                                                  preempt_every=0), progress=False)
                    t0 = time.perf_counter()
                    if variant == "prefix cache":  # a second call finds the first one's prompt pages
                        engine = js.Engine(target, draft=draft, spec=spec, engine=dataclasses.replace(cfg, prefix_cache=True))
                        engine.generate(ps[:1], sampling=sampling)
                        out = engine.generate(ps, sampling=sampling)
                        assert sum(s.cached_tokens for s in out.stats) > 0, "no prefix-cache hit"
                    else:
                        out = js.generate(target, ps, draft=draft, spec=spec, sampling=sampling, engine=cfg,
                                          progress=False)
                    if variant == "preempt":
                        assert sum(s.preemptions for s in out.stats) > 0, "no preemption"
                    times.append(time.perf_counter() - t0)
                    ok = same_bits(out, plain_cache[key])
                    row.append("equal" if ok else f"differs ({first_difference(out, plain_cache[key])})")
                    bad += exact and not ok
                row.append(" / ".join(f"{t:.1f}" for t in times))
                print("| " + " | ".join(row) + " |", flush=True)
        # Each method compiles its own programs; dropping them keeps the process under the kernel's
        # limit on memory mappings (a run of every method otherwise fails in LLVM with ENOMEM).
        jax.clear_caches()
    print(f"exact mode: {'every run equal' if not bad else f'{bad} run(s) differ'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
