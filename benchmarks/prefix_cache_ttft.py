"""Time to first token with the prefix cache on and off for a target whose state is not plain paged
KV: a system prompt asked several questions, one request at a time, as a chat server sees them.

``--family window``: a Mistral-shaped target with random weights (every layer sliding, ``--window``;
the demo target's widths). ``--family recurrent``: a Qwen3.5-shaped hybrid (3 Gated DeltaNet layers
then one gated full-attention layer, twice; the demo's hidden width). ``--family compressed``: a
DeepSeek-V4-shaped target at V4-Flash's rates and window (CSA 4, HCA 128, window 128; two sliding
layers then CSA and HCA alternating, six layers, toy widths). Float32, plain greedy decoding.
The same questions, each behind the same ``--prefix`` random tokens, go one call after another to a persistent ``jaxspec.Engine`` with the cache on and to one without it, alternated.
With the cache, the first question caches only its own prompt's end, the second finds the system
prompt's full pages but no window (no snapshot) there and writes a checkpoint of it
(``jaxspec.engine.window``, ``jaxspec.engine.snapshots``), and from the third on every question
prefills only its own tokens. The outputs are checked equal.

    PYTHONPATH=. python benchmarks/prefix_cache_ttft.py --family window|recurrent|compressed [--prefix 1024]

``--bytes`` prints instead, by host arithmetic alone, what a recurrent-state snapshot holds at real
Qwen3.5 shapes next to the full-attention KV of the prefix it stands for.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from jaxspec.model.config import RopeConfig  # noqa: E402
from jaxspec.model.targets.hybrid_config import FULL, LINEAR, GatedDeltaConfig, HybridConfig  # noqa: E402
from jaxspec.model.targets.llama_config import LlamaConfig  # noqa: E402


def real_config(family: str, window: int):
    """Published shapes (``--real``, for a GPU): Llama-3-8B's with a sliding window on every layer (a
    Mistral-7B-like target), Qwen3.5-9B's, and DeepSeek-V4-Flash's layer kinds and widths with 10
    layers and 32 experts (``benchmarks/step_timing.py``)."""
    if family == "window":
        return dataclasses.replace(st.LLAMA3_8B, sliding_window=window)
    if family == "recurrent":
        return dataclasses.replace(st.qwen35_shape(), mtp_layers=0)
    return st.v4_shape()


def target_config(family: str, window: int):
    d = st.DEMO
    if family == "compressed":
        return dataclasses.replace(st.v4_shape(tiny=True, layers=6), vocab_size=d.vocab_size, csa_rate=4, hca_rate=128,
                                   sliding_window=128, index_topk=64)
    if family == "window":
        return LlamaConfig(vocab_size=d.vocab_size, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
                           num_layers=d.num_layers, num_heads=d.num_heads, num_kv_heads=d.num_kv_heads,
                           head_dim=d.head_dim, sliding_window=window)
    return HybridConfig(vocab_size=d.vocab_size, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
                        num_layers=8, layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 2, mlp_types=("dense",) * 8,
                        num_heads=4, num_kv_heads=1, head_dim=64, rope=RopeConfig(theta=1e7), rotary_dim=16,
                        gdn=GatedDeltaConfig(num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=("window", "recurrent", "compressed"), default="window")
    p.add_argument("--bytes", action="store_true", help="snapshot bytes at real shapes (no model is run)")
    p.add_argument("--real", action="store_true", help="published shapes in bfloat16 (a GPU's work)")
    p.add_argument("--profile", action="store_true",
                   help="also the device kernels of one prefill that hits nothing, cache on and off (GPU)")
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--question", type=int, default=48)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--max-new", type=int, default=16)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--window-cache-pages", type=int, default=None, help="EngineConfig.window_cache_pages")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.bytes:
        return snapshot_bytes(args.prefix)

    cfg = (real_config if args.real else target_config)(args.family, args.window)
    target = st.random_target(cfg, jnp.bfloat16 if args.real else jnp.float32)
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
    pools = engines["cache on"].pages
    if args.family == "window":
        what = f"Mistral-shaped random target (demo widths, window {args.window})"
        shared = dict(window_hits=pools.window.hits, checkpoints=pools.window.checkpoints,
                      evicted=sum(a.evictions for a in pools.window.allocators))
    elif args.family == "recurrent":
        what = "Qwen3.5-shaped random hybrid (8 layers: 3 Gated DeltaNet + 1 full attention, twice; demo widths)"
        shared = dict(snapshot_hits=pools.snapshots.hits, snapshots_written=pools.snapshots.written,
                      evicted=sum(a.evictions for a in pools.snapshots.allocators))
    else:
        what = "DeepSeek-V4-shaped random target (6 layers, CSA rate 4, HCA rate 128, window 128; toy widths)"
        shared = dict(window_hits=pools.window.hits, checkpoints=pools.window.checkpoints,
                      entry_pages_shared=[e.hits for e in pools.entries], entry_pages_copied=[e.copies for e in pools.entries])
    if args.real:
        what = {"window": f"Llama-3-8B-shaped random target, every layer sliding (window {args.window})",
                "recurrent": "Qwen3.5-9B-shaped random hybrid",
                "compressed": "DeepSeek-V4-Flash-shaped random target (10 layers, 32 experts)"}[args.family]
    print(f"{what}, {'bfloat16' if args.real else 'float32'}, page {args.page}: a {args.prefix}-token system prompt + {args.question}-token "
          f"questions, {args.max_new} new tokens each")
    print("| question | cached tokens | time to first token, cache off (ms) | cache on (ms) | ratio | outputs equal |")
    print("|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['question']} | {r['cached_tokens']} | {r['cache off ttft_ms']:.0f} | {r['cache on ttft_ms']:.0f} | "
              f"{r['cache off ttft_ms'] / r['cache on ttft_ms']:.2f}x | {r['equal']} |")
    later = rows[2:]
    if later:
        off = statistics.median(r["cache off ttft_ms"] for r in later)
        on = statistics.median(r["cache on ttft_ms"] for r in later)
        print(f"questions 3-{len(rows)}: median {off:.0f} vs {on:.0f} ms ({off / on:.2f}x); "
              + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in shared.items()))
    profiles = {}
    if args.profile:  # a new system prompt: a prefill with nothing to hit, as question 1's
        import kernel_trace  # noqa: PLC0415  (benchmarks/kernel_trace.py)

        fresh = rng.integers(3, cfg.vocab_size, args.prefix).tolist() + questions[0]
        one = js.SamplingParams(max_new_tokens=1, stop_token_ids=())
        for name, eng in engines.items():
            eng.generate([fresh[::-1]], sampling=one, progress=False)  # same shapes, compiled
            profiles[name] = kernel_trace.trace_kernels(
                lambda eng=eng: eng.generate([fresh], sampling=one, progress=False), steps=1)
            top = ", ".join(f"{k['name'][:40]} {k['us_per_step']:.0f} us x{k['calls_per_step']:.0f}"
                            for k in profiles[name]["top"][:8])
            busy = profiles[name]["busy_us_per_step"]
            print(f"{name}: " + ("no device kernels in the trace (a CPU)" if busy is None else
                                 f"busy {busy / 1e3:.1f} ms; {top}"))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), rows=rows, profiles=profiles, **shared), indent=1))
    return 0 if all(r["equal"] for r in rows) else 1


# Qwen3.5 at two published sizes: (layers, Gated DeltaNet key heads, value heads, key / value width, conv
# kernel, full-attention KV heads, their width). Every fourth layer is full attention.
QWEN35 = {"Qwen3.5-9B": (32, 16, 32, 128, 4, 4, 256), "Qwen3.5-27B": (64, 16, 48, 128, 4, 4, 256)}


def snapshot_bytes(prefix: int) -> int:
    """A snapshot (every linear layer's f32 state and bf16 conv inputs) against the bf16 K/V its
    full-attention layers keep for a ``prefix``-token prompt."""
    print(f"| shape | snapshot (MiB) | full-attention KV of {prefix} tokens (MiB) | ratio | KV tokens a snapshot weighs |")
    print("|---|---:|---:|---:|---:|")
    for name, (layers, hk, hv, d, k, kv_heads, head_dim) in QWEN35.items():
        linear, full = layers * 3 // 4, layers // 4
        state = linear * hv * d * d * 4
        conv = linear * (hk * 2 * d + hv * d) * (k - 1) * 2
        per_token = full * 2 * kv_heads * head_dim * 2
        snap = state + conv
        print(f"| {name} | {snap / 2**20:.1f} | {per_token * prefix / 2**20:.1f} | {snap / (per_token * prefix):.2f}x | "
              f"{snap // per_token} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
