"""The GPU check: decode-step times at real model shapes against the HBM bound, the speculative
methods' cost relative to a plain step, XLA option variants, the demo pair end to end, and the Pallas
kernels against XLA and their floors, in two calls of under 8 minutes each on a fresh H100 or H200
(compilation included), from a checkout without network.

How to run it
-------------
Where pip works (here), once: ``scripts/gpu_wheels.sh`` fills the git-ignored ``.whl/`` with the
wheels the GPU machine lacks (outlines-core, jsonschema and its dependencies, about 3 MB). On the GPU
machine, from the checkout's root, with ``.whl`` carried along (``$OUT``: the folder whose files come
back; the check writes there itself, so a run killed by its timeout still leaves its table):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit; timeout -k 10 480 python3 benchmarks/gpu_check.py --call 1 --out $OUT 2>&1 | tee $OUT/log.txt

and the same line with ``--call 2`` for the second call (give the machine's command a limit of 540 s
or more). Without the wheels: ``PYTHONPATH=. python3 benchmarks/gpu_check.py --call 1 --out OUT``
(the JSON-schema constraint item then skips and says so). ``--dry-run`` runs every item of the
calls it is given at tiny shapes, Pallas in interpret mode, on any machine (the test suite runs
``--dry-run --call 1,2``: ``tests/pallas/test_gpu_check.py``); ``--items a,b`` runs chosen items
instead of a call's list (e.g. ``--items pytest,sweep`` in a later session).

What each call measures, in priority order
------------------------------------------
Each call works through its items in order and stops starting new work when its deadline
(``--deadline-minutes``, default 7.5) is near, skipping what would not finish, so a partial table
always comes back (in call 1 the items before ``compare`` leave it 100 s). After every timed row it
rewrites ``OUT/gpu_check.json`` (every number, with what was timed and with which XLA options, and how
long its compile and first call took) and ``OUT/gpu_check.md``; at the end it prints the Markdown. A
row that fails is recorded with its error and the item goes on. Compiled programs are kept in
``/tmp/jaxspec-jax-cache`` (a second call on the same machine reuses them and XLA's autotuning).

Call 1:
  env          Python, jax / jaxlib / CUDA plugin / triton / torch versions, the device, nvidia-smi.
  copy         device-to-device copy bandwidth: a 1 GiB bf16 array read and written 20 times in one
               program, median of 5 (bytes read + written over time): the bandwidth of every bound.
  plain        the Llama-3-8B shape (random bf16 weights; 32 layers, hidden 4096, 32 / 8 heads, MLP
               14336, vocabulary 128256), context 1024: the engine's decode program, ms per plain step
               at batch 1 and 16, and its bound: weights read (all but the embedding table) plus KV
               read, over the measured copy bandwidth and over the datasheet's (H200 4.8 TB/s, H100
               3.35), with the step's share of each.
  copies       the optimized HLO of the 8B decode program at batch 1 (``OUT/decode_b1.hlo.txt.gz``):
               every instruction that materializes a layer's slice of a stacked weight, a whole stacked
               weight or a whole KV-pool array (``benchmarks/hlo_copies.py``), counted per array.
  spec_b1, spec_b16
               at batch 1, then 16: per-step time of EAGLE-3 chain 5, EAGLE-3 tree S=5 k=4 n=8,
               DFlash block 16 (chain 15), DSpark chain 8 and n-gram chain 5, each as a ratio to the
               plain step of its batch, each verifying its whole tree every step (printed: nodes
               verified per step); random drafts at their published shapes
               (``benchmarks/step_timing.py``). Each row's bound adds the draft weights the step
               reads (``step_timing.draft_weight_bytes_read``: EAGLE-3 reads its layer and head once
               per draft step), and ``floor vs plain`` is that bound over the plain step's: the
               least ratio a step at the bandwidth bound could show.
  profile      where the time goes: the device kernels of the plain step at batch 1 and 16 and of
               EAGLE-3 chain 5 at batch 1, from JAX's profiler (``benchmarks/kernel_trace.py``): per
               step the device's busy time against the wall time, the time per kernel class (the
               products, paged attention, XLA fusions, copies) and the heaviest kernels by name; also
               EAGLE-3 at batch 16 and n-gram chain 5 at batch 16 (in a dry run, the first two); the
               traces kept as ``OUT/trace_*.json.gz`` (they open in Perfetto).
  variants_b1  the plain step at batch 1 compiled with XLA options (``VARIANTS``): none; cuBLAS
               instead of Triton GEMM fusions; that plus command buffers (CUDA graphs) over WHILE and
               CONDITIONAL too; that plus dynamic-slice fusion; the XLA attention path instead of
               Pallas under cuBLAS; the engine's options with RoPE, the K/V write and the norms on
               XLA (ten small kernels a layer) instead of the ``rope_write`` and ``rms_norm`` kernels
               (three); the engine's options with the step loop of known trip count
               (``step_timing.decode_steps_known_trips``: no host round trip per step).
  spec_variants
               speculative steps at batch 1 beside their ``spec_b1`` rows, each changed one way
               (``SPEC_VARIANTS``): EAGLE-3 chain 5 with its 6 verify rows not padded to 8
               (``dispatch.rows_padded_to(1)``: XLA's pads and slices around every product come
               back), DFlash block 16 and DSpark chain 8 with XLA's dot merger on (the table turns it off:
               it concatenated their draft layers' weights every step).
  compare      ``jaxspec generate --compare`` on the shipped demo pair (a subprocess): its table.
  variants_b16 the variants at batch 16, when time is left.
  candidates   the plain step at batch 1 then 16 with each option set of ``xla_options.CANDIDATES``
               merged over the table (CUDA graphs over loops, loop unrolling, cuBLASLt, the latency-hiding
               scheduler, ...): the measurements that move an option into the table or drop it.
  one_row      the plain step at batch 1 of Llama-3.2-1B's and Qwen3-0.6B's shapes and the 8B shape, its
               one-token forwards on one row (the engine) and over 8 (``dispatch.one_row_padded_to``):
               at one row XLA rewrites products under 10M elements as a multiply and a reduction. Then
               the 8B plain step at batch 4 with its decode rows padded to 8 (the engine) and not
               (``dispatch.rows_padded_to(1)``).

Call 2:
  env, copy    as in call 1 (the kernels' floors use this call's copy bandwidth).
  batch64      plain and EAGLE-3 chain 5 at batch 64 (8B shape).
  controls     a sampled plain step at batch 16 (temperature 1) without and with every generation
               control (repetition / presence / frequency penalties, a logit bias on 64 tokens,
               min-p, 20 top log-probabilities), alternated.
  constraint   a greedy plain step at batch 16 without and with a JSON-schema constraint on every row
               (needs outlines-core; skipped, saying so, without it).
  kernels      each Pallas kernel against the XLA path in device time (N calls in one program,
               ``benchmarks/kernels.py``) and its HBM floor: paged attention decode, verify n=8 and
               n=64 and an 8-token draft extend (B=16, ctx 8192); MLA decode and verify n=8 (B=32,
               ctx 4096); the DSA indexer; KV moves; the gather of accepted extras; RoPE with the K/V
               write and RMSNorm (8B layer, decode B=1 and verify n=8 B=16); the exact mode's
               fixed-tile product against cuBLAS and its row-by-row attention against the default
               paged kernel.
  exact        the plain step and EAGLE-3 chain 5 at batch 1 (8B shape) on the default path and in the
               exact mode (``EngineConfig(exact=True)``), alternated: what the mode costs a step.
  hybrid       a Qwen3.5-9B-shaped hybrid target (8 x (3 Gated DeltaNet + 1 gated attention layer),
               published widths, weight bytes printed): plain step at batch 1 and 16 against its bound
               (weights, KV of its attention layers, recurrent state read and written), and its MTP
               layer's chain of 3 at batch 1.
  v4           a DeepSeek-V4-Flash-shaped target (its layer kinds and widths, 10 layers and 32 experts,
               weight bytes printed): plain step at batch 1 through ``jaxspec.Engine`` (wall-time
               difference of two generations).
  spec_controls  EAGLE-3 chain 5 at batch 16 with every control and with the constraint.
  target_candidates
               the hybrid (decode program) and the V4-shaped target (through ``jaxspec.Engine``,
               prefill compiled too) at batch 1 with one ``CANDIDATES`` set over the table
               (``--target-candidate``, default ``command_buffer_loops``; a ``REJECTED`` set by its
               name too), each beside the table's
               program timed the same way: whether an option the 8B shape gains from holds for the
               other layer kinds, and its compile time.
  check        every kernel natively against its f32 reference (``kernels.py --check``).
  pytest       ``pytest -m gpu tests/pallas`` and ``tests/spec/test_lossless_pallas.py`` natively.
  sweep        block sizes and launch sizes per shape class, in device time (``benchmarks/block_sweep.py``):
               ``OUT/block_table.json``; with ``--write-table`` also the checkout's table, so the items
               after it in the same run (``--items sweep,plain,...``) use its entries.
The last three rarely fit in call 2; they are kept for a session with time to spare.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from pathlib import Path

# Allocate GPU memory as needed (not 75% up front): the demo pair and pytest run in subprocesses
# beside this process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout
sys.path.insert(0, str(REPO / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import hlo_copies  # noqa: E402  (benchmarks/hlo_copies.py)
import kernels as kbench  # noqa: E402  (benchmarks/kernels.py)
import step_timing as st  # noqa: E402  (benchmarks/step_timing.py)
from jaxspec.pallas import dispatch  # noqa: E402

CALLS = {
    1: ["env", "copy", "plain", "copies", "spec_b1", "spec_b16", "profile", "variants_b1", "spec_variants", "compare",
        "variants_b16", "candidates", "one_row"],
    2: ["env", "copy", "batch64", "controls", "constraint", "kernels", "exact", "hybrid", "v4", "spec_controls",
        "target_candidates", "check", "pytest", "sweep"],
}
ITEMS = list(dict.fromkeys(CALLS[1] + CALLS[2]))

# The plain-step variants: (name, XLA options (None: the table's), implementation, step loop of known
# trip count).
TRITON_OFF = {"xla_gpu_enable_triton_gemm": False}
# A repeated option replaces XLA's whole list: its defaults (jaxlib 0.11.2) plus WHILE and CONDITIONAL.
COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
VARIANTS = [
    ("no options", {}, None, False),
    ("cuBLAS GEMMs", TRITON_OFF, None, False),
    ("cuBLAS + command buffers with WHILE, CONDITIONAL",
     {**TRITON_OFF, "xla_gpu_enable_command_buffer": COMMAND_BUFFERS}, None, False),
    ("cuBLAS + command buffers + dynamic-slice fusion",
     {**TRITON_OFF, "xla_gpu_enable_command_buffer": COMMAND_BUFFERS, "xla_gpu_enable_dynamic_slice_fusion": True},
     None, False),
    ("cuBLAS, XLA attention", TRITON_OFF, "xla", False),
    # The engine's own options (None: the table), with RoPE, the K/V write and the norms as XLA's
    # kernels instead of the one rope_write and two rms_norm launches a layer: what those save.
    ("small kernels on XLA", None, (("rms_norm", "xla"), ("rope_write", "xla")), False),
    # The engine's options, its steps in a loop of known trip count (step_timing.decode_steps_known_trips):
    # what the host round trip XLA:GPU makes for the step loop's condition every step costs. The H100
    # trace at ac9006f shows a gap at every step's start (condition, copy to the host, relaunch).
    ("step loop of known trip count", None, None, True),
]
# Seconds the demo pair's comparison is given in call 1 (its compile and runs took 55 s on an H200).
COMPARE_RESERVE_S = 100


class Deadline:
    def __init__(self, minutes: float):
        self.end = time.monotonic() + 60 * minutes
        self.reserve = 0.0  # seconds kept for a later item (the demo pair's comparison in call 1)

    def left(self) -> float:
        return self.end - time.monotonic()

    def passed(self, reserve_s: float = 0.0) -> bool:
        return self.left() < reserve_s


class Skip(Exception):
    """An item (or a row) that cannot run here, with the reason (a missing package, the deadline)."""


@dataclasses.dataclass
class Sizes:
    """What the items time: real shapes on a GPU, toy ones in a dry run."""

    dry_run: bool

    @property
    def target(self):
        return st.TINY if self.dry_run else st.LLAMA3_8B

    @property
    def dtype(self):
        return jnp.float32 if self.dry_run else jnp.bfloat16

    @property
    def context(self) -> int:
        return 40 if self.dry_run else 1024

    @property
    def steps(self) -> int:
        return 2 if self.dry_run else 16

    @property
    def repeats(self) -> int:
        return 1 if self.dry_run else 5

    def batch(self, b: int) -> int:
        return {1: 1, 4: 4, 16: 2, 64: 4}[b] if self.dry_run else b

    def compile_s(self, big: bool = True) -> float:
        """A generous guess of one compile and its timed calls (seconds), for the deadline."""
        return 0.0 if self.dry_run else (45.0 if big else 15.0)


class Check:
    """The run's results: one entry per item, rewritten to JSON and Markdown after every row."""

    def __init__(self, out: Path, args):
        self.out, self.args = out, args
        path = out / "gpu_check.json"
        self.summary = json.loads(path.read_text()) if path.exists() else {"items": {}}
        self.summary.update(device=kbench.device_name(), dry_run=args.dry_run,
                            pallas_mode="native" if dispatch.on_gpu() else "interpret")
        self.summary.setdefault("items", {})
        self.current = None

    def start(self, name: str, call: int | None):
        self.current = self.summary["items"][name] = dict(call=call, status="running", rows=[], notes=[])
        self.t0 = time.perf_counter()
        self.write()

    def row(self, **row):
        self.current["rows"].append(row)
        self.current["seconds"] = time.perf_counter() - self.t0
        self.write()

    def note(self, text: str):
        self.current["notes"].append(text)
        print(f"  note: {text}", flush=True)
        self.write()

    def finish(self, status: str, error: str | None = None):
        self.current["status"] = status
        self.current["seconds"] = time.perf_counter() - self.t0
        if error:
            self.current["error"] = error
        self.write()

    def rows(self, name: str) -> list[dict]:
        return self.summary["items"].get(name, {}).get("rows", [])

    def write(self):
        (self.out / "gpu_check.json").write_text(json.dumps(self.summary, indent=1, default=str))
        (self.out / "gpu_check.md").write_text(markdown(self.summary))


