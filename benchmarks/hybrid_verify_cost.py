"""Cost of a tree verify step relative to a plain decode step, for a hybrid target (Gated DeltaNet +
gated attention, Qwen3.5-style) and a dense one (Llama-style) of the same width, depth and heads.

A verify step here is ``verify_and_accept``: the target forward over the tree's n nodes (KV written,
the hybrid's per-node vectors returned pending), greedy acceptance, compaction, and the hybrid's commit
of the accepted path's state. The plain step is the same with the root alone (n = 1). Random weights,
a prefix of ``--context`` committed tokens, float32, medians of ``--repeats`` timed calls after one
warm-up call; the two models are alternated so both see the same machine load.

    PYTHONPATH=. python benchmarks/hybrid_verify_cost.py [--context 512] [--batch 4] [--repeats 15]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec as js
from jaxspec.spec import tree as tree_lib
from jaxspec.spec.plan import Plan, StepRows
from jaxspec.spec.shape import Root, Tree
from jaxspec.spec.step import verify_and_accept
from jaxspec.model.config import RopeConfig
from jaxspec.sampling.controls import Controls
from jaxspec.sampling.distributions import RowSampling
from jaxspec.model.drafts.base import DraftSeed
from jaxspec.sampling.grammar_masks import Grammar, GrammarTable
from jaxspec.model.checkpoints.llama import init_llama_params
from jaxspec.model.checkpoints.hybrid import init_hybrid_params
from jaxspec.model.targets import create_target_pool
from jaxspec.model.targets.llama_config import LlamaConfig
from jaxspec.model.targets.hybrid_config import FULL, LINEAR, GatedDeltaConfig, HybridConfig
from jaxspec.xla_options import compiler_options

H, L, V = 512, 8, 4096


def models():
    hybrid = HybridConfig(vocab_size=V, hidden_size=H, intermediate_size=1536, num_layers=L,
                          layer_types=(LINEAR, LINEAR, LINEAR, FULL) * (L // 4), mlp_types=("dense",) * L,
                          num_heads=8, num_kv_heads=2, head_dim=64, rope=RopeConfig(theta=1e6), rotary_dim=16,
                          gdn=GatedDeltaConfig(num_k_heads=4, num_v_heads=8, head_k_dim=64, head_v_dim=64))
    dense = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=1536, num_layers=L, num_heads=8,
                        num_kv_heads=2, head_dim=64)
    return {"hybrid": (hybrid, init_hybrid_params(hybrid, 0, scale=0.05)),
            "dense": (dense, init_llama_params(dense, jax.random.PRNGKey(0), scale=0.05))}


def step_fn(cfg, params, n: int, batch: int, context: int):
    """A jitted verify step over a random tree of n nodes (n = 1: the root alone) and its inputs."""
    page = 16
    spec = None if n == 1 else js.SpecConfig(num_steps=3, topk=4, num_draft_tokens=n)
    plan = Plan(target=cfg, draft=None if n == 1 else js.NgramDraft().config, spec=spec, page_size=page)
    shape = Root if n == 1 else Tree
    width = -(-(context + n + 1) // page)
    pool = create_target_pool(cfg, num_pages=batch * width + 1, page_size=page, dtype=jnp.float32, rows=batch)
    table = jnp.asarray(1 + np.arange(batch * width, dtype=np.int32).reshape(batch, width))
    rng = np.random.default_rng(0)
    parent = np.asarray([[-1] + [int(rng.integers(0, t)) for t in range(1, n)] for _ in range(batch)], np.int32)
    tree = tree_lib.link_tree(jnp.asarray(rng.integers(0, V, (batch, n)), jnp.int32), jnp.asarray(parent), n)
    rows = StepRows(seq_lens=jnp.full((batch,), context, jnp.int32), bonus=tree.tokens[:, 0],
                    active=jnp.ones((batch,), bool), sampling=RowSampling.empty(batch), controls=Controls.empty(batch, 0),
                    keys=jax.random.split(jax.random.PRNGKey(0), batch), seed=DraftSeed.empty(batch, 1, jnp.float32),
                    grammar=Grammar(table=GrammarTable.empty(), state=jnp.zeros((batch,), jnp.int32),
                                    stop_ids=jnp.full((batch, 1), -1, jnp.int32)))

    @functools.partial(jax.jit, compiler_options=compiler_options())  # the engine's XLA options
    def step(params, pool):
        accept_lens, predict, _, _, pool = verify_and_accept(plan, shape, params, rows, tree, None, pool, table,
                                                             lambda out: None)
        return accept_lens, pool

    return step, params, pool


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--trees", default="8,16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sizes = [1] + [int(x) for x in args.trees.split(",")]
    runs = {}
    for name, (cfg, params) in models().items():
        for n in sizes:
            step, p, pool = step_fn(cfg, params, n, args.batch, args.context)
            jax.block_until_ready(step(p, pool))  # compile
            runs[name, n] = (step, p, pool)
    times = {k: [] for k in runs}
    for _ in range(args.repeats):  # round-robin: every configuration sees the same load
        for k, (step, p, pool) in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(step(p, pool))
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    device = jax.devices()[0].device_kind
    print(f"device: {device}; batch {args.batch}, context {args.context}, {args.repeats} repeats, medians")
    print("| model | plain step ms | " + " | ".join(f"tree n={n}: ms, x plain" for n in sizes[1:]) + " |")
    print("|---|---:|" + "---:|" * (len(sizes) - 1))
    rows = []
    for name in ("dense", "hybrid"):
        base = med[name, 1]
        cells = [f"{med[name, n] * 1e3:.2f}, {med[name, n] / base:.2f}x" for n in sizes[1:]]
        print(f"| {name} | {base * 1e3:.2f} | " + " | ".join(cells) + " |")
        rows.append(dict(model=name, plain_ms=base * 1e3, **{f"tree{n}_ratio": med[name, n] / base for n in sizes[1:]}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, batch=args.batch, context=args.context, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
