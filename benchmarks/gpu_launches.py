"""The kernels a decode step launches on an H100 or H200, counted without one.

jaxlib's CUDA plugin compiles for a GPU it does not have: JAX's compile-only CUDA topology, given a
description of the target device, hands back XLA:GPU's optimized program (cuBLAS calls, XLA
fusions, the Pallas kernels as Triton custom calls, built by XLA's own Triton for sm_90a). This
script compiles the engine's decode program that way at the Llama-3-8B shape, reads the scheduled
instructions of the program's step loop (the layer loop counted once per layer) and reports how
many kernels one step launches, by kind.

It counts launches, not time: no autotuning runs without a device (XLA keeps its default GEMM
configurations), and a launch of a few microseconds and one of a millisecond count the same. What
it answers is how many small kernels a change removes from a step before a GPU is lent.

Set-up (a separate environment: with the plugin installed, every ``import jax`` on a machine
without CUDA prints the plugin's failed initialization):

    JAXSPEC_AOT=1 scripts/env.sh                               # makes .venv-aot
    .venv-aot/bin/python benchmarks/gpu_launches.py            # plain, EAGLE-3, ... at batch 1 and 16
    .venv-aot/bin/python benchmarks/gpu_launches.py --methods plain --batches 1 \\
        --implementation rope_write=xla,rms_norm=xla           # the small kernels on XLA
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax starts: the plugin cannot initialize without CUDA

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hlo_copies import computations  # noqa: E402

# --------------------------------------------------------------------------- the target device

# Datasheet and CUDA device-query facts of the SXM parts; XLA reads them to size its kernels.
GPUS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", memory=80 * 2**30, bandwidth=3.35e12, l2=50 * 2**20, clock_ghz=1.98),
    "h200": dict(name="NVIDIA H200", memory=141 * 10**9, bandwidth=4.8e12, l2=50 * 2**20, clock_ghz=1.98),
}


def target_config(gpu: str) -> str:
    """A GpuTargetConfigProto (text format) for a Hopper SXM part: 132 SMs, compute capability 9.0."""
    g = GPUS[gpu]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(g["bandwidth"])}
  l2_cache_size: {g["l2"]}
  clock_rate_ghz: {g["clock_ghz"]}
  device_memory_size: {g["memory"]}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability {{ major: 9 minor: 0 }}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{g["name"]}"
"""


def gpu_device(gpu: str):
    """A compile-only device of ``gpu`` (needs jaxlib's CUDA plugin, not a GPU)."""
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=target_config(gpu))
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise SystemExit(f"cannot compile for a GPU here ({e}); this needs jaxlib's CUDA plugin "
                         f"(JAXSPEC_AOT=1 scripts/env.sh) and JAX_PLATFORMS=cpu set before jax starts") from e
    return topo.devices[0]


# --------------------------------------------------------------------------- counting launches

_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OP = re.compile(r"[\])}]\s+([\w\-]+)\(")  # the op follows the (possibly tuple) result type
_ROOT = re.compile(r"^\s*ROOT\s")
# Instructions that launch nothing (buffer plumbing) or whose work is counted in what they call.
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency", "fusion-done", "copy-done", "all-reduce-done"}


def instructions(lines: list[str]):
    """(name, op, line) of each instruction line of a computation."""
    for line in lines:
        h = _HEAD.match(line)
        o = h and _OP.search(line, h.end())
        if o:
            yield h.group(1), o.group(1), line


def kernel_kind(op: str, line: str, roots: dict[str, str | None]) -> str:
    """The class of kernel one scheduled instruction launches."""
    target = re.search(r'custom_call_target="([^"]+)"', line)
    if target:
        t = target.group(1)
        return "Pallas (Triton)" if "triton" in t else ("cuBLAS" if "cublas" in t else f"custom call {t}")
    if op in ("fusion", "fusion-start"):
        if "__custom_fusion" in line or "dynamic_slice_fusion" in line:
            return "cuBLAS"  # a library GEMM reading a slice of its operand where it lies
        if "__triton" in line:
            return "XLA Triton fusion"
        called = re.search(r"\bcalls=%?([\w.\-]+)", line)
        return f"XLA fusion: {roots.get(called.group(1)) if called else '?'}"
    return op