# --------------------------------------------------------------------------- shared state


class Models:
    """The models items share, built on first use and freed when another one is needed."""

    def __init__(self, sizes: Sizes):
        self.sizes, self.cache = sizes, {}

    def get(self, name: str, build):
        if name not in self.cache:
            for other in list(self.cache):  # one model at a time: the 8B shape, the hybrid, V4
                self.free(other)
            t = time.perf_counter()
            self.cache[name] = build()
            jax.block_until_ready(self.cache[name].params)
            print(f"  built {name} in {time.perf_counter() - t:.1f} s "
                  f"({st.param_bytes(self.cache[name].params) / 1e9:.2f} GB of weights)", flush=True)
        return self.cache[name]

    def free(self, name: str):
        model = self.cache.pop(name, None)
        if model is not None:
            for x in jax.tree.leaves(model.params):
                x.delete()

    def llama(self):
        return self.get("llama", lambda: st.random_target(self.sizes.target, self.sizes.dtype))


def bandwidths(check: Check) -> tuple[float | None, float | None]:
    """(measured copy bytes/s or None, datasheet bytes/s or None)."""
    copy = check.rows("copy")
    return (copy[0]["bytes_per_s"] if copy else None), st.device_bandwidth()[1]


def step_row(check: Check, sizes: Sizes, target, r: dict, *, batch: int, config: str, what: str, options: str,
             plain_s: float | None = None, bound: bool = False, draft=None, spec=None, **extra) -> dict:
    """One timed step row: ms per step, its ratio to the plain step, the nodes it verified, and
    (``bound``) the bytes the step reads over the measured and the datasheet bandwidth: a plain
    step's, plus with a ``draft`` the draft weights its ``spec`` reads
    (``step_timing.draft_weight_bytes_read``), and then the floor's ratio to the plain step's
    (``floor_vs_plain``: the least ``vs_plain`` a step at the bandwidth bound could show)."""
    row = dict(batch=batch, config=config, what=what, options=options, ms_per_step=r["seconds"] * 1e3,
               verified=round(r.get("verified_mean", 1.0), 2), compile_s=round(r.get("compile_s", 0.0), 1), **extra)
    if "spread" in r:
        row["spread"] = round(r["spread"], 3)
    if plain_s:
        row["vs_plain"] = r["seconds"] / plain_s
    if bound:
        measured, sheet = bandwidths(check)
        w = st.weight_bytes_read(target.params, batch)
        kv = st.kv_bytes_read(target.config, batch, r.get("positions", sizes.context), target.dtype)
        d = st.draft_weight_bytes_read(draft, spec)
        row.update(weight_bytes_read=w, kv_bytes_read=int(kv))
        if draft is not None:
            row.update(draft_weight_bytes_read=d, floor_vs_plain=(w + kv + d) / (w + kv))
        for name, bw in (("measured", measured), ("datasheet", sheet)):
            if bw:
                row[f"bound_ms_{name}"] = (w + kv + d) / bw * 1e3
                row[f"share_of_bound_{name}"] = (w + kv + d) / bw / r["seconds"]
    check.row(**row)
    shares = "".join(f", {row[f'share_of_bound_{n}'] * 100:.0f}% of the {n} bound" for n in ("measured", "datasheet")
                     if f"share_of_bound_{n}" in row)
    print(f"  batch {batch} {config}: {row['ms_per_step']:.3f} ms/step"
          + (f" ({row['vs_plain']:.2f}x plain)" if "vs_plain" in row else "")
          + (f" (floor {row['floor_vs_plain']:.2f}x plain)" if "floor_vs_plain" in row else "")
          + f", verified {row['verified']}{shares} [compile+first call {row['compile_s']} s]", flush=True)
    return row


