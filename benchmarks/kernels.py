"""Kernel microbenchmarks: each Pallas kernel against its XLA path and its own floor.

    python benchmarks/kernels.py                 # time every kernel (GPU), table + JSON
    python benchmarks/kernels.py --check         # validate every kernel natively vs its reference
    python benchmarks/kernels.py --smoke         # tiny shapes (runs anywhere; interpret mode off-GPU)

Method (DESIGN section 8): jit each path once, warm up, then time ``repeats`` calls, each
followed by ``block_until_ready``, and report the median. The floor of a kernel is the bytes it
must move (unique reads + writes) over the HBM bandwidth of the device (datasheet: H100 SXM
3.35 TB/s, H200 4.8 TB/s; ``--bandwidth`` overrides). Times include the launch, as in the
engine. The verify-step attention is timed at the Llama-3-8B shape (32 q heads, 8 KV heads,
D = 128, bf16) for batch 1 and 16, context 1k and 8k, n = 8 and 64 tree nodes.

Absolute numbers only mean something on a GPU, with the device named (it is printed and
stored in the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from jaxspec.pallas import dispatch  # noqa: E402
from jaxspec.pallas.gather_extras import gather_spec_extras  # noqa: E402
from jaxspec.pallas.kv_move import kv_move  # noqa: E402
from jaxspec.pallas.paged_attention import paged_attention  # noqa: E402

HBM_TB_PER_S = {"H200": 4.8, "H100": 3.35}  # datasheet peak, matched in device_kind


# --------------------------------------------------------------------------- timing


def median_seconds(fn, args, *, warmup: int, repeats: int, feed_back: bool = False) -> float:
    """Median wall time of ``fn(*args)`` with ``block_until_ready``. ``feed_back``: ``fn``
    donates its first argument, so each call's output is the next call's input."""
    for _ in range(warmup):
        out = jax.block_until_ready(fn(*args))
        if feed_back:
            args = (out,) + tuple(args[1:])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
        if feed_back:
            args = (out,) + tuple(args[1:])
    return statistics.median(times)


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{d.device_kind}"


def bandwidth_bytes_per_s(override_tb: float | None) -> float | None:
    if override_tb:
        return override_tb * 1e12
    kind = jax.devices()[0].device_kind
    for name, tb in HBM_TB_PER_S.items():
        if name in kind:
            return tb * 1e12
    return None


# --------------------------------------------------------------------------- problems


@dataclasses.dataclass(frozen=True)
class AttnShape:
    name: str
    batch: int
    context: int  # committed prefix per request
    nodes: int  # T = n tree nodes (verify); 1 = decode
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "bfloat16"


def attention_problem(s: AttnShape, seed: int = 0):
    """Random verify step: prefix ``context``, a random tree of ``nodes`` (root, ancestors, self)."""
    rng = np.random.default_rng(seed)
    P = s.page_size
    W = -(-(s.context + s.nodes) // P)
    num_pages = s.batch * W + 1
    N = num_pages * P
    dt = jnp.dtype(s.dtype)
    key = jax.random.PRNGKey(seed)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (s.batch, s.nodes, s.q_heads, s.head_dim), dt)
    k_pool = jax.random.normal(kk, (1, N, s.kv_heads, s.head_dim), dt)
    v_pool = jax.random.normal(kv, (1, N, s.kv_heads, s.head_dim), dt)
    table = jnp.asarray((1 + rng.permutation(s.batch * W)).reshape(s.batch, W), jnp.int32)
    prefix = jnp.full((s.batch,), s.context, jnp.int32)
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, s.nodes)]
    m = np.eye(s.nodes, dtype=bool)
    for i in range(s.nodes):
        j = parent[i]
        while j >= 0:
            m[i, j] = True
            j = parent[j]
    mask = jnp.asarray(np.broadcast_to(m, (s.batch, s.nodes, s.nodes)))
    args = (q, k_pool, v_pool, jnp.int32(0), table, prefix, mask)
    floor = (2 * s.batch * (s.context + s.nodes) * s.kv_heads * s.head_dim  # K and V, visible only
             + 2 * q.size) * dt.itemsize  # q in, o out
    return args, floor


def attention_fn(s: AttnShape, implementation: str):
    return jax.jit(functools.partial(
        paged_attention, page_size=s.page_size, sm_scale=s.head_dim ** -0.5, implementation=implementation,
    ))


@dataclasses.dataclass(frozen=True)
class MoveShape:
    name: str
    layers: int
    num_slots: int
    row_shapes: tuple[tuple[int, ...], ...]  # trailing shape of each buffer
    batch: int
    steps: int  # S: moves per request
    dtype: str = "bfloat16"


def move_problem(s: MoveShape, seed: int = 0):
    """Accepted paths that skip nodes: request b moves positions base+2j -> base+j (j = 1..S)."""
    dt = jnp.dtype(s.dtype)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(s.row_shapes))
    bufs = tuple(jax.random.normal(k, (s.layers, s.num_slots) + shape, dt) for k, shape in zip(keys, s.row_shapes))
    per_req = s.num_slots // s.batch
    base = np.arange(s.batch)[:, None] * per_req + 8
    j = np.arange(1, s.steps + 1)[None, :]
    src = jnp.asarray((base + 2 * j).reshape(-1), jnp.int32)
    dst = jnp.asarray((base + j).reshape(-1), jnp.int32)
    row_bytes = sum(int(np.prod(shape)) for shape in s.row_shapes) * dt.itemsize
    floor = 2 * s.layers * s.batch * s.steps * row_bytes  # read each source row, write each target
    return (bufs, src, dst), floor


def move_fn(implementation: str):
    return jax.jit(functools.partial(kv_move, implementation=implementation), donate_argnums=0)


@dataclasses.dataclass(frozen=True)
class GatherShape:
    name: str
    batch: int
    rows_per_request: int  # A = S + 1
    topk: int
    hidden: int | None
    dtype: str = "bfloat16"


def gather_problem(s: GatherShape, seed: int = 0):
    rng = np.random.default_rng(seed)
    N = s.batch * s.rows_per_request
    index = jnp.asarray(np.arange(s.batch) * s.rows_per_request + rng.integers(0, s.rows_per_request, s.batch),
                        jnp.int32)
    topk_p = jnp.asarray(rng.random((N, s.topk)), jnp.float32)
    topk_index = jnp.asarray(rng.integers(0, 128000, (N, s.topk)), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, 128000, N), jnp.int32)
    dt = jnp.dtype(s.dtype)
    hidden = None if s.hidden is None else jnp.asarray(rng.standard_normal((N, s.hidden)), dt)
    row = s.topk * 8 + 4 + (0 if s.hidden is None else s.hidden * dt.itemsize)
    floor = 2 * s.batch * row + 4 * s.batch
    return (index, topk_p, topk_index, tokens, hidden), floor


def gather_fn(implementation: str):
    return jax.jit(functools.partial(gather_spec_extras, implementation=implementation))


# --------------------------------------------------------------------------- shapes


def verify_shapes(smoke: bool) -> list[AttnShape]:
    if smoke:
        return [AttnShape("verify-smoke", 2, 40, 4, q_heads=4, kv_heads=2, head_dim=16, dtype="float32")]
    return [AttnShape(f"llama3-8b verify B={b} ctx={c} n={n}", b, c, n)
            for b in (1, 16) for c in (1024, 8192) for n in (8, 64)]


def other_attention_shapes(smoke: bool) -> list[AttnShape]:
    if smoke:
        return []
    return [AttnShape("llama3-8b decode B=16 ctx=8192", 16, 8192, 1),
            AttnShape("llama3-8b draft-extend B=16 ctx=8192 T=8 causal", 16, 8192, 8)]


def move_shapes(smoke: bool) -> list[MoveShape]:
    if smoke:
        return [MoveShape("move-smoke", 2, 256, ((2, 16), (2, 16)), 4, 3, "float32")]
    return [
        MoveShape("llama3-8b k+v B=16 S=7", 32, 16 * 4096, ((8, 128), (8, 128)), 16, 7),
        MoveShape("deepseek-v3 latent+indexer B=16 S=7", 61, 16 * 2048, ((576,), (128,)), 16, 7),
    ]


def gather_shapes(smoke: bool) -> list[GatherShape]:
    if smoke:
        return [GatherShape("gather-smoke", 4, 4, 4, 32, "float32")]
    return [GatherShape("eagle3 llama3-8b B=16 A=8 topk=8", 16, 8, 8, 4096),
            GatherShape("standalone B=16 A=8 topk=8 (no hidden)", 16, 8, 8, None)]


# --------------------------------------------------------------------------- runs


def bench(args) -> list[dict]:
    bw = bandwidth_bytes_per_s(args.bandwidth)
    rows = []

    def record(kind, name, floor_bytes, t_pallas, t_xla):
        floor_s = floor_bytes / bw if bw else None
        rows.append(dict(
            kind=kind, name=name, bytes=int(floor_bytes), pallas_us=t_pallas * 1e6, xla_us=t_xla * 1e6,
            floor_us=None if floor_s is None else floor_s * 1e6,
            speedup_vs_xla=t_xla / t_pallas,
            pallas_over_floor=None if floor_s is None else t_pallas / floor_s,
        ))
        print(f"  {kind:9s} {name}: pallas {t_pallas * 1e6:9.1f} us, xla {t_xla * 1e6:9.1f} us", flush=True)

    timing = dict(warmup=args.warmup, repeats=args.repeats)
    for s in verify_shapes(args.smoke) + other_attention_shapes(args.smoke):
        a, floor = attention_problem(s)
        if s.nodes == 1 or "causal" in s.name:
            a = a[:6] + (None,)
        t_p = median_seconds(attention_fn(s, "pallas"), a, **timing)
        t_x = median_seconds(attention_fn(s, "xla"), a, **timing)
        record("attention", s.name, floor, t_p, t_x)
    for s in move_shapes(args.smoke):
        (bufs, src, dst), floor = move_problem(s)
        t_p = median_seconds(move_fn("pallas"), (bufs, src, dst), feed_back=True, **timing)
        del bufs
        (bufs, src, dst), _ = move_problem(s)
        t_x = median_seconds(move_fn("xla"), (bufs, src, dst), feed_back=True, **timing)
        del bufs
        record("kv_move", s.name, floor, t_p, t_x)
    for s in gather_shapes(args.smoke):
        a, floor = gather_problem(s)
        t_p = median_seconds(gather_fn("pallas"), a, **timing)
        t_x = median_seconds(gather_fn("xla"), a, **timing)
        record("gather", s.name, floor, t_p, t_x)
    return rows


def markdown(rows: list[dict], device: str, bw: float | None) -> str:
    lines = [f"Device: {device}; floor bandwidth: {'unknown' if bw is None else f'{bw / 1e12:.2f} TB/s'}", "",
             "| kernel | shape | Pallas (us) | XLA (us) | floor (us) | XLA / Pallas | Pallas / floor |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        floor = "n/a" if r["floor_us"] is None else f"{r['floor_us']:.1f}"
        over = "n/a" if r["pallas_over_floor"] is None else f"{r['pallas_over_floor']:.2f}"
        lines.append(f"| {r['kind']} | {r['name']} | {r['pallas_us']:.1f} | {r['xla_us']:.1f} | {floor} | "
                     f"{r['speedup_vs_xla']:.2f} | {over} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- --check


def check(args) -> bool:
    """Every kernel natively (interpret mode off-GPU) against its reference."""
    ok = True

    def report(name, fn):
        nonlocal ok
        try:
            fn()
            print(f"  PASS {name}", flush=True)
        except AssertionError as e:
            ok = False
            print(f"  FAIL {name}: {str(e).splitlines()[0] if str(e) else e}", flush=True)

    tol = {"bfloat16": 3e-2, "float32": 2e-5}
    check_shapes = [AttnShape("check verify B=2 ctx=300 n=8", 2, 300, 8),
                    AttnShape("check verify B=3 ctx=1000 n=64 f32", 3, 1000, 64, dtype="float32"),
                    AttnShape("check decode B=4 ctx=777 page1", 4, 777, 1, page_size=1)]
    if args.smoke:
        check_shapes = verify_shapes(True)
    for s in check_shapes:
        def attn(s=s):
            a, _ = attention_problem(s, seed=1)
            if s.nodes == 1:
                a = a[:6] + (None,)
            got = np.asarray(attention_fn(s, "pallas")(*a), np.float32)
            want = np.asarray(attention_fn(s, "xla")(*a), np.float32)
            np.testing.assert_allclose(got, want, atol=tol[s.dtype], rtol=tol[s.dtype])
        report(f"attention {s.name}", attn)
    for s in move_shapes(True) + ([] if args.smoke else [
            MoveShape("check mla+indexer", 3, 4096, ((576,), (128,)), 4, 5)]):
        def move(s=s):
            (bufs, src, dst), _ = move_problem(s, seed=2)
            # Overlap: make the target of each later move the source of the one before.
            src = src.reshape(s.batch, s.steps).at[:, :-1].set(dst.reshape(s.batch, s.steps)[:, 1:]).reshape(-1)
            want = [np.asarray(b) for b in kv_move(bufs, src, dst, implementation="xla")]
            got = kv_move(bufs, src, dst, implementation="pallas")
            for g, w in zip(got, want):
                np.testing.assert_array_equal(np.asarray(g), w)
        report(f"kv_move {s.name}", move)
    for s in gather_shapes(args.smoke) if args.smoke else gather_shapes(False):
        def gather(s=s):
            a, _ = gather_problem(s, seed=3)
            for g, w in zip(gather_spec_extras(*a, implementation="pallas"), gather_spec_extras(*a, implementation="xla")):
                if w is not None:
                    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        report(f"gather {s.name}", gather)
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="validate every kernel against its reference, then exit")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (any backend)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--bandwidth", type=float, default=None, help="HBM TB/s for the floor (default: by device)")
    p.add_argument("--json", default="kernels.json", help="where to write the results")
    args = p.parse_args(argv)
    device = device_name()
    mode = "native" if dispatch.on_gpu() else "interpret mode (no GPU: times are not kernel times)"
    print(f"device: {device}; Pallas {mode}", flush=True)
    if args.check:
        ok = check(args)
        print("all kernels match their references" if ok else "MISMATCH", flush=True)
        return 0 if ok else 1
    rows = bench(args)
    bw = bandwidth_bytes_per_s(args.bandwidth)
    table = markdown(rows, device, bw)
    print(table)
    Path(args.json).write_text(json.dumps(dict(
        device=device, pallas_mode=mode, bandwidth_tb_s=None if bw is None else bw / 1e12,
        jax_version=jax.__version__, warmup=args.warmup, repeats=args.repeats,
        command=" ".join(["python", "benchmarks/kernels.py"] + (argv if argv is not None else sys.argv[1:])),
        results=rows,
    ), indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