def _root_ops(comps: dict[str, list[str]]) -> dict[str, str | None]:
    out = {}
    for name, lines in comps.items():
        out[name] = next((op for _, op, line in instructions(lines) if _ROOT.match(line)), None)
    return out


@dataclasses.dataclass
class Launches:
    """Kernels per step of a program whose step loop has no static trip count."""

    per_step: collections.Counter
    loops: list[tuple[str, int]]  # (loop, trips) of the static loops inside the step

    @property
    def total(self) -> int:
        return sum(self.per_step.values())


def step_launches(hlo: str) -> Launches:
    """Count the kernels one iteration of the program's outer loop with an unknown trip count (the
    engine's step loop) launches: every scheduled instruction once, the body of a loop with a known
    trip count (the layer scan) times its trips, a loop inside the step with no known trip count
    once (body and condition), the largest branch of a conditional, the step loop's condition once."""
    comps = computations(hlo)
    roots = _root_ops(comps)
    entry = re.search(r"^ENTRY %?([\w.\-]+)", hlo, re.M).group(1)
    steps: list[collections.Counter] = []
    loops: list[tuple[str, int]] = []

    def count(comp: str, in_step: bool) -> collections.Counter:
        c: collections.Counter = collections.Counter()
        for name, op, line in instructions(comps.get(comp, [])):
            if op in _FREE:
                continue
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                cond = re.search(r"condition=%?([\w.\-]+)", line).group(1)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                if trips is None and not in_step:  # the step loop
                    steps.append(count(body, True) + count(cond, True))
                    continue
                n = int(trips.group(1)) if trips else 1
                if in_step:
                    loops.append((name, n))
                # A loop of known trip count runs its body n times without evaluating its condition:
                # the H200's traces show no condition kernel, where 32 a step would rank among the
                # heaviest.
                inner = count(body, in_step) + (count(cond, in_step) if trips is None else collections.Counter())
                c.update({k: v * n for k, v in inner.items()})
            elif op == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                names = (re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches
                         else re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line))
                c.update(max((count(b, in_step) for b in names), key=lambda x: sum(x.values())))
                c["conditional"] += 1
            elif op == "call":
                c.update(count(re.search(r"to_apply=%?([\w.\-]+)", line).group(1), in_step))
            else:
                c[kernel_kind(op, line, roots)] += 1
        return c

    count(entry, False)
    if len(steps) != 1:
        raise ValueError(f"expected one step loop (a while without a known trip count), found {len(steps)}")
    return Launches(per_step=steps[0], loops=loops)


# --------------------------------------------------------------------------- the programs


def _parse_implementation(text: str | None):
    if not text:
        return None
    if text in ("pallas", "xla"):
        return text
    return tuple(tuple(kv.split("=", 1)) for kv in text.split(","))


def target_shape(name: str):
    """A target shape of ``step_timing`` by name: the Llama-3-8B shape, the Qwen3.5-9B-shaped hybrid or
    the DeepSeek-V4-Flash-shaped target (10 layers, 32 experts)."""
    import step_timing as st

    return {"llama3-8b": lambda: st.LLAMA3_8B, "llama3.2-1b": lambda: st.LLAMA32_1B, "qwen3-0.6b": lambda: st.QWEN3_06B,
            "qwen35": st.qwen35_shape, "v4": st.v4_shape}[name]()