def need(deadline: Deadline, seconds: float, what: str):
    """Raises ``Skip`` unless ``seconds`` (and the time kept for later items) are left."""
    if deadline.left() < seconds + deadline.reserve:
        kept = f", {deadline.reserve:.0f} of them kept for a later item" if deadline.reserve else ""
        raise Skip(f"{what} and what follows it: not started, {deadline.left():.0f} s left{kept} "
                   f"(needs about {seconds:.0f})")


def guarded(check: "Check", label: str):
    """A context in which an error fails one row (recorded, printed) and the item goes on."""
    return _Guard(check, label)


class _Guard:
    def __init__(self, check, label):
        self.check, self.label = check, label

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is None or issubclass(kind, (Skip, KeyboardInterrupt)):
            return False
        error = "".join(traceback.format_exception(kind, exc, tb, limit=4))[-2000:]
        print(f"  {self.label}: ERROR {kind.__name__}: {str(exc)[:300]}", flush=True)
        self.check.row(config=self.label, error=error)
        self.check.current["row_errors"] = self.check.current.get("row_errors", 0) + 1
        return True


def dry_subset(sizes: "Sizes", items: list, keep: int = 1) -> list:
    """All of ``items``, or in a dry run the first ``keep`` (the others' code runs elsewhere in it)."""
    return items[:keep] if sizes.dry_run else items


# --------------------------------------------------------------------------- items


def item_env(check: Check, sizes, models, deadline, args):
    import importlib.metadata as md

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    pkgs = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "triton", "torch",
            "transformers", "numpy", "outlines_core", "jsonschema")
    row = dict(python=platform.python_version(), platform=platform.platform(), backend=jax.default_backend(),
               devices=[f"{d.platform}:{d.device_kind}" for d in jax.devices()],
               packages={p: v for p in pkgs if (v := version(p))}, gpu_key=dispatch.gpu_kind(),
               xla_flags=os.environ.get("XLA_FLAGS", ""))
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                              "clocks.sm,temperature.gpu,power.draw", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        row["nvidia_smi"] = (smi.stdout.strip() or smi.stderr.strip()).splitlines()[0]
    except (OSError, subprocess.TimeoutExpired, IndexError) as e:
        row["nvidia_smi"] = f"n/a ({type(e).__name__})"
    check.summary["env"] = row
    check.row(**row)
    for k in ("devices", "packages", "nvidia_smi"):
        print(f"  {k}: {row[k]}", flush=True)


def item_copy(check: Check, sizes, models, deadline, args):
    """Device-to-device copy bandwidth: x -> x + 1 over a large bf16 array, ``iters`` times in one
    program (each pass reads and writes the array), median of 5 programs."""
    n = (1 << 16) if sizes.dry_run else (1 << 29)  # 1 GiB of bf16
    iters = 2 if sizes.dry_run else 20
    x = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.bfloat16)

    # Donated, so the loop updates the array in place (no copy of the input into the loop).
    @jax.jit(donate_argnums=0)
    def passes(x):
        return jax.lax.fori_loop(0, iters, lambda i, y: y + jnp.bfloat16(1), x)

    x = jax.block_until_ready(passes(x))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        x = jax.block_until_ready(passes(x))
        times.append(time.perf_counter() - t)
    sec = statistics.median(times)
    moved = 2 * n * 2 * iters
    sheet = st.device_bandwidth()[1]
    check.row(what=f"x + 1 over {n * 2 / 2**30:.2f} GiB bf16, {iters} passes in one program, median of 5",
              bytes_moved=moved, seconds=sec, bytes_per_s=moved / sec, datasheet_bytes_per_s=sheet,
              of_datasheet=None if not sheet else moved / sec / sheet)
    del x
    print(f"  copy: {moved / sec / 1e12:.2f} TB/s (read + written)"
          + (f", {moved / sec / sheet * 100:.0f}% of the datasheet's {sheet / 1e12:.2f}" if sheet else ""), flush=True)


def _plain_seconds(check: Check, batch: int) -> float | None:
    for r in check.rows("plain") + check.rows("batch64"):
        if r["batch"] == batch and r["config"] == "plain":
            return r["ms_per_step"] / 1e3
    return None


def _time(sizes: Sizes, target, draft, spec, batch: int, **kw) -> dict:
    return st.time_steps(target, draft, spec, batch=batch, context=sizes.context, steps=sizes.steps,
                         repeats=sizes.repeats, **kw)


ENGINE_PROGRAM = "the engine's decode program"


