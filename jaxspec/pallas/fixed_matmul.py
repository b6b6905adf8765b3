"""A product whose reduction order does not depend on how many rows are computed together
(the exact mode's products, docs/architecture.md#the-exact-mode).

``x [..., K] @ w [K, N]`` with float32 accumulation. Every output tile ``[bm, bn]`` is computed by
one program that walks K in ``bk``-wide steps from 0 to K, in order, each step one ``[bm, bk] x
[bk, bn]`` dot. The rows are padded into tiles of ``bm`` (padding rows are zeros, their results
dropped), so a row alone in a decode step, one of n rows of a verify, or one row of a prefill is
computed by a program of the same shapes, with the same steps, in the same order: its result is
bit-identical whatever else is computed beside it. K is padded with zeros to a multiple of ``bk``
(zero products add nothing, and the padding is the same for every caller of the same weight); there
is no split of K, whose count would depend on the number of rows.

Pallas kernel (Triton), written with BlockSpecs: grid ``(M / bm, N / bn)``; the program of tile
``(i, j)`` reads rows ``[i * bm, (i + 1) * bm)`` of ``x`` and columns ``[j * bn, (j + 1) * bn)`` of
``w`` whole along K. On a CPU it runs in interpret mode, where every program's dot has the same
shapes too, so the CPU gives the same guarantee (with its own rounding).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas import dispatch


@dataclasses.dataclass(frozen=True)
class MatmulTiles:
    """The exact mode's tile, pinned per model (not chosen per shape: a tile that changed with the
    number of rows would change the reduction order). bm: rows per tile (>= 16 for the tensor cores);
    bn: output columns per tile; bk: the K step."""

    bm: int = 16
    bn: int = 64
    bk: int = 128
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_TILES = MatmulTiles()


def fixed_matmul_reference(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:  # [..., K] @ [K, N]
    """The product in float32, cast to ``out_dtype`` (default ``x``'s dtype): the kernel's result up to
    its summation order."""
    out = jnp.dot(x, w, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype if out_dtype is None else out_dtype)


def _matmul_kernel(x_ref, w_ref, o_ref, *, bk: int, steps: int):
    # x_ref [bm, Kp], w_ref [Kp, bn], o_ref [bm, bn]
    bm, bn = o_ref.shape

    def step(i, acc):
        x = x_ref[:, pl.ds(i * bk, bk)]  # [bm, bk]
        w = w_ref[pl.ds(i * bk, bk), :]  # [bk, bn]
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@functools.partial(jax.jit, static_argnames=("tiles", "interpret", "out_dtype"))
def fixed_matmul_pallas(x: jax.Array, w: jax.Array, *, tiles: MatmulTiles = DEFAULT_TILES, interpret: bool = False,
                        out_dtype=None) -> jax.Array:  # [..., K] @ [K, N] -> [..., N]
    """The Pallas path of :func:`fixed_matmul`."""
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    lead, K = x.shape[:-1], x.shape[-1]
    N = w.shape[1]
    x2 = x.reshape(-1, K)  # [M, K]
    M = x2.shape[0]
    Mp, Np, Kp = _round_up(max(M, 1), tiles.bm), _round_up(N, tiles.bn), _round_up(K, tiles.bk)
    x2 = jnp.pad(x2, ((0, Mp - M), (0, Kp - K)))
    wp = jnp.pad(w.astype(x.dtype), ((0, Kp - K), (0, Np - N)))
    out = pl.pallas_call(
        functools.partial(_matmul_kernel, bk=tiles.bk, steps=Kp // tiles.bk),
        grid=(Mp // tiles.bm, Np // tiles.bn),
        in_specs=[pl.BlockSpec((tiles.bm, Kp), lambda i, j: (i, 0)), pl.BlockSpec((Kp, tiles.bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((tiles.bm, tiles.bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((Mp, Np), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="fixed_matmul",
    )(x2, wp)
    return out[:M, :N].reshape(*lead, N)


def fixed_matmul(x: jax.Array, w: jax.Array, *, tiles: MatmulTiles = DEFAULT_TILES, out_dtype=None) -> jax.Array:
    """``x @ w`` with a reduction order fixed per row: natively on a GPU, in interpret mode elsewhere
    (the guarantee is the kernel's, so there is no XLA path to fall back to). ``out_dtype``: the
    result's dtype (default ``x``'s; the float32 accumulator is rounded to it once)."""
    return fixed_matmul_pallas(x, w, tiles=tiles, interpret=dispatch.interpret_mode(), out_dtype=out_dtype)