def decode_hlo(method: str, batch: int, *, gpu: str, implementation=None, context: int = 1024,
               steps: int = 4, product_rows: int | None = None, options: dict | None = None,
               target: str = "llama3-8b", one_row_rows: int = 1) -> tuple[str, float]:
    """The optimized HLO of the engine's decode program for ``method`` ("plain" or a name in
    ``step_timing.METHODS``) at the ``target`` shape (``target_shape``), compiled for ``gpu``; and its
    compile seconds.
    ``product_rows``: the row multiple forwards pad to, instead of the GPU's
    (``dispatch.product_rows``; 1 turns the padding off). ``one_row_rows``: the rows a one-token forward
    at batch 1 runs over (``dispatch.one_row_padded_to``). ``options``: XLA options over the engine's
    table (``jaxspec.xla_options``)."""
    import step_timing as st
    from jaxspec.config import EngineConfig
    from jaxspec.engine.geometry import engine_geometry, next_pow2
    from jaxspec.kvcache.paging import PageTables, WindowTable
    from jaxspec.engine.programs import decode_program
    from jaxspec.kvcache.paging import pages_needed
    from jaxspec.model.drafts.base import DraftModel, zero_pool
    from jaxspec.model.targets import Model, create_target_pool, kv_layout
    from jaxspec.pallas import dispatch
    from jaxspec.spec.plan import Plan, verify_branches_on
    from jaxspec.xla_options import resolve_options

    device = gpu_device(gpu)
    sharding = jax.sharding.SingleDeviceSharding(device)
    cfg, dtype = target_shape(target), jnp.bfloat16
    target = Model(config=cfg, params=jax.eval_shape(lambda: st.random_target(cfg, dtype).params),
                   dtype=np.dtype(dtype))
    draft, spec = None, None
    if method != "plain":
        m = next(x for x in st.METHODS + [st.HYBRID_MTP] if x.name == method)
        spec, made = m.spec, {}

        def build():
            d = m.make(target, False)
            made["config"] = d.config
            return d.params

        draft = DraftModel(config=None, params=jax.eval_shape(build))
        draft = DraftModel(config=made["config"], params=draft.params)
    plan = Plan(target=cfg, draft=None if draft is None else draft.config, spec=spec, page_size=16,
                steps_per_call=steps, implementation=_parse_implementation(implementation),
                compiler_options=resolve_options(None, "gpu"), verify_branches=verify_branches_on("gpu"),
                greedy_only=True)
    width = next_pow2(pages_needed(context + st.ACCEPT_ROOM * 2 * steps + plan.lookahead + plan.max_accept, 16))
    num_pages = batch * width + 1
    # The engine's own sizes for the pools and tables beyond the full one (a sliding-window ring,
    # compressed-KV entry tables): its geometry for rows of ``width`` pages.
    geo = engine_geometry(plan, EngineConfig(page_size=16, max_batch=batch, max_seq_len=width * 16 - plan.lookahead,
                                             steps_per_call=steps, prefix_cache=False), kv_layout(cfg))
    assert (geo.width, geo.num_pages) == (width, num_pages), (geo.width, geo.num_pages, width, num_pages)
    sizes = geo.pool_sizes()
    tpool = jax.eval_shape(lambda: create_target_pool(cfg, dtype=dtype, **sizes))
    table = jax.ShapeDtypeStruct((batch, width), jnp.int32)
    if geo.window is not None or geo.entry_rates:
        ring = None if geo.window is None else WindowTable(pages=jax.ShapeDtypeStruct((batch, geo.window_ring), jnp.int32),
                                                           first=jax.ShapeDtypeStruct((batch,), jnp.int32))
        table = PageTables(full=table, window=ring, compressed=tuple(
            jax.ShapeDtypeStruct((batch, geo.entry_width(m)), jnp.int32) for m in geo.entry_rates))
    dpool = (zero_pool(16, dtype) if draft is None else
             jax.eval_shape(lambda: draft.config.create_pool(num_pages=num_pages, page_size=16, dtype=dtype)))
    state = jax.eval_shape(lambda: st.ready_state(plan, target, draft, batch=batch, context=context,
                                                  out_width=next_pow2(2 * steps * plan.max_accept + 2), max_new=64,
                                                  max_len=width * 16))

    def placed(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)

    args = [placed(x) for x in (target.params, None if draft is None else draft.params, state, tpool, dpool, table)]
    mesh = jax.sharding.Mesh(np.array([device]), ("x",))
    t0 = time.perf_counter()
    # The kernels dispatch as on that GPU (natively, its block-table entries), and Pallas lowers for
    # its kind (the abstract mesh's device).
    on_gpu = dispatch.on_gpu
    dispatch.on_gpu = lambda: True
    try:
        with (dispatch.assume_gpu(gpu), jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
              dispatch.rows_padded_to(product_rows) if product_rows else contextlib.nullcontext(),
              dispatch.one_row_padded_to(one_row_rows)):
            lowered = decode_program.lower(plan, *args)
    finally:
        dispatch.on_gpu = on_gpu
    compiled = lowered.compile({**dict(plan.compiler_options), **(options or {}), "xla_gpu_autotune_level": 0})
    return compiled.as_text(), time.perf_counter() - t0