def item_plain(check: Check, sizes, models, deadline, args, batches=(1, 16)):
    target = models.llama()
    for b in batches:
        need(deadline, sizes.compile_s(), f"plain batch {b}")
        bb = sizes.batch(b)
        with guarded(check, f"plain batch {bb}"):
            r = _time(sizes, target, None, None, bb)
            step_row(check, sizes, target, r, batch=bb, config="plain", what=ENGINE_PROGRAM,
                     options="engine default", bound=True)


def item_copies(check: Check, sizes, models, deadline, args):
    """What the decode program copies per layer iteration, read from its optimized HLO."""
    target = models.llama()
    need(deadline, sizes.compile_s(big=False), "the decode program's HLO")
    stepper = st.Stepper(target, None, None, batch=1, context=sizes.context, steps=sizes.steps, repeats=1)
    try:
        hlo, copies = hlo_copies.decode_copies(stepper, target)
    finally:
        stepper.close()
    with gzip.open(check.out / "decode_b1.hlo.txt.gz", "wt") as f:
        f.write(hlo)
    counts = hlo_copies.summarize(copies)
    for c in copies:
        check.row(**c)
    check.note(f"{len(copies)} copying instruction(s) in the decode program: "
               + (", ".join(f"{n} x {k}" for k, n in sorted(counts.items())) or "none")
               + f" ({len(hlo) / 1e6:.1f} MB of optimized HLO in decode_b1.hlo.txt.gz)")


def item_spec(check: Check, sizes, models, deadline, args, batch=1):
    target = models.llama()
    bb = sizes.batch(batch)
    plain = _plain_seconds(check, bb)
    if plain is None:
        check.note(f"no plain step at batch {bb} in this run: ratios are missing")
    for m in st.METHODS if batch == 1 else dry_subset(sizes, st.METHODS):
        need(deadline, sizes.compile_s(), m.name)
        with guarded(check, m.name):
            draft = m.make(target, sizes.dry_run)
            r = _time(sizes, target, draft, m.spec, bb)
            step_row(check, sizes, target, r, batch=bb, config=m.name, what=ENGINE_PROGRAM,
                     options="engine default", plain_s=plain, verified_expected=m.spec.num_draft_tokens,
                     bound=True, draft=draft, spec=m.spec)


def _variant_options_ok(options: dict) -> str | None:
    """None when this jaxlib accepts ``options`` (compiling a trivial program), else its error."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=options or None).lower(jnp.ones(2)).compile()
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def item_variants(check: Check, sizes, models, deadline, args, batch=1):
    target = models.llama()
    bb = sizes.batch(batch)
    plain = _plain_seconds(check, bb)
    table = importlib.util.find_spec("jaxspec.xla_options") is not None
    for name, options, impl, known_trips in VARIANTS:
        bad = _variant_options_ok(options)
        if bad:
            check.note(f"{name}: options refused by this jaxlib: {bad}")
            continue
        if not options and impl is None and not known_trips and not table and plain is not None:
            # The engine passes no options: its program is this variant's (the plain row).
            check.row(batch=bb, config=f"plain, {name}", what=f"{ENGINE_PROGRAM} (the plain row's time)",
                      options="{}", implementation="default", ms_per_step=plain * 1e3, vs_plain=1.0, verified=1.0)
            continue
        if sizes.dry_run and options:  # GPU options: accepted above, not compiled for a CPU
            check.note(f"{name}: options accepted (dry run: not compiled into the decode program)")
            continue
        need(deadline, sizes.compile_s(), name)
        with guarded(check, f"plain, {name}"):
            r = _time(sizes, target, None, None, bb, options=options, implementation=impl, known_trips=known_trips)
            step_row(check, sizes, target, r, batch=bb, config=f"plain, {name}",
                     what=("decode_steps_known_trips" if known_trips else "decode_steps")
                     + " under jax.jit(compiler_options=...)",
                     options="engine table" if options is None else json.dumps(options),
                     implementation=impl or "default", plain_s=plain, bound=True)


# Speculative steps at batch 1 changed one way each, timed beside their ``spec_b1`` rows: (method,
# what changes, rows the forwards pad to (None: the GPU's 8), the options merged over the table (a
# candidate's name, or a mapping whose None drops the table's entry)).
SPEC_VARIANTS = [
    ("EAGLE-3 chain 5", "verify rows not padded", 1, None),
    ("DFlash block 16 (chain 15)", "dot merger on (XLA's default)", None, {"xla_gpu_dot_merger_threshold_mb": None}),
    ("DSpark chain 8", "dot merger on (XLA's default)", None, {"xla_gpu_dot_merger_threshold_mb": None}),
]


def item_spec_variants(check: Check, sizes, models, deadline, args):
    from jaxspec import xla_options

    target = models.llama()
    bb = sizes.batch(1)
    plain = _plain_seconds(check, bb)
    methods = {m.name: m for m in st.METHODS}
    for name, change, rows, delta in SPEC_VARIANTS:
        m = methods[name]
        extra = xla_options.CANDIDATES[delta] if isinstance(delta, str) else (delta or {})
        options = dict(xla_options.resolve_options(tuple(sorted(extra.items())), "gpu"))
        if bad := _variant_options_ok(options):
            check.note(f"{name}, {change}: options refused by this jaxlib: {bad}")
            continue
        if sizes.dry_run and extra:
            check.note(f"{name}, {change}: options accepted (dry run: not compiled)")
            continue
        need(deadline, sizes.compile_s(), f"{name}, {change}")
        # The table's options passed explicitly: a fresh jit (and inside rows_padded_to, a fresh trace).
        with (guarded(check, f"{name}, {change}"),
              dispatch.rows_padded_to(rows) if rows else contextlib.nullcontext()):
            draft = m.make(target, sizes.dry_run)
            r = _time(sizes, target, draft, m.spec, bb, options=options)
            step_row(check, sizes, target, r, batch=bb, config=f"{name}, {change}",
                     what=("decode_steps under jax.jit(compiler_options=table + these)" if extra else
                           f"decode_steps with its forwards' rows padded to {rows}"),
                     options=json.dumps(extra) if extra else "engine table", plain_s=plain,
                     verified_expected=m.spec.num_draft_tokens, bound=True, draft=draft, spec=m.spec)


def item_profile(check: Check, sizes, models, deadline, args):
    """Device kernels per step of the 8B plain step and of EAGLE-3 chain 5 (batch 1 and 16) and n-gram
    chain 5 (batch 16), from the profiler (``benchmarks/kernel_trace.py``); each trace kept as
    ``OUT/trace_*.json.gz``."""
    import kernel_trace

    target = models.llama()
    eagle3, ngram = st.METHODS[0], st.METHODS[-1]
    configs = [(1, st.PLAIN), (16, st.PLAIN), (1, eagle3), (16, eagle3), (16, ngram)]
    for b, method in dry_subset(sizes, configs, keep=2):
        bb = sizes.batch(b)
        need(deadline, sizes.compile_s(big=False), f"profile of {method.name} at batch {bb}")
        with guarded(check, f"profile {method.name} batch {bb}"):
            draft = None if method.spec is None else method.make(target, sizes.dry_run)
            s = st.Stepper(target, draft, method.spec, batch=bb, context=sizes.context, steps=sizes.steps, repeats=2)
            try:
                s.call()  # compiles (or finds the program an earlier item compiled)
                wall = s.call()
                name = f"trace_{re.sub(r'[^a-z0-9]+', '_', method.name.lower()).strip('_')}_b{bb}.json.gz"
                summary = kernel_trace.trace_kernels(s.call, sizes.steps, keep=str(check.out / name))
            finally:
                s.close()
            row = dict(batch=bb, config=method.name, wall_ms_per_step=wall * 1e3, trace=name, **summary)
            products = summary["kinds"].get(kernel_trace.KINDS[0][0])
            if products:
                row["product_bytes_per_s"] = st.weight_bytes_read(target.params, bb) / (products * 1e-6)
            check.row(**row)
            busy = summary["busy_us_per_step"]
            print(f"  {method.name} batch {bb}: wall {wall * 1e3:.3f} ms/step, device busy "
                  + ("n/a (no device events in the trace)" if busy is None else f"{busy / 1e3:.3f} ms, "
                     + ", ".join(f"{k} {v / 1e3:.3f}" for k, v in summary["kinds"].items())), flush=True)


def item_candidates(check: Check, sizes, models, deadline, args):
    """The plain step with each of ``xla_options.CANDIDATES`` merged over the table, at batch 1 then 16
    (``--candidate-batches``)."""
    from jaxspec import xla_options

    batches = [int(b) for b in args.candidate_batches.split(",")]
    target = models.llama()
    base = dict(xla_options.TABLE["gpu"])
    for b in batches:
        bb = sizes.batch(b)
        plain = _plain_seconds(check, bb)
        for i, (name, extra) in enumerate(xla_options.CANDIDATES.items()):
            options = {**base, **extra}
            bad = _variant_options_ok(options)
            if bad:
                check.note(f"{name}: options refused by this jaxlib: {bad}")
                continue
            if sizes.dry_run and (i or b != batches[0]):
                continue  # one compiled in a dry run: the others' options were accepted above
            need(deadline, sizes.compile_s(), f"candidate {name} at batch {bb}")
            with guarded(check, f"plain + {name}"):
                r = _time(sizes, target, None, None, bb, options=options)
                step_row(check, sizes, target, r, batch=bb, config=f"plain + {name}",
                         what="decode_steps under jax.jit(compiler_options=table + candidate)",
                         options=json.dumps(extra), plain_s=plain, bound=True)


def item_compare(check: Check, sizes, models, deadline, args):
    """``jaxspec generate --compare`` on the demo pair, in a subprocess (its own memory and compiles)."""
    cmd = [sys.executable, "-m", "jaxspec", "generate", "--compare"]
    if sizes.dry_run:  # two methods (the n-gram draft given: it and plain), few tokens
        cmd += ["--draft", "ngram", "--max-new-tokens", "8", "--repeats", "1"]
    timeout = max(20.0, deadline.left() - 5)
    path = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    try:
        run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
        out, err, rc = run.stdout, run.stderr, run.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = f"timed out after {timeout:.0f} s", None
    (check.out / "compare.txt").write_text(out + "\n--- stderr ---\n" + err[-6000:])
    rows = parse_compare(out)
    for r in rows:
        check.row(command="python3 -m jaxspec " + " ".join(cmd[3:]), **r)
        print(f"  {r['method']:<10} {r['shape']:<16} accept {r['accept']:.2f}  {r['tokens_per_s']:.1f} tok/s  "
              f"{r['speedup']}", flush=True)
    warm = next((line for line in err.splitlines() if "compiled and warmed" in line), None)
    if warm:
        check.note(warm.strip("()"))
    if rc != 0 or not rows:
        raise RuntimeError(f"jaxspec generate --compare: exit {rc}; {err.strip()[-1500:]}")


def parse_compare(stdout: str) -> list[dict]:
    """The rows of ``--compare``'s table: method, draft, shape, accept, tokens/s, speedup."""
    lines = stdout.splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith("method")), None)
    rows = []
    for line in ([] if head is None else lines[head + 1:]):
        parts = line.split()
        if len(parts) < 6 or line.startswith("tokens:"):
            break
        try:
            rows.append(dict(method=parts[0], draft=parts[1], shape=" ".join(parts[2:-3]), accept=float(parts[-3]),
                             tokens_per_s=float(parts[-2]), speedup=parts[-1]))
        except ValueError:
            break
    return rows


