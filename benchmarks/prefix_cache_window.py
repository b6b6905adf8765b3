"""Time to first token with the prefix cache on and off for a sliding-window target: a system prompt
asked several questions, one request at a time, as a chat server sees them.

A Mistral-shaped target with random weights (every layer sliding, ``--window``; the demo target's
widths), float32, plain greedy decoding. The same questions, each behind the same ``--prefix``
random tokens, go one call after another to a persistent ``jaxspec.Engine`` with the cache on and to
one without it, alternated. With the cache, the first question caches only its own prompt's end,
the second finds the system prompt's full pages but no window there and writes a checkpoint of it
(``jaxspec.engine.window``), and from the third on every question prefills only its own tokens.
The outputs are checked equal.

    PYTHONPATH=. python benchmarks/prefix_cache_window.py [--prefix 1024] [--questions 8] [--window 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_timing as st  # noqa: E402  (benchmarks/step_timing.py)
import jaxspec as js  # noqa: E402
from jaxspec.model.targets.llama_config import LlamaConfig  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--question", type=int, default=48)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--max-new", type=int, default=16)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--window-cache-pages", type=int, default=None, help="EngineConfig.window_cache_pages")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    d = st.DEMO
    cfg = LlamaConfig(vocab_size=d.vocab_size, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
                      num_layers=d.num_layers, num_heads=d.num_heads, num_kv_heads=d.num_kv_heads,
                      head_dim=d.head_dim, sliding_window=args.window)
    target = st.random_target(cfg, jnp.float32)
    rng = np.random.default_rng(0)
    system = rng.integers(3, cfg.vocab_size, args.prefix).tolist()
    questions = [rng.integers(3, cfg.vocab_size, args.question).tolist() for _ in range(args.questions)]
    sampling = js.SamplingParams(max_new_tokens=args.max_new, stop_token_ids=())
    longest = args.prefix + args.question + args.max_new + 64
    # Room for the system prompt's pages to stay parked while a question runs (4 requests' worth).
    config = dict(page_size=args.page, max_batch=1, max_seq_len=longest, num_pages=4 * -(-longest // args.page) + 1)
    engines = {name: js.Engine(target, engine=js.EngineConfig(**config, prefix_cache=cache,
                                                              window_cache_pages=args.window_cache_pages))
               for name, cache in (("cache off", False), ("cache on", None))}
    # Compiles every program the timed calls run (a prefill with a cached prefix among them): the same
    # flow behind another system prompt.
    other = rng.integers(3, cfg.vocab_size, args.prefix).tolist()
    for eng in engines.values():
        for q in questions[:3]:
            eng.generate([other + q], sampling=sampling, progress=False)
    rows = []
    for i, q in enumerate(questions):
        row = dict(question=i + 1)
        outs = {}
        caches = engines["cache on"].pages.caches
        hits = sum(c.hits for c in caches)
        for name, eng in engines.items():
            t0 = time.perf_counter()
            first = None
            tokens = []
            for ev in eng.generate_stream([system + q], sampling=sampling):
                first = first or time.perf_counter() - t0
                tokens += ev.token_ids
            row[f"{name} ttft_ms"] = first * 1e3
            outs[name] = tokens
        row["equal"] = outs["cache on"] == outs["cache off"]
        row["cached_tokens"] = (sum(c.hits for c in caches) - hits) * args.page
        rows.append(row)
    window = engines["cache on"].pages.window
    print(f"Mistral-shaped random target (demo widths, window {args.window}), float32, page {args.page}: a "
          f"{args.prefix}-token system prompt + {args.question}-token questions, {args.max_new} new tokens each")
    print("| question | cached tokens | time to first token, cache off (ms) | cache on (ms) | ratio | outputs equal |")
    print("|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['question']} | {r['cached_tokens']} | {r['cache off ttft_ms']:.0f} | {r['cache on ttft_ms']:.0f} | "
              f"{r['cache off ttft_ms'] / r['cache on ttft_ms']:.2f}x | {r['equal']} |")
    later = rows[2:]
    if later:
        off = statistics.median(r["cache off ttft_ms"] for r in later)
        on = statistics.median(r["cache on ttft_ms"] for r in later)
        print(f"questions 3-{len(rows)}: median {off:.0f} vs {on:.0f} ms ({off / on:.2f}x); window pages shared "
              f"{window.hits}, checkpoint pages written {window.checkpoints}, evicted "
              f"{sum(a.evictions for a in window.allocators)}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), rows=rows, window_hits=window.hits,
                                                   checkpoints=window.checkpoints), indent=1))
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