def main(argv=None) -> int:
    import step_timing as st

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    p.add_argument("--methods", default="plain," + ",".join(m.name for m in st.METHODS),
                   help="comma-separated: plain and names of step_timing.METHODS (with --target qwen35 also "
                        f"{st.HYBRID_MTP.name!r})")
    p.add_argument("--batches", default="1,16", help="comma-separated powers of two (the engine's decode batches)")
    p.add_argument("--target", default="llama3-8b", choices=("llama3-8b", "llama3.2-1b", "qwen3-0.6b", "qwen35", "v4"),
                   help="the target's shape: Llama-3-8B, Llama-3.2-1B, Qwen3-0.6B, the Qwen3.5-9B-shaped hybrid or "
                        "the DeepSeek-V4-Flash-shaped target")
    p.add_argument("--implementation", default=None,
                   help='EngineConfig.implementation: "pallas", "xla" or op=choice pairs, e.g. rope_write=xla')
    p.add_argument("--product-rows", type=int, default=None,
                   help="the row multiple forwards pad to (default: the GPU's, 8; 1: no padding)")
    p.add_argument("--one-row-rows", type=int, default=1,
                   help="the rows a one-token forward at batch 1 runs over (default 1: as the engine runs it)")
    p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an XLA option over the engine's table (repeatable), e.g. xla_gpu_dot_merger_threshold_mb=0")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--hlo-dir", default=None, help="also write each program's optimized HLO here")
    args = p.parse_args(argv)
    options = {}
    for pair in args.xla_option:
        name, value = pair.split("=", 1)
        options[name] = {"true": True, "false": False}.get(value.lower(), int(value) if value.lstrip("-").isdigit()
                                                           else value)
    rows = []
    print("| method | batch | kernels per step | cuBLAS | Pallas | XLA fusions | other | compile s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    batches = [int(b) for b in args.batches.split(",")]
    odd = [b for b in batches if b < 1 or b & (b - 1)]
    if odd:  # the engine's decode batches are powers of two (3 requests run as 4 rows): count those
        p.error(f"--batches {odd}: the engine's decode batches are powers of two (it runs 3 requests as 4 rows)")
    for method in args.methods.split(","):
        for batch in batches:
            hlo, seconds = decode_hlo(method, batch, gpu=args.gpu, implementation=args.implementation,
                                      product_rows=args.product_rows, options=options, target=args.target,
                                      one_row_rows=args.one_row_rows)
            if args.hlo_dir:
                Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
                Path(args.hlo_dir, f"{re.sub(r'[^A-Za-z0-9]+', '_', method)}_b{batch}.hlo.txt").write_text(hlo)
            n = step_launches(hlo)
            by = collections.Counter()
            for kind, k in n.per_step.items():
                by["cuBLAS" if kind == "cuBLAS" else "Pallas" if kind.startswith("Pallas") else
                   "XLA" if kind.startswith("XLA") else "other"] += k
            rows.append(dict(method=method, batch=batch, gpu=args.gpu, target=args.target,
                             implementation=args.implementation,
                             product_rows=args.product_rows, one_row_rows=args.one_row_rows, xla_options=options,
                             kernels_per_step=n.total, by_kind=dict(n.per_step), compile_s=seconds))
            print(f"| {method} | {batch} | {n.total} | {by['cuBLAS']} | {by['Pallas']} | {by['XLA']} | {by['other']} "
                  f"| {seconds:.1f} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(gpu=args.gpu, jax=jax.__version__, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