def item_batch64(check: Check, sizes, models, deadline, args):
    item_plain(check, sizes, models, deadline, args, batches=(64,))
    target = models.llama()
    bb = sizes.batch(64)
    for m in dry_subset(sizes, st.METHODS[:1], keep=0):  # EAGLE-3 chain 5
        need(deadline, sizes.compile_s(), m.name)
        with guarded(check, m.name):
            draft = m.make(target, sizes.dry_run)
            r = _time(sizes, target, draft, m.spec, bb)
            step_row(check, sizes, target, r, batch=bb, config=m.name, what=ENGINE_PROGRAM, options="engine default",
                     plain_s=_plain_seconds(check, bb), verified_expected=m.spec.num_draft_tokens,
                     bound=True, draft=draft, spec=m.spec)


def _pair(check, sizes, models, deadline, method, *, grammars=None, temperature=0.0, label: str, exact=False,
          batch: int = 16):
    target = models.llama()
    bb = sizes.batch(batch)
    need(deadline, 2 * sizes.compile_s(), f"{method.name} {label}")
    with guarded(check, f"{method.name} + {label}"):
        draft = None if method.make is None else method.make(target, sizes.dry_run)
        off, on = st.time_pair(target, draft, method.spec, batch=bb, context=sizes.context, steps=sizes.steps,
                               repeats=sizes.repeats, grammars=grammars, temperature=temperature, exact=exact)
        mode = "greedy" if temperature == 0 else f"sampled at temperature {temperature:g}"
        for r, suffix in ((off, ""), (on, f" + {label}")):
            step_row(check, sizes, target, r, batch=bb, config=method.name + suffix,
                     what=f"{ENGINE_PROGRAM}, {mode}, off and on alternated", options="engine default",
                     plain_s=off["seconds"], verified_expected=method.spec and method.spec.num_draft_tokens)


CONTROLS = "every control (penalties, logit bias on 64 tokens, min-p 0.05, 20 logprobs)"


def _grammars(sizes: Sizes):
    if importlib.util.find_spec("outlines_core") is None:
        raise Skip("outlines-core is not installed: the JSON-schema constraint cannot be compiled "
                   "(carry its wheel: scripts/gpu_wheels.sh)")
    return st.timing_grammar(None, sizes.target.vocab_size)


def item_controls(check: Check, sizes, models, deadline, args):
    _pair(check, sizes, models, deadline, st.PLAIN, temperature=1.0, label=CONTROLS)


def item_constraint(check: Check, sizes, models, deadline, args):
    _pair(check, sizes, models, deadline, st.PLAIN, grammars=_grammars(sizes), label="JSON-schema constraint")


def item_exact(check: Check, sizes, models, deadline, args):
    for m in (st.PLAIN, st.METHODS[0]):  # plain, EAGLE-3 chain 5
        _pair(check, sizes, models, deadline, m, label="exact mode", exact=True, batch=1)


def item_spec_controls(check: Check, sizes, models, deadline, args):
    if sizes.dry_run:  # the same code as the controls and constraint items, with a draft: not compiled again
        check.note("dry run: the pairs run in the controls and constraint items")
        return
    m = st.METHODS[0]
    _pair(check, sizes, models, deadline, m, temperature=1.0, label=CONTROLS)
    _pair(check, sizes, models, deadline, m, grammars=_grammars(sizes), label="JSON-schema constraint")


