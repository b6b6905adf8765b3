"""DeepSeek-V4's hyper-connection mixing matrices, Sinkhorn-normalized in one launch.

Glossary: M matrices (one per token), N hyper-connection streams (``hc_mult``, 4 in V4), I Sinkhorn
iterations (``hc_sinkhorn_iters``, 20).

What it replaces. Each V4 layer mixes its N residual streams twice (before attention and before the
MoE) with an N x N matrix per token: a softmax of the logits over each row, then alternate column and
row normalizations, I of each. On XLA every normalization is a reduction over an axis of N and a
division, each its own kernel: about 4 I kernels of a few hundred bytes a matrix set, 80 a layer's
mixing, 1,600 of the 2,700 kernels of a batch-1 decode step of a 10-layer V4-Flash shape
compiled for an H100 (``benchmarks/gpu_launches.py --target v4``). This op is one launch.

Arithmetic (HF ``DeepseekV4HyperConnection``, in f32): ``c = softmax(logits, rows) + eps``, then
``c /= col_sum(c) + eps``, then I - 1 times ``c /= row_sum(c) + eps; c /= col_sum(c) + eps``. The
kernel sums the N entries of a row or column left to right; XLA's order is its own, so the two paths
agree to f32 rounding, not bit for bit. A matrix's result does not depend on the other matrices of
the call.

Pallas kernel (Triton): grid ``(cdiv(M, bm),)``; the program of a block of ``bm`` matrices loads
each of the N * N entries as a vector over its matrices (masked past M), runs the iterations (a
loop) on those N * N vectors in registers, and stores them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from jaxspec.mesh import per_model_shard
from jaxspec.pallas import dispatch
from jaxspec.pallas.block_sizes import next_pow2
from jaxspec.pallas.triton_common import whole

MATRICES_PER_PROGRAM = 128  # bm at most: a decode step has B matrices, a verify B * n


def sinkhorn_reference(
    logits: jax.Array,  # f32[M, N, N]
    *,
    iters: int,
    eps: float,
) -> jax.Array:  # f32[M, N, N]
    """Pure-jnp oracle (and the XLA path): HF's softmax, then I column and I - 1 row normalizations."""
    c = jax.nn.softmax(logits.astype(jnp.float32), axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def step(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, step, c)


def _left_sum(xs: list[jax.Array]) -> jax.Array:
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


def _normalize_rows(c: list[list[jax.Array]], eps: float) -> list[list[jax.Array]]:
    out = []
    for row in c:
        total = _left_sum(row) + eps
        out.append([x / total for x in row])
    return out


def _normalize_columns(c: list[list[jax.Array]], eps: float) -> list[list[jax.Array]]:
    return [list(col) for col in zip(*_normalize_rows([list(col) for col in zip(*c)], eps))]


def _sinkhorn_kernel(x_ref, o_ref, *, matrices: int, n: int, block: int, iters: int, eps: float):
    m = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)  # [bm] matrices of this program
    ok = m < matrices
    base = m * (n * n)
    # c[i][j]: entry (i, j) of every matrix of the block, f32[bm]
    c = [[plgpu.load(x_ref.at[base + i * n + j], mask=ok, other=0.0).astype(jnp.float32) for j in range(n)]
         for i in range(n)]
    for i in range(n):  # softmax over the row, + eps
        top = c[i][0]
        for x in c[i][1:]:
            top = jnp.maximum(top, x)
        e = [jnp.exp(x - top) for x in c[i]]
        total = _left_sum(e)
        c[i] = [x / total + eps for x in e]
    c = _normalize_columns(c, eps)

    def step(_, flat):  # the matrices' entries as a flat tuple: a loop carry
        c = _normalize_columns(_normalize_rows([list(flat[i * n:(i + 1) * n]) for i in range(n)], eps), eps)
        return tuple(x for row in c for x in row)

    flat = jax.lax.fori_loop(0, iters - 1, step, tuple(x for row in c for x in row))
    c = [list(flat[i * n:(i + 1) * n]) for i in range(n)]
    for i in range(n):
        for j in range(n):
            plgpu.store(o_ref.at[base + i * n + j], c[i][j], mask=ok)


@functools.partial(jax.jit, static_argnames=("iters", "eps", "interpret"))
def _sinkhorn_call(logits, *, iters: int, eps: float, interpret: bool):
    M, N, _ = logits.shape
    block = min(MATRICES_PER_PROGRAM, next_pow2(M))
    x = logits.astype(jnp.float32).reshape(M * N * N)
    out_shape = jax.ShapeDtypeStruct((M * N * N,), jnp.float32)
    out = pl.pallas_call(
        functools.partial(_sinkhorn_kernel, matrices=M, n=N, block=block, iters=iters, eps=eps),
        grid=(pl.cdiv(M, block),),
        in_specs=[whole(x)],
        out_specs=whole(out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=1 if block <= 32 else 4, num_stages=1),
        interpret=interpret,
        name="sinkhorn",
    )(x)
    return out.reshape(M, N, N)


def sinkhorn_pallas(
    logits: jax.Array,  # f32[M, N, N]
    *,
    iters: int,
    eps: float,
    interpret: bool,
) -> jax.Array:  # f32[M, N, N]
    """Pallas path: ``sinkhorn_reference`` in one launch (module docstring)."""
    if logits.ndim != 3 or logits.shape[1] != logits.shape[2]:
        raise ValueError(f"logits {logits.shape} must be [M, N, N]")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    return _sinkhorn_call(logits, iters=int(iters), eps=float(eps), interpret=interpret)


def sinkhorn(
    logits: jax.Array,  # f32[..., N, N]
    *,
    iters: int,
    eps: float,
    implementation=None,
    tensor_parallel: int = 1,
) -> jax.Array:  # f32[..., N, N]
    """The mixing matrices of ``logits`` (module docstring): the kernel on a GPU (one launch), XLA's
    path elsewhere or where ``implementation`` says so. Every matrix is normalized on its own, so
    with ``tensor_parallel`` shards each shard normalizes its whole replicated copy."""
    if dispatch.choose("sinkhorn", implementation, shape_class="sinkhorn") == "xla":
        return sinkhorn_reference(logits, iters=iters, eps=eps)

    def local(logits):
        lead, N = logits.shape[:-2], logits.shape[-1]
        flat = logits.reshape((-1, N, N))
        return sinkhorn_pallas(flat, iters=iters, eps=eps, interpret=dispatch.interpret_mode()).reshape(lead + (N, N))

    return per_model_shard(local, in_specs=(P(),), out_specs=P(), shards=tensor_parallel)(logits)
