"""Kernel microbenchmarks: each Pallas kernel against its XLA path and its own floor.

    python benchmarks/kernels.py                 # time every kernel (GPU), table + JSON
    python benchmarks/kernels.py --check         # validate every kernel natively vs its reference
    python benchmarks/kernels.py --smoke         # tiny shapes (runs anywhere; interpret mode off-GPU)
    python benchmarks/kernels.py --xla-vs-reference   # the lean XLA path vs the f32 reference (any device)

Device time (``device_seconds``): N calls of a path inside one compiled program, a ``lax.fori_loop``
of static trip count (XLA:GPU runs it without a host round trip per iteration) whose body feeds an
output of each call into the next call's inputs (a zero XLA cannot prove is zero is added to the
queries and to every index array, a moved KV buffer is carried whole), so that XLA can neither hoist
a call (or a gather of KV pages) out of the loop nor merge two calls. The program is timed at N and
at 1 calls (medians of ``repeats`` runs each, ``block_until_ready``) and the
difference divided by N - 1: the launch of the program and the host's dispatch cancel, so a small
shape reports its kernel, not the ~65 us a dispatched call costs. N is chosen from the one-call
program's time (dispatch included) so that the N calls take at most about 20 ms.

The floor of a kernel is the bytes it must move (unique reads + writes) over an HBM bandwidth: the
datasheet's (H100 SXM 3.35 TB/s, H200 4.8 TB/s; ``--bandwidth`` overrides) and, where a measured
device-to-device copy bandwidth is given (``benchmarks/gpu_check.py`` measures one), that one. Shapes:
paged attention at the Llama-3-8B shape (32 q heads, 8 KV heads, D = 128, bf16) at B = 16 and context
8192 for decode, an 8- and a 64-node verify and a causal 8-token draft extend; MLA at the
DeepSeek-V3 shape (128 heads, latent 512 + rope 64) at B = 32 and context 4096, decode and an 8-node
verify; the DSA indexer scores at DeepSeek-V3.2's (64 heads x 128, page 64); KV moves of accepted
paths; the gather of the accepted rows' extras; RoPE and the K/V write of one Llama-3-8B layer at
decode (B = 1) and an 8-node verify (B = 16), and its RMSNorm at the same row counts, each against
XLA's kernels for the same; one MoE layer's routed experts (``experts_shapes``) through the
grouped-matmul kernel against the XLA path.

``--xla-vs-reference`` times, in one run on any device, the XLA path users run
(``implementation="xla"``, the CPU default and the GPU fallback: pool-dtype operands, f32
accumulation) against the f32 HIGHEST reference the tests use as their oracle (dispatched calls).

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
from jaxspec.xla_options import compiler_options  # noqa: E402
from jaxspec.pallas.dsa_indexer import index_scores, index_scores_reference  # noqa: E402
from jaxspec.pallas.exact_attention import exact_attention  # noqa: E402
from jaxspec.pallas.fixed_matmul import fixed_matmul_pallas  # noqa: E402
from jaxspec.pallas.gather_extras import gather_spec_extras  # noqa: E402
from jaxspec.pallas.kv_move import kv_move  # noqa: E402
from jaxspec.kvcache.pool import KVPool  # noqa: E402
from jaxspec.model.config import RopeConfig  # noqa: E402
from jaxspec.model.layers import Rope, routed_experts, rotate_and_write, stacked_rms_norm  # noqa: E402
from jaxspec.pallas.rms_norm import record_reference, rms_norm_reference  # noqa: E402
from jaxspec.pallas.sinkhorn import sinkhorn, sinkhorn_reference  # noqa: E402
from jaxspec.pallas.mla_attention import mla_attention, mla_attention_reference, mla_attention_xla  # noqa: E402
from jaxspec.pallas.paged_attention import (  # noqa: E402
    paged_attention, paged_attention_reference, paged_attention_xla,
)

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


def _zero_from(out) -> jax.Array:
    """f32 zero computed from the first element of ``out``: XLA cannot prove it is zero (it depends
    on data), so whatever adds it waits for ``out``."""
    d = jax.tree.leaves(out)[0].reshape(-1)[0].astype(jnp.float32)
    return jnp.where(jnp.isnan(d), 0.0, jnp.minimum(jnp.abs(d), 0.0))


def tie(args: tuple, out, feed_back: bool = False) -> tuple:
    """The next call's inputs: ``out`` itself for the first argument when ``feed_back`` (a buffer the
    call updates), else the first floating argument plus a data-dependent zero at one element; and
    every integer index array plus that zero, so that no index computation or gather is loop-invariant."""
    zero = _zero_from(out)
    args = list(args)
    if feed_back:
        args[0] = out
    done = feed_back
    for i, a in enumerate(args):
        if not isinstance(a, jax.Array) or a.ndim == 0 or (feed_back and i == 0):
            continue
        if jnp.issubdtype(a.dtype, jnp.floating) and not done:
            args[i] = a.at[(0,) * a.ndim].add(zero.astype(a.dtype))
            done = True
        elif jnp.issubdtype(a.dtype, jnp.integer):
            args[i] = a + zero.astype(a.dtype)
    return tuple(args)


@functools.lru_cache(maxsize=None)
def _looped(fn, feed_back: bool):
    # The engine's XLA options (cuBLAS for the products on a GPU), so the XLA column is what the engine
    # runs. ``n`` is static: the loop has a known trip count, which XLA:GPU runs body after body without
    # evaluating its condition. With a traced ``n`` each iteration copied the condition's result to the
    # host and waited for it before launching the next body, so every call paid a round trip and the
    # launches after it: small kernels measured 15-30 us an iteration on an H100 (``rms_norm`` 29 us),
    # where the engine's own step runs them in about 2 us.
    @functools.partial(jax.jit, static_argnums=0, compiler_options=compiler_options() or None)
    def run(n: int, args):
        return jax.lax.fori_loop(0, n, lambda i, a: tie(a, fn(*a), feed_back), args)

    return run


def device_seconds(fn, args, *, repeats: int = 5, feed_back: bool = False, target_s: float = 0.02,
                   n_max: int = 4000, n_fixed: int | None = None) -> tuple[float, int]:
    """Device seconds of one call of ``fn(*args)`` (``fn`` traceable, not jitted itself): N calls in one
    compiled loop of known trip count, each fed the previous one's output (``tie``), timed at N and at 1
    call (two programs); returns (the difference over N - 1, N). ``n_fixed`` fixes N (dry runs); else N
    makes the loop about ``target_s`` long, judged from the one-call program's time (an upper bound of
    one call: it includes the dispatch)."""
    run = _looped(fn, feed_back)
    args = tuple(args)

    def timed(n: int) -> float:
        jax.block_until_ready(run(n, args))  # compiles (one program per N)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(run(n, args))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    t1 = timed(1)
    n = max(2, n_fixed) if n_fixed is not None else int(min(n_max, max(8, target_s / max(t1, 1e-7))))
    tn = timed(n)
    return max(tn - t1, 0.0) / (n - 1), n


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
class MLAShape:
    name: str
    batch: int
    context: int
    nodes: int  # T (1 = decode, causal)
    heads: int = 128
    latent: int = 512
    rope: int = 64
    page_size: int = 16
    dtype: str = "bfloat16"


def paging_problem(s, seed: int):
    """The page table, prefix lengths, block mask (a random tree; None for decode) and pool
    slots N of ``attention_problem`` for a shape with ``name, batch, context, nodes, page_size,
    dtype`` (the MLA and indexer problems fill their own pools)."""
    args, _ = attention_problem(AttnShape(s.name, s.batch, s.context, s.nodes, q_heads=1, kv_heads=1, head_dim=1,
                                          page_size=s.page_size, dtype=s.dtype), seed)
    table, prefix, mask = args[4], args[5], args[6]
    N = (table.shape[0] * table.shape[1] + 1) * s.page_size
    return table, prefix, None if s.nodes == 1 else mask, N


def mla_problem(s: MLAShape, seed: int = 0):
    """Random MLA verify (tree of ``nodes``) or decode step over a prefix of ``context``."""
    table, prefix, mask, N = paging_problem(s, seed)
    dt = jnp.dtype(s.dtype)
    kq, kr, kv = jax.random.split(jax.random.PRNGKey(seed + 1), 3)
    q_latent = jax.random.normal(kq, (s.batch, s.nodes, s.heads, s.latent), dt)
    q_rope = jax.random.normal(kr, (s.batch, s.nodes, s.heads, s.rope), dt)
    pool = jax.random.normal(kv, (1, N, s.latent + s.rope), dt)
    floor = (s.batch * (s.context + s.nodes) * (s.latent + s.rope)  # one latent row per visible position
             + q_latent.size + q_rope.size + q_latent.size) * dt.itemsize  # queries in, output out
    return (q_latent, q_rope, pool, jnp.int32(0), table, prefix, mask), floor


def mla_fn(s: MLAShape, implementation):
    kw = dict(page_size=s.page_size, sm_scale=(128 + s.rope) ** -0.5)
    if callable(implementation):
        return jax.jit(functools.partial(implementation, **kw))
    return jax.jit(functools.partial(mla_attention, implementation=implementation, **kw))


@dataclasses.dataclass(frozen=True)
class IndexerShape:
    name: str
    batch: int
    context: int
    nodes: int
    heads: int = 64
    width: int = 128
    page_size: int = 64
    dtype: str = "bfloat16"


def indexer_problem(s: IndexerShape, seed: int = 0):
    """Random index-score step: ``nodes`` rows (a random tree; 1 = decode) after ``context``."""
    table, prefix, mask, N = paging_problem(s, seed)
    dt = jnp.dtype(s.dtype)
    kq, kw, kk = jax.random.split(jax.random.PRNGKey(seed + 2), 3)
    q = jax.random.normal(kq, (s.batch, s.nodes, s.heads, s.width), dt)
    w = jax.random.normal(kw, (s.batch, s.nodes, s.heads), jnp.float32)
    pool = jax.random.normal(kk, (1, N, s.width), dt)
    K = table.shape[1] * s.page_size
    floor = (s.batch * (s.context + s.nodes) * s.width + q.size) * dt.itemsize + w.size * 4 \
        + s.batch * s.nodes * K * 4  # visible keys and queries in, f32 scores out
    return (q, w, pool, jnp.int32(0), table, prefix, mask), floor


def indexer_fn(s: IndexerShape, implementation):
    if callable(implementation):
        return jax.jit(functools.partial(implementation, page_size=s.page_size))
    return jax.jit(functools.partial(index_scores, page_size=s.page_size, implementation=implementation))


def indexer_shapes(smoke: bool) -> list[IndexerShape]:
    if smoke:
        return [IndexerShape("indexer-smoke", 2, 40, 4, heads=4, width=16, page_size=4, dtype="float32")]
    return [IndexerShape(f"deepseek-v3.2 indexer {'decode' if n == 1 else f'verify n={n}'} B={b} ctx={c}", b, c, n)
            for c in (16384, 65536) for b, n in ((1, 1), (16, 8))]


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
    hidden: int | None
    dtype: str = "bfloat16"


def gather_problem(s: GatherShape, seed: int = 0):
    rng = np.random.default_rng(seed)
    N = s.batch * s.rows_per_request
    index = jnp.asarray(np.arange(s.batch) * s.rows_per_request + rng.integers(0, s.rows_per_request, s.batch),
                        jnp.int32)
    tokens = jnp.asarray(rng.integers(0, 128000, N), jnp.int32)
    dt = jnp.dtype(s.dtype)
    hidden = None if s.hidden is None else jnp.asarray(rng.standard_normal((N, s.hidden)), dt)
    row = 4 + (0 if s.hidden is None else s.hidden * dt.itemsize)
    floor = 2 * s.batch * row + 4 * s.batch
    return (index, tokens, hidden), floor


def gather_fn(implementation: str):
    return jax.jit(functools.partial(gather_spec_extras, implementation=implementation))


@dataclasses.dataclass(frozen=True)
class RopeShape:
    name: str
    rows: int  # R = B * T new tokens
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    layers: int = 32
    num_slots: int = 16 * 4096
    dtype: str = "bfloat16"


def rope_problem(s: RopeShape, seed: int = 0):
    """A layer's joined q/k/v heads and the pool: args ``((k_pool, v_pool, q_out), qkv, layer, slots, positions)``."""
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(s.dtype)
    rand = lambda *shape: jnp.asarray(rng.standard_normal(shape), dt)  # noqa: E731
    pool = jnp.zeros((s.layers, s.num_slots, s.kv_heads, s.head_dim), dt)
    qkv = rand(s.rows, 1, s.q_heads + 2 * s.kv_heads, s.head_dim)
    slots = jnp.asarray(rng.choice(np.arange(s.num_slots // 4, s.num_slots), s.rows, replace=False), jnp.int32)
    positions = jnp.asarray(rng.integers(0, 8192, s.rows), jnp.int32)
    q_out = jnp.zeros((s.rows, 1, s.q_heads, s.head_dim), dt)
    args = ((pool, pool + 0, q_out), qkv, jnp.int32(s.layers // 2), slots, positions)
    floor = s.rows * s.head_dim * dt.itemsize * 2 * (s.q_heads + 2 * s.kv_heads)  # read q, k, v; write each once
    return args, floor


def rope_fn(implementation: str):
    """RoPE and the K/V write as the Llama layer runs them (``layers.rotate_and_write``); the rotated
    queries are returned with the pool so that no path can drop them."""
    def fn(out, qkv, layer, slots, positions):
        pool = KVPool(k=out[0], v=out[1], page_size=16)
        rope = Rope(positions[:, None], RopeConfig(theta=500_000.0).inv_freq(qkv.shape[-1]))
        q, pool = rotate_and_write(qkv, pool, layer, slots, rope, q_heads=out[2].shape[2],
                                   implementation=implementation)
        return pool.k, pool.v, q

    return fn


def norm_problem(rows: int, width: int, seed: int = 0, dtype: str = "bfloat16"):
    """Rows of the residual stream and a norm's stacked weights (32 layers): ``(x, weights, layer)``."""
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal((rows, width)), dt)
    w = jnp.asarray(1.0 + 0.1 * rng.standard_normal((32, width)), dt)
    return (x, w, jnp.int32(7)), (2 * rows + 1) * width * dt.itemsize  # read x and one weight row, write


def norm_fn(implementation: str):
    return functools.partial(stacked_rms_norm, eps=1e-5, implementation=implementation)


def sinkhorn_problem(matrices: int, seed: int = 0):
    """DeepSeek-V4-Flash's hyper-connection logits (4 streams): ``(logits,)``; floor: read and write."""
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(3.0 * rng.standard_normal((matrices, 4, 4)), jnp.float32)
    return (logits,), 2 * logits.size * 4


def sinkhorn_fn(implementation: str):
    return functools.partial(sinkhorn, iters=20, eps=1e-6, implementation=implementation)


def sinkhorn_shapes(smoke: bool) -> list[tuple[str, int]]:
    if smoke:
        return [("sinkhorn-smoke", 3)]
    return [("v4-flash decode B=1", 1), ("v4-flash verify n=8 B=32", 256)]


def norm_shapes(smoke: bool) -> list[tuple[str, int, int, str]]:
    if smoke:
        return [("norm-smoke", 3, 40, "float32")]
    return [("llama3-8b decode B=1", 1, 4096, "bfloat16"), ("llama3-8b verify n=8 B=16", 128, 4096, "bfloat16")]


# --------------------------------------------------------------------------- shapes


def verify_shapes(smoke: bool) -> list[AttnShape]:
    """The verify-step attention of the Llama-3-8B shape at B = 16, context 8192."""
    if smoke:
        return [AttnShape("verify-smoke", 2, 40, 4, q_heads=4, kv_heads=2, head_dim=16, dtype="float32")]
    return [AttnShape(f"llama3-8b verify B=16 ctx=8192 n={n}", 16, 8192, n) for n in (8, 64)]


def attention_shapes(smoke: bool) -> list[AttnShape]:
    """Decode, verify n = 8 and 64, and a causal 8-token draft extend (Llama-3-8B, B = 16, ctx 8192)."""
    if smoke:
        return verify_shapes(True)
    return ([AttnShape("llama3-8b decode B=16 ctx=8192", 16, 8192, 1)] + verify_shapes(False)
            + [AttnShape("llama3-8b draft-extend B=16 ctx=8192 T=8 causal", 16, 8192, 8)])


def mla_shapes(smoke: bool) -> list[MLAShape]:
    if smoke:
        return [MLAShape("mla-smoke", 2, 40, 4, heads=4, latent=32, rope=8, dtype="float32")]
    return [MLAShape(f"deepseek-v3 mla {'decode' if n == 1 else f'verify n={n}'} B=32 ctx=4096", 32, 4096, n)
            for n in (1, 8)]


def move_shapes(smoke: bool) -> list[MoveShape]:
    if smoke:
        return [MoveShape("move-smoke", 2, 256, ((2, 16), (2, 16)), 4, 3, "float32")]
    return [
        MoveShape("llama3-8b k+v B=16 S=7", 32, 16 * 4096, ((8, 128), (8, 128)), 16, 7),
        MoveShape("deepseek-v3 latent+indexer B=16 S=7", 61, 16 * 2048, ((576,), (128,)), 16, 7),
    ]


def rope_shapes(smoke: bool) -> list[RopeShape]:
    if smoke:
        return [RopeShape("rope-smoke", 3, 4, 2, 16, 2, 64, "float32")]
    return [RopeShape("llama3-8b decode B=1", 1), RopeShape("llama3-8b verify n=8 B=16", 128)]


def gather_shapes(smoke: bool) -> list[GatherShape]:
    if smoke:
        return [GatherShape("gather-smoke", 4, 4, 32, "float32")]
    return [GatherShape("eagle3 llama3-8b B=16 A=8", 16, 8, 4096),
            GatherShape("tokens only B=16 A=8 (no hidden)", 16, 8, None)]


# --------------------------------------------------------------------------- runs


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One timed shape: its problem (args, floor bytes) and each path as a traceable function."""

    kind: str
    name: str
    problem: object  # () -> (args, floor_bytes)
    path: object  # implementation -> traceable fn(*args)
    feed_back: bool = False  # the first argument is a buffer the call returns updated


def matmul_shapes(smoke: bool) -> list[tuple[str, int, int, int]]:
    """(name, rows, K, N) of the exact mode's fixed-tile product at Llama-3-8B widths."""
    if smoke:
        return [("fixed matmul smoke", 3, 64, 96)]
    return [("llama3-8b q/k/v 1 row", 1, 4096, 6144), ("llama3-8b q/k/v 16 rows", 16, 4096, 6144),
            ("llama3-8b down 16 rows", 16, 14336, 4096), ("llama3-8b lm_head 1 row", 1, 4096, 128256)]


def matmul_problem(rows: int, k: int, n: int, seed: int = 0):
    ka, kb = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(ka, (rows, k), jnp.bfloat16)
    w = (jax.random.normal(kb, (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    return (x, w), 2 * (k * n + rows * (k + n))  # floor: the weight read once, x read, the output written


def matmul_fn(implementation: str):
    if implementation == "pallas":
        return functools.partial(fixed_matmul_pallas, interpret=dispatch.interpret_mode())
    return lambda x, w: x @ w


def one_row_product_shapes(smoke: bool) -> list[tuple[str, int, int]]:
    """(name, K, N) of one-row products whose weight has under 10M elements. XLA:GPU rewrites such an
    ``x[1, K] @ w[K, N]`` as an elementwise multiply and a reduction (its dot strength reduction; the
    10M threshold is fixed in jaxlib 0.11.2, no option turns it off), and writes the multiply out
    where two products share ``x``: the DeepSeek-V4-shaped decode program at batch 1 does so for wq_a,
    wkv and the compressors' products (benchmarks/RESULTS.md). The small drafts' products (a
    1B-shaped model's q/k/v) fall under it too."""
    if smoke:
        return [("one-row product smoke", 64, 96)]
    return [("v4 wq_a 4096x1024", 4096, 1024), ("v4 wkv 4096x512", 4096, 512),
            ("v4 shared expert down 2048x4096", 2048, 4096), ("1B-shaped draft q/k/v 2048x3072", 2048, 3072)]


def one_row_product_fn(implementation: str):
    """The Pallas column: the row padded to eight, as ``dispatch.one_row_padded_to(8)`` runs a forward,
    which XLA leaves a product (cuBLAS on a GPU, reading the weight once, beside a small pad and
    slice; at two rows XLA would pad them to eight around the call); the XLA column: the one-row
    product as XLA compiles it."""
    if implementation == "pallas":
        return lambda x, w: (jnp.pad(x, ((0, 7), (0, 0))) @ w)[:1]
    return lambda x, w: x @ w


@dataclasses.dataclass(frozen=True)
class ExpertsShape:
    """One MoE layer's routed experts: ``tokens`` tokens routed to ``top_k`` of ``experts`` experts
    of hidden ``hidden`` and expert width ``width`` (bf16)."""

    name: str
    tokens: int
    top_k: int
    experts: int
    hidden: int
    width: int


def experts_shapes(smoke: bool) -> list[ExpertsShape]:
    """DeepSeek-V4-Flash's expert widths (4096 x 2048, 6 routed) over 64 experts (the check's V4-shaped
    target has 32; V4-Flash 256), at a verify of 8 nodes for 16 requests (768 assignments: the XLA
    column is ``ragged_dot``, lowered densely) and for one request (48 < 64: the XLA column gathers the
    assigned experts), and a 2048-token prefill; Gemma-4-26B-A4B's (2816 x 704, 8 of 128) at a verify
    of 8 nodes for 4 requests."""
    if smoke:
        return [ExpertsShape("experts-smoke", 8, 2, 4, 64, 32)]
    return [ExpertsShape("v4-like 64 experts verify n=8 B=16", 128, 6, 64, 4096, 2048),
            ExpertsShape("v4-like 64 experts verify n=8 B=1", 8, 6, 64, 4096, 2048),
            ExpertsShape("v4-like 64 experts prefill 2048", 2048, 6, 64, 4096, 2048),
            ExpertsShape("gemma4-26b verify n=8 B=4", 32, 8, 128, 2816, 704)]


def experts_problem(s: ExpertsShape, seed: int = 0):
    """``(x, experts, weights, w_gate, w_up, w_down)`` with each token's experts drawn at random;
    floor: the weights of the experts some token is routed to, read once, x read, the output written."""
    rng = np.random.default_rng(seed)
    experts = np.stack([rng.choice(s.experts, s.top_k, replace=False) for _ in range(s.tokens)]).astype(np.int32)
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(keys[0], (s.tokens, s.hidden), jnp.bfloat16)
    w_gate, w_up = ((jax.random.normal(k, (s.experts, s.hidden, s.width), jnp.float32) * s.hidden ** -0.5)
                    .astype(jnp.bfloat16) for k in keys[1:3])
    w_down = (jax.random.normal(keys[3], (s.experts, s.width, s.hidden), jnp.float32) * s.width ** -0.5).astype(
        jnp.bfloat16)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (s.tokens, s.top_k)), jnp.float32)
    used = len(np.unique(experts))
    floor = 2 * (used * 3 * s.hidden * s.width + 2 * s.tokens * s.hidden)
    return (x, jnp.asarray(experts), weights, w_gate, w_up, w_down), floor


def experts_fn(implementation: str):
    """The routed experts of one layer: the grouped-matmul kernel, or the XLA path (``ragged_dot``, or
    the assigned experts gathered when there are fewer assignments than experts)."""
    return functools.partial(routed_experts, implementation={"grouped_matmul": implementation})


def exact_attention_fn(s: "AttnShape", implementation: str):
    """The exact mode's attention in the Pallas column; the default paged kernel in the XLA column."""
    if implementation == "pallas":
        return functools.partial(exact_attention, page_size=s.page_size, sm_scale=s.head_dim ** -0.5)
    return functools.partial(paged_attention, page_size=s.page_size, sm_scale=s.head_dim ** -0.5,
                             implementation="pallas")


def kernel_cases(smoke: bool) -> list[KernelCase]:
    cases = []
    for s in attention_shapes(smoke):
        causal = s.nodes == 1 or "causal" in s.name

        def problem(s=s, causal=causal):
            a, floor = attention_problem(s)
            return (a[:6] + (None,) if causal else a), floor

        cases.append(KernelCase("attention", s.name, problem, lambda impl, s=s: functools.partial(
            paged_attention, page_size=s.page_size, sm_scale=s.head_dim ** -0.5, implementation=impl)))
    for s in mla_shapes(smoke):
        cases.append(KernelCase("mla", s.name, functools.partial(mla_problem, s), lambda impl, s=s: functools.partial(
            mla_attention, page_size=s.page_size, sm_scale=(128 + s.rope) ** -0.5, implementation=impl)))
    for s in indexer_shapes(smoke):
        cases.append(KernelCase("indexer", s.name, functools.partial(indexer_problem, s),
                                lambda impl, s=s: functools.partial(index_scores, page_size=s.page_size,
                                                                    implementation=impl)))
    for s in move_shapes(smoke):
        cases.append(KernelCase("kv_move", s.name, functools.partial(move_problem, s),
                                lambda impl: functools.partial(kv_move, implementation=impl), feed_back=True))
    for s in gather_shapes(smoke):
        cases.append(KernelCase("gather", s.name, functools.partial(gather_problem, s),
                                lambda impl: functools.partial(gather_spec_extras, implementation=impl)))
    for s in rope_shapes(smoke):
        cases.append(KernelCase("rope_write", s.name, functools.partial(rope_problem, s), rope_fn, feed_back=True))
    for name, rows, width, dtype in norm_shapes(smoke):
        cases.append(KernelCase("rms_norm", name, functools.partial(norm_problem, rows, width, dtype=dtype), norm_fn))
    for name, matrices in sinkhorn_shapes(smoke):
        cases.append(KernelCase("sinkhorn", name, functools.partial(sinkhorn_problem, matrices), sinkhorn_fn))
    # The exact mode: the fixed-tile product against XLA's (cuBLAS on a GPU), the row-by-row attention
    # against the default paged kernel (in the XLA column).
    for name, rows, k, n in matmul_shapes(smoke):
        cases.append(KernelCase("exact_matmul", name, functools.partial(matmul_problem, rows, k, n), matmul_fn))
    for name, k, n in one_row_product_shapes(smoke):
        cases.append(KernelCase("one_row_product", f"{name} (Pallas column: the row padded to eight)",
                                functools.partial(matmul_problem, 1, k, n), one_row_product_fn))
    for s in experts_shapes(smoke):
        cases.append(KernelCase("grouped_matmul", s.name, functools.partial(experts_problem, s), experts_fn))
    for s in attention_shapes(smoke)[:1]:
        def problem(s=s):
            a, floor = attention_problem(s)
            return a[:6] + (None,), floor

        cases.append(KernelCase("exact_attention", f"{s.name} (XLA column: the default kernel)", problem,
                                lambda impl, s=s: exact_attention_fn(s, impl)))
    return cases


def bench(args, *, measured_bw: float | None = None, deadline=None, on_row=None) -> list[dict]:
    """Every ``kernel_cases`` shape, Pallas and XLA, in device time (``device_seconds``); ``deadline()``
    True stops before the next shape; ``on_row(row)`` is called after each."""
    bw = bandwidth_bytes_per_s(args.bandwidth)
    smoke = args.smoke
    timing = dict(repeats=args.repeats, n_fixed=3 if smoke else None)
    rows = []
    for case in kernel_cases(smoke):
        if deadline is not None and deadline():
            rows.append(dict(kind=case.kind, name=case.name, skipped="deadline"))
            continue
        row = dict(kind=case.kind, name=case.name)
        try:
            a, floor = case.problem()
            row["bytes"] = int(floor)
            for impl in ("pallas", "xla"):
                t, n = device_seconds(case.path(impl), a, feed_back=case.feed_back, **timing)
                row[f"{impl}_us"], row[f"{impl}_calls"] = t * 1e6, n
            del a
            row["floor_us"] = None if bw is None else floor / bw * 1e6
            row["floor_measured_us"] = None if not measured_bw else floor / measured_bw * 1e6
            row["xla_over_pallas"] = row["xla_us"] / row["pallas_us"] if row["pallas_us"] > 0 else None
            best = row["floor_measured_us"] or row["floor_us"]
            row["pallas_over_floor"] = None if best is None else row["pallas_us"] / best
        except Exception as e:  # noqa: BLE001 - a failing kernel is a result
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]
        rows.append(row)
        print(f"  {case.kind:9s} {case.name}: " + (row.get("error") or
              f"pallas {row['pallas_us']:9.1f} us, xla {row['xla_us']:9.1f} us (device time)"), flush=True)
        if on_row is not None:
            on_row(rows)
    return rows


def markdown(rows: list[dict], device: str, bw: float | None, measured_bw: float | None = None) -> str:
    lines = [f"Device: {device}; device time per call (N calls in one program); floors at "
             f"{'unknown' if bw is None else f'{bw / 1e12:.2f} TB/s (datasheet)'}"
             + ("" if not measured_bw else f" and {measured_bw / 1e12:.2f} TB/s (measured copy)"), "",
             "| kernel | shape | Pallas (us) | XLA (us) | floor (us) datasheet / measured | XLA / Pallas | "
             "Pallas / floor |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "pallas_us" not in r:
            lines.append(f"| {r['kind']} | {r['name']} | {r.get('error') or r.get('skipped', '')} | | | | |")
            continue
        f1 = "n/a" if r.get("floor_us") is None else f"{r['floor_us']:.1f}"
        f2 = "" if r.get("floor_measured_us") is None else f" / {r['floor_measured_us']:.1f}"
        over = "n/a" if r.get("pallas_over_floor") is None else f"{r['pallas_over_floor']:.2f}"
        ratio = "n/a" if r.get("xla_over_pallas") is None else f"{r['xla_over_pallas']:.2f}"
        lines.append(f"| {r['kind']} | {r['name']} | {r['pallas_us']:.1f} | {r['xla_us']:.1f} | {f1}{f2} | "
                     f"{ratio} | {over} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- --check


TOL = {"bfloat16": 3e-2, "float32": 2e-5}  # (atol = rtol) kernel vs f32 reference, by dtype


def check(args) -> list[dict]:
    """Every kernel natively (interpret mode off-GPU) against its reference. Every exception
    is caught and reported (compile errors included) and the run goes on."""
    rows = []

    def report(kind, name, fn):
        t0 = time.perf_counter()
        try:
            fn()
            row = dict(kind=kind, name=name, ok=True, error=None)
        except Exception as e:  # noqa: BLE001 - a failing kernel is a result, not the end of the run
            msg = str(e).strip().splitlines()
            row = dict(kind=kind, name=name, ok=False, error=f"{type(e).__name__}: {msg[0] if msg else ''}"[:500])
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(f"  {'PASS' if row['ok'] else 'FAIL'} {kind} {name}" + (f": {row['error']}" if row["error"] else ""),
              flush=True)

    def close(got, want, dtype):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   atol=TOL[dtype], rtol=TOL[dtype])

    attn_shapes = [AttnShape("check verify B=2 ctx=300 n=8", 2, 300, 8),
                   AttnShape("check verify B=3 ctx=1000 n=64 f32", 3, 1000, 64, dtype="float32"),
                   AttnShape("check decode B=4 ctx=777 page1", 4, 777, 1, page_size=1),
                   AttnShape("check decode B=2 ctx=3000 page64", 2, 3000, 1, page_size=64),
                   AttnShape("check verify B=2 ctx=500 n=8 gemma D=256", 2, 500, 8, q_heads=8, kv_heads=4,
                             head_dim=256),
                   AttnShape("check verify B=2 ctx=500 n=8 gemma D=512", 2, 500, 8, q_heads=8, kv_heads=1,
                             head_dim=512)]
    mla_check = [MLAShape("check mla verify B=2 ctx=300 n=8", 2, 300, 8, heads=32),
                 MLAShape("check mla decode B=3 ctx=1000", 3, 1000, 1, heads=128)]
    if args.smoke:
        attn_shapes, mla_check = verify_shapes(True), mla_shapes(True)
    for s in attn_shapes:
        def attn(s=s):
            a, _ = attention_problem(s, seed=1)
            if s.nodes == 1:
                a = a[:6] + (None,)
            ref = jax.jit(functools.partial(paged_attention_reference, page_size=s.page_size,
                                            sm_scale=s.head_dim ** -0.5))
            close(attention_fn(s, "pallas")(*a), ref(*a), s.dtype)
        report("attention", s.name, attn)
    for s in mla_check:
        def mla(s=s):
            a, _ = mla_problem(s, seed=1)
            close(mla_fn(s, "pallas")(*a), mla_fn(s, mla_attention_reference)(*a), s.dtype)
        report("mla", s.name, mla)
    for s in indexer_shapes(True) + ([] if args.smoke else [
            IndexerShape("check indexer verify B=2 ctx=3000 n=8", 2, 3000, 8),
            IndexerShape("check indexer decode B=3 ctx=1000 page1 f32", 3, 1000, 1, page_size=1, dtype="float32")]):
        def indexer(s=s):
            a, _ = indexer_problem(s, seed=1)
            got, want = np.asarray(indexer_fn(s, "pallas")(*a)), np.asarray(indexer_fn(s, index_scores_reference)(*a))
            np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
            scale = float(np.abs(want[np.isfinite(want)]).max())  # scores sum 64 heads: compare at their scale
            np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=TOL[s.dtype],
                                       atol=TOL[s.dtype] * scale)
        report("indexer", s.name, indexer)
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
        report("kv_move", s.name, move)
    for s in gather_shapes(args.smoke):
        def gather(s=s):
            a, _ = gather_problem(s, seed=3)
            for g, w in zip(gather_spec_extras(*a, implementation="pallas"), gather_spec_extras(*a, implementation="xla")):
                if w is not None:
                    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        report("gather", s.name, gather)
    for s in rope_shapes(args.smoke):
        def rope(s=s):
            a, _ = rope_problem(s, seed=4)
            got, want = rope_fn("pallas")(*a), rope_fn("xla")(*a)
            close(got[0], want[0], s.dtype)  # rotated keys: one rounding apart in bf16
            np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))  # values: copied
            close(got[2], want[2], s.dtype)
        report("rope_write", s.name, rope)
    for name, rows_, width, dtype in norm_shapes(args.smoke) + ([] if args.smoke else [
            ("check norm rows=5 H=3584 f32", 5, 3584, "float32")]):
        def norm(rows_=rows_, width=width, dtype=dtype):
            a, _ = norm_problem(rows_, width, seed=5, dtype=dtype)
            close(norm_fn("pallas")(*a), rms_norm_reference(*a, 1e-5), dtype)
            # And recording the rows into their layer's slot of an aux-tap buffer (a target layer's
            # first norm when a draft reads its hidden states): the rows stored unchanged.
            x, _, layer = a
            buffer, slots = jnp.zeros((3,) + x.shape, x.dtype), jnp.arange(32, dtype=jnp.int32) % 3
            normed, recorded = norm_fn("pallas")(*a, record=(buffer, slots))
            close(normed, rms_norm_reference(*a, 1e-5), dtype)
            np.testing.assert_array_equal(np.asarray(recorded), np.asarray(record_reference(buffer, slots, layer, x)))
        report("rms_norm", name, norm)
    for name, matrices in sinkhorn_shapes(args.smoke) + ([] if args.smoke else [("check sinkhorn 130 matrices", 130)]):
        def mixing(matrices=matrices):
            a, _ = sinkhorn_problem(matrices, seed=6)
            close(sinkhorn_fn("pallas")(*a), sinkhorn_reference(*a, iters=20, eps=1e-6), "float32")
        report("sinkhorn", name, mixing)
    for s in experts_shapes(True) + ([] if args.smoke else [ExpertsShape("check experts 96 rows of 16", 16, 6, 16, 512, 256),
                                                            ExpertsShape("check experts prefill 64-row tiles", 512, 2, 4, 256, 128)]):
        def grouped(s=s):
            a, _ = experts_problem(s, seed=7)
            got, want = (np.asarray(experts_fn(impl)(*a), np.float32) for impl in ("pallas", "xla"))
            # bf16 sums of K experts, each rounded on its own path: compared at the output's scale
            np.testing.assert_allclose(got, want, rtol=TOL["bfloat16"], atol=TOL["bfloat16"] * np.abs(want).max())
        report("grouped_matmul", s.name, grouped)
    return rows


# --------------------------------------------------------------------------- --xla-vs-reference


def lean_shapes(smoke: bool) -> tuple[list[AttnShape], list[MLAShape]]:
    """CPU-sized real shapes (one layer): Llama-3-8B attention and DeepSeek-V3 MLA."""
    if smoke:
        return verify_shapes(True), mla_shapes(True)
    return ([AttnShape("llama3-8b verify B=4 ctx=1024 n=8", 4, 1024, 8),
             AttnShape("llama3-8b decode B=16 ctx=1024", 16, 1024, 1)],
            [MLAShape("deepseek-v3 mla verify B=2 ctx=1024 n=8", 2, 1024, 8),
             MLAShape("deepseek-v3 mla decode B=8 ctx=1024", 8, 1024, 1)])


def xla_vs_reference(args) -> list[dict]:
    """The lean XLA path against the f32 HIGHEST reference, same inputs, one run."""
    rows = []
    timing = dict(warmup=args.warmup, repeats=args.repeats)
    attn, mla = lean_shapes(args.smoke)
    for s in attn:
        a, _ = attention_problem(s)
        if s.nodes == 1:
            a = a[:6] + (None,)
        kw = dict(page_size=s.page_size, sm_scale=s.head_dim ** -0.5)
        t_lean = median_seconds(jax.jit(functools.partial(paged_attention_xla, **kw)), a, **timing)
        t_ref = median_seconds(jax.jit(functools.partial(paged_attention_reference, **kw)), a, **timing)
        rows.append(dict(kind="paged_attention", name=f"{s.name} {s.dtype}", lean_us=t_lean * 1e6,
                         reference_us=t_ref * 1e6, reference_over_lean=t_ref / t_lean))
    for s in mla:
        a, _ = mla_problem(s)
        t_lean = median_seconds(mla_fn(s, mla_attention_xla), a, **timing)
        t_ref = median_seconds(mla_fn(s, mla_attention_reference), a, **timing)
        rows.append(dict(kind="mla_attention", name=f"{s.name} {s.dtype}", lean_us=t_lean * 1e6,
                         reference_us=t_ref * 1e6, reference_over_lean=t_ref / t_lean))
    for r in rows:
        print(f"  {r['kind']} {r['name']}: lean {r['lean_us']:.0f} us, reference {r['reference_us']:.0f} us "
              f"({r['reference_over_lean']:.2f}x)", flush=True)
    return rows


def lean_markdown(rows: list[dict], device: str) -> str:
    lines = [f"Device: {device}", "", "| op | shape | lean XLA (us) | f32 reference (us) | reference / lean |",
             "|---|---|---:|---:|---:|"]
    lines += [f"| {r['kind']} | {r['name']} | {r['lean_us']:.0f} | {r['reference_us']:.0f} | "
              f"{r['reference_over_lean']:.2f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="validate every kernel against its reference, then exit")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (any backend)")
    p.add_argument("--xla-vs-reference", action="store_true",
                   help="time the lean XLA path against the f32 reference (any device), then exit")
    p.add_argument("--warmup", type=int, default=3, help="--xla-vs-reference: dispatched warm-up calls")
    p.add_argument("--repeats", type=int, default=5,
                   help="runs of each timed program (device time) or dispatched calls (--xla-vs-reference)")
    p.add_argument("--bandwidth", type=float, default=None, help="HBM TB/s for the floor (default: by device)")
    p.add_argument("--json", default="kernels.json", help="where to write the results")
    args = p.parse_args(argv)
    device = device_name()
    mode = "native" if dispatch.on_gpu() else "interpret mode (no GPU: times are not kernel times)"
    print(f"device: {device}; Pallas {mode}", flush=True)
    command = " ".join(["python", "benchmarks/kernels.py"] + (argv if argv is not None else sys.argv[1:]))
    if args.check:
        failed = [r for r in check(args) if not r["ok"]]
        print("all kernels match their references" if not failed else f"{len(failed)} FAILED", flush=True)
        return 0 if not failed else 1
    bw = None
    if args.xla_vs_reference:
        rows = xla_vs_reference(args)
        table = lean_markdown(rows, device)
    else:
        rows = bench(args)
        bw = bandwidth_bytes_per_s(args.bandwidth)
        table = markdown(rows, device, bw)
    print(table)
    Path(args.json).write_text(json.dumps(dict(
        device=device, pallas_mode=mode, bandwidth_tb_s=None if bw is None else bw / 1e12,
        jax_version=jax.__version__, warmup=args.warmup, repeats=args.repeats, command=command, results=rows,
    ), indent=2))
    print(f"wrote {args.json}")
    if args.xla_vs_reference and any(r["reference_over_lean"] <= 1 for r in rows):
        print("the lean XLA path is not faster than the reference everywhere", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