def item_hybrid(check: Check, sizes, models, deadline, args):
    cfg = st.qwen35_shape(tiny=sizes.dry_run)
    need(deadline, 20 + sizes.compile_s(), "the hybrid target")
    target = models.get("hybrid", lambda: st.random_target(cfg, sizes.dtype))
    check.note(f"Qwen3.5-9B shape: {st.param_bytes(target.params) / 1e9:.2f} GB of weights "
               f"({sum(x.size for x in jax.tree.leaves(target.params)) / 1e9:.2f}B parameters), "
               f"{cfg.num_linear_layers} Gated DeltaNet + {cfg.num_full_layers} attention layers")
    plain = {}
    for b in dry_subset(sizes, [1, 16]):
        need(deadline, sizes.compile_s(), f"hybrid plain batch {b}")
        bb = sizes.batch(b)
        with guarded(check, f"hybrid plain batch {bb}"):
            r = _time(sizes, target, None, None, bb)
            plain[bb] = r["seconds"]
            step_row(check, sizes, target, r, batch=bb, config="hybrid plain", what=ENGINE_PROGRAM,
                     options="engine default", bound=True, weight_bytes=st.param_bytes(target.params))
    need(deadline, sizes.compile_s(), "hybrid MTP chain 3")
    bb = sizes.batch(1)
    spec = st.HYBRID_MTP.spec
    with guarded(check, "hybrid MTP chain 3"):
        draft = st.HYBRID_MTP.make(target, sizes.dry_run)
        r = _time(sizes, target, draft, spec, bb)
        step_row(check, sizes, target, r, batch=bb, config="hybrid MTP chain 3", what=ENGINE_PROGRAM,
                 options="engine default", plain_s=plain.get(bb), verified_expected=spec.num_draft_tokens,
                 bound=True, draft=draft, spec=spec)


def item_v4(check: Check, sizes, models, deadline, args):
    cfg = st.v4_shape(tiny=sizes.dry_run)
    need(deadline, 30 + 2 * sizes.compile_s(), "the V4-shaped target")
    target = models.get("v4", lambda: st.random_target(cfg, sizes.dtype))
    total = st.param_bytes(target.params)
    experts = sum(x.size * x.dtype.itemsize for k in ("experts_gate", "experts_up", "experts_down")
                  for x in [target.params["layers"].get(k)] if x is not None)
    active = total - experts + experts * cfg.num_experts_per_tok / cfg.num_experts \
        - target.params["embed"].size * target.params["embed"].dtype.itemsize
    check.note(f"DeepSeek-V4-Flash shape with {cfg.num_layers} layers ({cfg.layer_kinds.count('sliding')} sliding, "
               f"{cfg.num_csa_layers} CSA, {cfg.num_hca_layers} HCA) and {cfg.num_experts} experts: "
               f"{total / 1e9:.2f} GB of weights, about {active / 1e9:.2f} GB read by a batch-1 step "
               f"({cfg.num_experts_per_tok} routed experts of {cfg.num_experts}, no embedding table)")
    bb = sizes.batch(1)
    r = st.engine_step_seconds(target, batch=bb, context=sizes.context, steps=sizes.steps,
                               calls=1 if sizes.dry_run else 4, repeats=1 if sizes.dry_run else 3)
    measured, sheet = bandwidths(check)
    extra = {f"weights_bound_ms_{n}": active / bw * 1e3 for n, bw in (("measured", measured), ("datasheet", sheet))
             if bw}
    step_row(check, sizes, target, r, batch=bb, config="V4-shaped plain",
             what="jaxspec.Engine.generate, difference of two generations", options="engine default",
             weight_bytes=total, active_weight_bytes_b1=int(active), **extra)


def item_one_row(check: Check, sizes, models, deadline, args):
    """Plain decode at batch 1 with each one-token forward as the engine runs it (one row) and over 8
    rows (``dispatch.one_row_padded_to``), for Llama-3.2-1B's and Qwen3-0.6B's shapes (small targets,
    and the standalone drafts speculative decoding runs) and the 8B shape. At one row XLA:GPU rewrites
    each product under 10M elements as a multiply and a reduction, written out where not fused (every
    product of the 0.6B shape; benchmarks/RESULTS.md); 8 rows keep every product a cuBLAS call. Decides
    whether the engine should pad one-row forwards."""
    shapes = [("Llama-3.2-1B shape", "llama3.2-1b", st.LLAMA32_1B), ("Qwen3-0.6B shape", "qwen3-0.6b", st.QWEN3_06B),
              ("8B shape", "llama", None)]
    bb = sizes.batch(1)
    for label, key, cfg in dry_subset(sizes, shapes, keep=2):
        need(deadline, 10 + 2 * sizes.compile_s(big=cfg is None), label)
        if cfg is None:
            target = models.llama()
        else:
            cfg = st.TINY if sizes.dry_run else cfg
            target = models.get(key, lambda cfg=cfg: st.random_target(cfg, sizes.dtype))
        one = None
        for rows in (1, 8):
            config = f"{label} plain, one-token forwards over {rows} row{'s' if rows > 1 else ''}"
            with guarded(check, config):
                r = _time(sizes, target, None, None, bb, one_row_rows=rows)
                one = one or r["seconds"]
                step_row(check, sizes, target, r, batch=bb, config=config,
                         what=ENGINE_PROGRAM if rows == 1 else "decode_steps compiled inside dispatch.one_row_padded_to(8)",
                         options="engine default", plain_s=one, bound=True)
    # Batch 4: the engine runs each request's token over 2 rows (no product has rows for XLA to pad);
    # inside rows_padded_to(1) over one, as before (XLA's pad and slice around every product: 595
    # kernels a step at the 8B shape against 370).
    from jaxspec import xla_options

    target, b4 = models.llama(), sizes.batch(4)
    padded = None
    for rows, config in ((None, "8B shape plain, decode rows padded to 8 (the engine)"),
                         (1, "8B shape plain, decode rows not padded")):
        need(deadline, sizes.compile_s(), config)
        # The table's options passed explicitly: a fresh jit (and inside rows_padded_to, a fresh trace).
        with (guarded(check, config), dispatch.rows_padded_to(rows) if rows else contextlib.nullcontext()):
            r = _time(sizes, target, None, None, b4,
                      options=None if rows is None else dict(xla_options.resolve_options(None, "gpu")))
            padded = padded or r["seconds"]
            step_row(check, sizes, target, r, batch=b4, config=config,
                     what=ENGINE_PROGRAM if rows is None else "decode_steps with its forwards' rows not padded",
                     options="engine table", plain_s=padded, bound=True)


def item_target_candidates(check: Check, sizes, models, deadline, args):
    """The hybrid and the V4-shaped targets with one option set of ``xla_options.CANDIDATES`` or
    ``REJECTED`` (``--target-candidate``, default ``command_buffer_loops``) merged over the table, each
    beside the
    table's program timed the same way in this item: whether a candidate the 8B shape gains from holds
    for the other layer kinds (Gated DeltaNet scans, compressed attention, routed experts), and what
    it costs to compile (the V4 rows through ``jaxspec.Engine``: its prefill programs included)."""
    from jaxspec import xla_options

    name = args.target_candidate
    extra = {**xla_options.CANDIDATES, **xla_options.REJECTED}[name]
    options = dict(xla_options.resolve_options(tuple(sorted(extra.items())), "gpu"))
    if bad := _variant_options_ok(options):
        raise Skip(f"{name}: options refused by this jaxlib: {bad}")
    label = f" + {name}"
    cfg = st.qwen35_shape(tiny=sizes.dry_run)
    need(deadline, 20 + 2 * sizes.compile_s(), f"the hybrid target{label}")
    target = models.get("hybrid", lambda: st.random_target(cfg, sizes.dtype))
    bb = sizes.batch(1)
    table = None
    for config, opts in (("hybrid plain", None), ("hybrid plain" + label, options)):
        need(deadline, sizes.compile_s(), config)
        with guarded(check, config):
            r = _time(sizes, target, None, None, bb, options=opts)
            table = table or r["seconds"]
            step_row(check, sizes, target, r, batch=bb, config=config,
                     what=ENGINE_PROGRAM if opts is None else "decode_steps under jax.jit(compiler_options=table + "
                     "candidate)", options="engine table" if opts is None else json.dumps(extra), plain_s=table,
                     bound=True)
    if sizes.dry_run:  # the engine path below is the v4 item's, with EngineConfig.compiler_options
        check.note("dry run: the V4-shaped rows run in the v4 item (not compiled again)")
        return
    cfg = st.v4_shape(tiny=sizes.dry_run)
    need(deadline, 30 + 2 * sizes.compile_s(), f"the V4-shaped target{label}")
    target = models.get("v4", lambda: st.random_target(cfg, sizes.dtype))
    table = None
    for config, setting in (("V4-shaped plain", None), ("V4-shaped plain" + label, extra)):
        need(deadline, 50, config)
        with guarded(check, config):
            r = st.engine_step_seconds(target, batch=bb, context=sizes.context, steps=sizes.steps, calls=4,
                                       repeats=2, compiler_options=setting)
            table = table or r["seconds"]
            step_row(check, sizes, target, r, batch=bb, config=config,
                     what="jaxspec.Engine.generate, difference of two generations",
                     options="engine table" if setting is None else json.dumps(extra), plain_s=table)


