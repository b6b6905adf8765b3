"""Per-step device time of plain decoding and of speculative steps, against the HBM roofline.

Builds random bf16 models of real shapes on the device (no download): a Llama-3-8B-shaped
target, an EAGLE-3-shaped head and a DFlash block draft (5 layers, block 16) for it. Times ``decode_program`` (K steps per executable
call, block_until_ready, medians over repeats after warm-up) and reports per-step times, the
batch-1 decode tokens/s, and the roofline ``weight bytes / HBM bandwidth``.

    python benchmarks/step_timing.py --out results.json            # on a GPU machine
    python benchmarks/step_timing.py --tiny                        # smoke test anywhere
    python benchmarks/step_timing.py --xla-options command_buffer_loops   # a candidate over the table

The programs compile with jaxspec's XLA options for the backend (``jaxspec.xla_options.TABLE``);
``--xla-options`` times them with none (``none``) or with a named candidate merged over the table.

Timings are only meaningful on a GPU; record them in benchmarks/RESULTS.md with the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec as js
from jaxspec.config import MAX_LOGPROBS
from jaxspec.engine.prefill import request_arrays
from jaxspec.engine.programs import decode_program, prefill_program
from jaxspec.spec.plan import Plan
from jaxspec.engine.state import DecodeState
from jaxspec.engine.geometry import next_pow2
from jaxspec.kvcache.paging import pages_needed
from jaxspec.model.config import RopeConfig
from jaxspec.model.drafts.base import zero_pool
from jaxspec.model.drafts.dflash import dflash_config_for, dflash_draft
from jaxspec.model.drafts.eagle import eagle3_config_for, eagle_draft
from jaxspec.model.checkpoints.dflash import dflash_table, shared_target_params
from jaxspec.model.checkpoints.eagle import eagle_table
from jaxspec.model.checkpoints.llama import llama_table
from jaxspec.model.checkpoints.name_tables import init_params
from jaxspec.model.targets import Model, create_target_pool
from jaxspec.model.targets.llama_config import LlamaConfig
from jaxspec.xla_options import CANDIDATES, normalize_options, program_backend, resolve_options

# --constraint: every row writes records of this schema (as JSON lines, so rows keep generating).
TIMING_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "size": {"type": "integer", "minimum": 0, "maximum": 10000},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "size"], "additionalProperties": False}



def timing_grammar(tokenizer_path: str | None, vocab_size: int):
    """Rows writing JSON lines of TIMING_SCHEMA records, one after another: a realistic table that
    never reaches a complete match nothing may extend (timed rows must keep generating)."""
    import re

    from jaxspec.demo import DEMO_TARGET
    from jaxspec.model.checkpoints.tokenizer import load_tokenizer
    from jaxspec.structured.automaton import compile_automaton, join_automata
    from jaxspec.structured.regex import compile_dfa
    from jaxspec.structured.schema import schema_regex

    tok = load_tokenizer(tokenizer_path or DEMO_TARGET)
    regex, splices = schema_regex(json.dumps(TIMING_SCHEMA))
    dfa = compile_dfa(f"(?:{regex}\n)+", re.ASCII, splices)
    return join_automata([compile_automaton(dfa, tok.token_bytes, vocab_size, first_bytes=tok.first_token_bytes)],
                         vocab_size)


# Datasheet HBM bandwidths, bytes/s (docs/architecture.md#measuring-performance).
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}

LLAMA3_8B = LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
    rope=RopeConfig(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192),
)
TINY = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=16)
# The shipped demo target's shape (demo/target/config.json).
DEMO = LlamaConfig(vocab_size=4096, hidden_size=192, intermediate_size=512, num_layers=8, num_heads=3,
                   num_kv_heads=1, head_dim=64)
SHAPES = {"llama3-8b": LLAMA3_8B, "demo": DEMO, "tiny": TINY}


def device_bandwidth() -> tuple[str, float | None]:
    kind = jax.devices()[0].device_kind
    for name, bw in BANDWIDTH.items():
        if name in kind:
            return kind, bw
    return kind, None


def param_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def time_steps(target: Model, draft, spec, batch: int, context: int, steps: int, repeats: int,
               implementation=None, controls: bool = False, temperature: float = 0.0,
               compiler_options=None) -> float:
    """Median seconds per decode step (one speculative or one plain step). ``controls``: every row
    with a logit bias (64 tokens), repetition / presence / frequency penalties, min-p and 20 top
    log-probabilities per token; ``temperature`` > 0 samples; ``compiler_options``: as
    ``EngineConfig.compiler_options`` (None: the table)."""
    call = prepare(target, draft, spec, batch, context, steps, repeats, implementation, controls, temperature,
                   compiler_options=compiler_options)
    call()  # compiles
    return statistics.median(call() for _ in range(repeats))


def time_controls_pair(target: Model, draft, spec, batch: int, context: int, steps: int, repeats: int,
                       implementation=None, temperature: float = 0.0, grammars=None,
                       compiler_options=None, general: bool = False) -> tuple[float, float]:
    """Median seconds per step with every control off and on, the two calls alternated so both
    see the same machine load. ``grammars``: compare no constraint with every row constrained by
    this ``GrammarSet``'s first automaton instead of the controls. ``general``: compare the plan
    these rows need with the serve core's general plan (sampling, filtering, controls and 20
    logprobs compiled in; the rows themselves unchanged)."""
    off, on = (prepare(target, draft, spec, batch, context, steps, repeats, implementation,
                       c and grammars is None and not general, temperature, grammars if c else None,
                       compiler_options, general=c and general)
               for c in (False, True))
    off(), on()  # compile
    times = [(off(), on()) for _ in range(repeats)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def prepare(target: Model, draft, spec, batch: int, context: int, steps: int, repeats: int, implementation,
            controls: bool, temperature: float, grammars=None, compiler_options=None, general: bool = False):
    """Prefilled state and pools for ``time_steps``; returns a function running one decode call
    (``steps`` steps) and returning its seconds per step. ``grammars``: a ``GrammarSet`` whose
    first automaton constrains every row. ``compiler_options``: as ``EngineConfig.compiler_options``
    (None: the table for the backend). ``general``: the serve core's plan (every flag on) over
    rows that use none of it."""
    page = 16
    V = target.config.vocab_size
    plan = Plan(target=target.config, draft=None if draft is None else draft.config, spec=spec, page_size=page,
                steps_per_call=steps, implementation=implementation,
                greedy_only=temperature == 0 and not general, filtering=general,
                controls=controls or general,
                logprobs=min(MAX_LOGPROBS, V) if controls or general else None,
                compiler_options=resolve_options(normalize_options(compiler_options), program_backend()))
    controls_width = V if controls or general else 0
    max_pos = context + (repeats + 2) * steps * plan.max_accept + plan.lookahead
    width = next_pow2(pages_needed(max_pos, page))
    num_pages = batch * width + 1
    dtype = jnp.dtype(target.dtype)
    tpool = create_target_pool(target.config, num_pages=num_pages, page_size=page, dtype=dtype)
    dpool = zero_pool(page, dtype) if draft is None else draft.config.create_pool(num_pages=num_pages, page_size=page, dtype=dtype)
    dparams = None if draft is None else draft.params
    out_width = next_pow2((repeats + 2) * steps * plan.max_accept + 2)
    seed = None if draft is None else draft.config.empty_seed(batch, dtype=dtype, max_len=width * page)
    state = DecodeState.empty(batch=batch, out_width=out_width, num_stop=1, seed=seed, hidden_dtype=dtype,
                              control_vocab=controls_width, top_logprobs=plan.logprobs,
                              grammar_table=None if grammars is None else grammars.device_table())
    table = (1 + np.arange(batch * width, dtype=np.int32)).reshape(batch, width)
    table = jnp.asarray(table)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, target.config.vocab_size, (batch, next_pow2(context + 1))), jnp.int32)
    req = request_arrays(batch, max_new=out_width - plan.max_accept, control_vocab=controls_width)
    req["sampling"].temperature[:] = temperature
    if grammars is not None:
        req["grammar"][:] = grammars.initial(0)
    if controls:
        req["repetition_penalty"][:], req["presence_penalty"][:], req["frequency_penalty"][:] = 1.2, 0.5, 0.5
        req["sampling"].min_p[:] = 0.05
        for row in req["logit_bias"]:
            row[rng.choice(V, 64, replace=False)] = rng.normal(0, 2, 64)
    state, tpool, dpool = prefill_program(plan, target.params, dparams, state, tpool, dpool, table,
                                          jnp.arange(batch, dtype=jnp.int32), tokens,
                                          jnp.full((batch,), context, jnp.int32), req)
    held = [state, tpool, dpool]

    def call() -> float:
        jax.block_until_ready(held)
        t = time.perf_counter()
        *held[:], n = decode_program(plan, target.params, dparams, *held, table)
        jax.block_until_ready(held)
        return (time.perf_counter() - t) / max(int(n), 1)

    return call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16, help="steps per executable call")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--implementation", default=None, choices=[None, "pallas", "xla"])
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="model shapes (default llama3-8b)")
    ap.add_argument("--controls", action="store_true",
                    help="time every config again with all generation controls on (bias, penalties, min-p, "
                         "20 logprobs) and print the on / off ratio")
    ap.add_argument("--constraint", action="store_true",
                    help="time every config again with every row under a JSON-schema constraint (structured "
                         "output) and print the on / off ratio")
    ap.add_argument("--general", action="store_true",
                    help="time every config again under the serve core's general plan (sampling, top-k / top-p "
                         "sorts, controls, 20 logprobs compiled in) with the same rows, and print the ratio")
    ap.add_argument("--tokenizer", default=None,
                    help="with --constraint: the tokenizer.json whose vocabulary the automaton is built over "
                         "(default: the demo's; its vocabulary must cover the shape's)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy rows; > 0: sampled rows")
    ap.add_argument("--xla-options", default="table", choices=["table", "none", *CANDIDATES],
                    help="XLA options of the programs: jaxspec's table for the backend, none, or a named "
                         "candidate of jaxspec.xla_options merged over the table")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    options = {"table": None, "none": False}.get(args.xla_options, CANDIDATES.get(args.xla_options))

    shape = args.shape or ("tiny" if args.tiny else "llama3-8b")
    cfg = SHAPES[shape]
    dtype = jnp.bfloat16 if shape == "llama3-8b" else jnp.float32
    print(f"building random {shape}-shaped target, EAGLE-3 head and DFlash draft...", file=sys.stderr)
    params = init_params(llama_table(cfg), 0, dtype=dtype, on_device=True)
    target = Model(config=cfg, params=params, dtype=np.dtype(dtype))
    ecfg = eagle3_config_for(cfg, draft_vocab_size=min(32000, cfg.vocab_size))
    draft = eagle_draft(ecfg, dict(init_params(eagle_table(ecfg), 1, dtype=dtype, on_device=True), embed=params["embed"]))
    fcfg = dflash_config_for(cfg, num_layers=5 if shape == "llama3-8b" else 2, block_size=16,
                             mask_token_id=cfg.vocab_size - 1)
    dflash = dflash_draft(fcfg, shared_target_params(init_params(dflash_table(fcfg), 2, dtype=dtype, on_device=True),
                                                     params))
    kind, bw = device_bandwidth()
    wbytes = param_bytes(params)
    results = {"device": kind, "shape": shape, "weight_bytes": wbytes, "bandwidth": bw, "context": args.context,
               "temperature": args.temperature, "xla_options": args.xla_options,
               "compiler_options": dict(resolve_options(normalize_options(options), program_backend())), "rows": []}
    grammars = None
    if args.constraint:
        grammars = timing_grammar(args.tokenizer, cfg.vocab_size)
    specs = [("plain", None, None), ("chain S=5", js.SpecConfig.chain(5), draft),
             ("tree S=5 k=4 n=8", js.SpecConfig(num_steps=5, topk=4, num_draft_tokens=8), draft),
             ("dflash chain S=15 (block 16)", js.SpecConfig.chain(15), dflash)]
    print("| device | batch | config | ms/step | vs plain step | batch-1 roofline ms |")
    print("|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batches.split(",")]:
        plain = None
        for name, spec, d in specs:
            if args.controls or args.constraint or args.general:
                secs = time_controls_pair(target, d, spec, batch, args.context, args.steps, args.repeats,
                                          args.implementation, args.temperature, grammars, options, args.general)
            else:
                secs = (time_steps(target, d, spec, batch, args.context, args.steps, args.repeats,
                                   args.implementation, temperature=args.temperature, compiler_options=options),)
            plain = plain or secs[0]
            roof = wbytes / bw * 1e3 if bw else float("nan")
            for j, sec in enumerate(secs):
                on = " + constraint" if grammars is not None else " + general plan" if args.general else " + controls"
                config = name + (on if j else "")
                label = config + (f" ({sec / secs[0]:.3f}x of off)" if j else "")
                row = dict(batch=batch, config=config, ms_per_step=sec * 1e3, ratio_to_plain=sec / plain,
                           roofline_ms=roof)
                if j:
                    row["controls_on_vs_off"] = sec / secs[0]
                results["rows"].append(row)
                print(f"| {kind} | {batch} | {label} | {sec * 1e3:.3f} | {sec / plain:.2f}x | {roof:.3f} |",
                      flush=True)
    if bw:
        plain1 = next(r for r in results["rows"] if r["batch"] == 1 and r["config"] == "plain") if any(
            r["batch"] == 1 for r in results["rows"]) else None
        if plain1:
            print(f"batch-1 decode: {1e3 / plain1['ms_per_step']:.1f} tok/s; roofline {bw / wbytes:.1f} tok/s "
                  f"({plain1['roofline_ms'] / plain1['ms_per_step'] * 100:.0f}% of the bound)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