def item_kernels(check: Check, sizes, models, deadline, args):
    for name in list(models.cache):
        models.free(name)
    measured, _ = bandwidths(check)
    kargs = argparse.Namespace(smoke=sizes.dry_run, bandwidth=None, repeats=1 if sizes.dry_run else 5)
    seen = [0]

    def on_row(rows):
        for r in rows[seen[0]:]:
            check.row(**r)
        seen[0] = len(rows)

    kbench.bench(kargs, measured_bw=measured, deadline=lambda: deadline.left() < sizes.compile_s(big=False),
                 on_row=on_row)


def item_check(check: Check, sizes, models, deadline, args):
    kargs = argparse.Namespace(smoke=sizes.dry_run)
    for r in kbench.check(kargs):
        check.row(**r)
    failed = [r for r in check.current["rows"] if not r["ok"]]
    if failed:
        raise RuntimeError(f"{len(failed)} kernel checks failed: " + "; ".join(f"{r['name']}: {r['error']}"
                                                                               for r in failed)[:1500])


def item_pytest(check: Check, sizes, models, deadline, args):
    if importlib.util.find_spec("pytest") is None:
        raise Skip("pytest is not installed")
    runs = [["-m", "gpu", "tests/pallas"], ["tests/spec/test_lossless_pallas.py"]]
    for i, sel in enumerate(runs):
        need(deadline, 30, "pytest " + " ".join(sel))
        junit = check.out / f"pytest_{i}.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *sel]
        if sizes.dry_run:
            cmd.insert(3, "--collect-only")  # collects; running them needs a GPU
        timeout = max(30.0, deadline.left() - 10)
        try:
            run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
            lines, rc = (run.stdout + run.stderr).strip().splitlines(), run.returncode
        except subprocess.TimeoutExpired:
            lines, rc = [f"timed out after {timeout:.0f} s"], None
        failures = []
        if junit.exists():
            for case in ElementTree.parse(junit).getroot().iter("testcase"):
                bad = case.find("failure") if case.find("failure") is not None else case.find("error")
                if bad is not None:
                    failures.append(f"{case.get('classname')}::{case.get('name')}: {(bad.get('message') or '')[:300]}")
        check.row(command="python3 -m pytest " + " ".join(cmd[3:]), returncode=rc, summary=lines[-1] if lines else "",
                  failures=failures)
        print(f"  {' '.join(sel)}: {lines[-1] if lines else ''}", flush=True)


def item_sweep(check: Check, sizes, models, deadline, args):
    import block_sweep

    if args.sweep_minutes:  # a budget of its own inside the call's
        deadline = Deadline(min(args.sweep_minutes, deadline.left() / 60))
    out = block_sweep.sweep(check.out, dry_run=sizes.dry_run, deadline=deadline, only=args.sweep_shapes,
                            write_table=args.write_table and not sizes.dry_run)
    for r in out["results"]:
        check.row(**r)
    check.note(f"block table written to {out['table']} (GPU key {out['gpu']}); XLA entries: {out['xla']}")


RUNNERS = dict(
    env=item_env, copy=item_copy, plain=item_plain, copies=item_copies,
    spec_b1=lambda *a: item_spec(*a, batch=1), spec_b16=lambda *a: item_spec(*a, batch=16),
    variants_b1=lambda *a: item_variants(*a, batch=1), spec_variants=item_spec_variants, compare=item_compare,
    variants_b16=lambda *a: item_variants(*a, batch=16), profile=item_profile, candidates=item_candidates,
    batch64=item_batch64, controls=item_controls, constraint=item_constraint, spec_controls=item_spec_controls,
    hybrid=item_hybrid, v4=item_v4, one_row=item_one_row, target_candidates=item_target_candidates, kernels=item_kernels, exact=item_exact, check=item_check, pytest=item_pytest,
    sweep=item_sweep,
)
assert set(RUNNERS) == set(ITEMS)
# Items whose rows are decode-step timings (one Markdown table layout).
STEP_ITEMS = {"plain", "spec_b1", "spec_b16", "variants_b1", "spec_variants", "variants_b16", "candidates", "batch64",
              "controls", "constraint", "exact", "spec_controls", "hybrid", "v4", "one_row", "target_candidates"}


# --------------------------------------------------------------------------- Markdown


def _fmt(x, digits=2):
    if x is None or x == "":
        return ""
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def markdown(summary: dict) -> str:
    env = summary.get("env", {})
    out = [f"# gpu_check on {summary.get('device')}", "",
           f"Pallas {summary.get('pallas_mode')}"
           f"{' (dry run: tiny shapes, times mean nothing)' if summary.get('dry_run') else ''}; "
           f"{env.get('nvidia_smi', '')}; packages {env.get('packages', {})}", ""]
    for name, item in summary.get("items", {}).items():
        rows = item.get("rows", [])
        out.append(f"## {name} (call {item.get('call')}, {item.get('status')}, {item.get('seconds', 0):.0f} s)")
        out.append("")
        out += [f"- {n}" for n in item.get("notes", [])]
        if item.get("error"):
            out += ["", "```", item["error"][-2500:], "```"]
        if rows and name in STEP_ITEMS:
            out += ["", "| batch | config | timed | XLA options | ms/step | vs plain | floor vs plain | verified/step | "
                    "share of bound (measured / datasheet) | bound ms (measured / datasheet) |",
                    "|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
            for r in rows:
                if "ms_per_step" not in r:  # a failed row
                    why = (r.get("error") or "").strip().splitlines()[-1:] or [""]
                    out.append(f"| {r.get('batch', '')} | {r.get('config', '')} | ERROR: {why[0][:200]} | | | | | | | |")
                    continue
                share = " / ".join(f"{r[k] * 100:.0f}%" for k in ("share_of_bound_measured", "share_of_bound_datasheet")
                                   if r.get(k) is not None)
                bound = " / ".join(f"{r[k]:.2f}" for k in ("bound_ms_measured", "bound_ms_datasheet")
                                   if r.get(k) is not None)
                impl = f"; attention {r['implementation']}" if r.get("implementation") not in (None, "default") else ""
                out.append(f"| {r['batch']} | {r['config']} | {r['what']} | {r['options']}{impl} | "
                           f"{r['ms_per_step']:.3f} | {_fmt(r.get('vs_plain'))} | {_fmt(r.get('floor_vs_plain'))} | "
                           f"{_fmt(r.get('verified'), 1)} | "
                           f"{share} | {bound} |")
        elif name == "kernels" and rows:
            copy = summary.get("items", {}).get("copy", {}).get("rows") or [{}]
            out += ["", kbench.markdown(rows, summary.get("device"), copy[0].get("datasheet_bytes_per_s"),
                                        copy[0].get("bytes_per_s"))]
        elif name == "profile" and rows:
            for r in rows:
                if "wall_ms_per_step" not in r:
                    continue
                busy = r.get("busy_us_per_step")
                out.append(f"- {r['config']} at batch {r['batch']}: wall {r['wall_ms_per_step']:.3f} ms a step; "
                           + ("no device events in the trace" if busy is None else
                              f"device busy {busy / 1e3:.3f} ms, span {r['span_us_per_step'] / 1e3:.3f} ms, "
                              f"{r['kernels_per_step']:.0f} kernels a step; "
                              + "; ".join(f"{k} {v / 1e3:.3f} ms" for k, v in r["kinds"].items())
                              + (f"; products stream the weights at {r['product_bytes_per_s'] / 1e12:.2f} TB/s"
                                 if r.get("product_bytes_per_s") else "")))
                if r.get("top"):
                    out += ["", "  | kernel | class | us / step | calls / step |", "  |---|---|---:|---:|"]
                    out += [f"  | `{t['name'][:90]}` | {t['kind']} | {t['us_per_step']:.1f} | "
                            f"{t['calls_per_step']:.1f} |" for t in r["top"][:12]]
                    out.append("")
        elif name == "compare" and rows:
            out += ["", "| method | draft | shape | accept | tokens/s | vs plain |", "|---|---|---|---:|---:|---:|"]
            out += [f"| {r['method']} | {r['draft']} | {r['shape']} | {r['accept']:.2f} | {r['tokens_per_s']:.1f} | "
                    f"{r['speedup']} |" for r in rows]
        elif name == "copies" and rows:
            out += ["| kind | array | op | fusion kind | shape | computation |", "|---|---|---|---|---|---|"]
            out += [f"| {r.get('kind')} | {r.get('array')} | {r.get('op')} | {r.get('fusion_kind') or ''} | "
                    f"{r.get('shape')} | {r.get('computation')} |" for r in rows]
        elif name == "copy" and rows:
            r = rows[0]
            out.append(f"- {r['what']}: {r['bytes_per_s'] / 1e12:.2f} TB/s (read + written)"
                       + (f", {r['of_datasheet'] * 100:.0f}% of the datasheet" if r.get("of_datasheet") else ""))
        elif name == "check" and rows:
            out += ["| kernel | case | result |", "|---|---|---|"]
            out += [f"| {r['kind']} | {r['name']} | {'ok' if r['ok'] else 'FAIL: ' + str(r['error'])} |" for r in rows]
        elif name == "pytest":
            for r in rows:
                out.append(f"- `{r['command']}`: {r['summary']}")
                out += [f"  - FAIL {f}" for f in r.get("failures", [])]
        elif name == "sweep" and rows:
            out += ["| shape | class | best tiles (programs aimed at) | Pallas (us) | XLA (us) | floor (us) | "
                    "Pallas / floor | heuristic (us) |", "|---|---|---|---:|---:|---:|---:|---:|"]
            for r in rows:
                b = r.get("best")
                tiles = "" if not b else (", ".join(f"{k}={v}" for k, v in b["blocks"].items())
                                          + f" ({b.get('target_programs')})")
                why = tiles or r.get("error") or r.get("skipped", "")
                first = r.get("tried", [{}])[r["heuristic_index"]] if "heuristic_index" in r else {}
                out.append(f"| {r.get('shape')} | {r.get('class', '')} | {why} "
                           f"| {_fmt(b and b['us'], 1)} | {_fmt(r.get('xla_us'), 1)} | {_fmt(r.get('floor_us'), 1)} "
                           f"| {_fmt(b and b.get('over_floor'))} | {_fmt(first.get('us'), 1)} |")
        elif name == "env" and rows:
            r = rows[0]
            out.append(f"- devices {r['devices']}, backend {r['backend']}, Python {r['python']}, XLA_FLAGS "
                       f"'{r['xla_flags']}'")
        out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json / .md (and compare.txt, ...)")
    ap.add_argument("--call", default="1", help="1, 2 or 1,2: which call's items to run, in order")
    ap.add_argument("--items", default=None, help=f"comma-separated items instead of the call's: {','.join(ITEMS)}")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes, Pallas in interpret mode, pytest only collects")
    ap.add_argument("--deadline-minutes", type=float, default=None,
                    help="stop starting new work this long after the start (default 7.5; a dry run 60: its times "
                         "do not matter, only that every item runs)")
    ap.add_argument("--write-table", action="store_true",
                    help="the sweep also merges its entries into the checkout's jaxspec/pallas/block_table.json, "
                         "so the items after it in this run use them")
    ap.add_argument("--sweep-minutes", type=float, default=None,
                    help="the sweep's own time limit inside the call's (shape classes in priority order)")
    ap.add_argument("--sweep-shapes", default=None,
                    help="comma-separated parts of shape names: sweep only the shapes whose name holds one")
    ap.add_argument("--candidate-batches", default="1,16", help="batches the option candidates are timed at")
    ap.add_argument("--target-candidate", default="command_buffer_loops",
                    help="the xla_options.CANDIDATES (or REJECTED) entry target_candidates times on the hybrid "
                         "and V4 targets")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help="do not keep compiled programs in /tmp/jaxspec-jax-cache (a rerun on the same machine "
                         "reuses them)")
    args = ap.parse_args(argv)
    calls = [int(c) for c in args.call.split(",") if c.strip()]
    if args.items:
        plan = [(i.strip(), None) for i in args.items.split(",") if i.strip()]
    else:
        plan = [(i, c) for c in calls for i in CALLS[c]]
    if unknown := {i for i, _ in plan} - set(ITEMS):
        ap.error(f"unknown items {sorted(unknown)}; choose from {ITEMS}")
    args.item_list = [i for i, _ in plan]
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not args.no_compile_cache:
        jax.config.update("jax_compilation_cache_dir", "/tmp/jaxspec-jax-cache")
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jaxspec-jax-cache")
    deadline = Deadline(args.deadline_minutes or (60.0 if args.dry_run else 7.5))
    sizes = Sizes(dry_run=args.dry_run)
    check, models = Check(args.out, args), Models(sizes)
    failed = False
    for name, call in plan:
        print(f"== {name} ({deadline.left():.0f} s left)", flush=True)
        check.start(name, call)
        try:
            if deadline.passed(reserve_s=10):
                raise Skip(f"not started: {deadline.left():.0f} s left")
            deadline.reserve = COMPARE_RESERVE_S if (not args.dry_run and "compare" in args.item_list[
                args.item_list.index(name) + 1:] and name != "compare") else 0.0
            RUNNERS[name](check, sizes, models, deadline, args)
            errors = check.current.get("row_errors", 0)
            check.finish("done" if not errors else f"done, {errors} rows failed")
            failed = failed or bool(errors)
        except Skip as e:
            check.note(str(e))
            check.finish("partial" if check.current["rows"] else "skipped")
            failed = failed or bool(check.current.get("row_errors"))
        except Exception:  # noqa: BLE001 - one item failing must not lose the others
            error = traceback.format_exc(limit=6)[-3000:]
            print(error, flush=True)
            check.finish("error", error)
            failed = True
    for name in list(models.cache):
        models.free(name)
    print(f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}\n", flush=True)
    print(markdown(check.summary), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
