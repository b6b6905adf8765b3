"""Grouped-matmul kernel (interpret mode on CPU) against its reference on fresh random inputs: the
tiled layout's invariants, the plain and gated products (SwiGLU with DeepSeek-V4's clamp, Gemma 4's
GELU-tanh), empty groups, rows in no group (another shard's experts), 16- and 64-row tiles, bf16;
the ragged_dot-shaped wrapper against ``jax.lax.ragged_dot``; and the dispatch's refusals."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.model.layers import gelu_tanh
from jaxspec.pallas.grouped_matmul import (group_tiles, grouped_gated_reference, grouped_matmul,
                                           grouped_matmul_reference, grouped_matmul_tiled_pallas, tiles_needed)

MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="native", marks=pytest.mark.gpu)]


@dataclasses.dataclass(frozen=True)
class GroupedCase:
    id: str
    sizes: tuple[int, ...]  # rows per group (E groups)
    rows: int  # M >= sum(sizes): the rest belong to no group
    k: int = 32
    n: int = 48
    block_m: int = 16
    dtype: str = "float32"
    gated: bool = False
    limit: float | None = None
    gelu: bool = False
    layers: int = 0  # > 0: the weights stacked per layer, the second to last one used (read in place)


CASES = [
    GroupedCase("verify-like-ragged", (3, 0, 17, 20, 1, 0, 5, 2), 48),
    GroupedCase("rows-in-no-group", (4, 9, 0, 6), 32),  # 13 rows of another shard's experts
    GroupedCase("one-group-holds-all", (0, 0, 40, 0), 40),
    GroupedCase("last-group-only", (0, 0, 0, 7), 7),
    GroupedCase("one-row-per-group", (1,) * 40, 40),  # the layout's worst case: every tile one row
    GroupedCase("64-row-tiles-bf16", (70, 0, 130, 56), 256, k=64, n=128, block_m=64, dtype="bfloat16"),
    GroupedCase("gated-swiglu-clamped", (5, 11, 0, 16), 40, gated=True, limit=0.7),
    GroupedCase("gated-gelu-bf16", (9, 3, 20, 0, 1), 33, k=48, n=32, dtype="bfloat16", gated=True, gelu=True),
    GroupedCase("stacked-layer-gated", (6, 0, 13, 3), 24, gated=True, layers=3),
    GroupedCase("stacked-layer", (2, 30, 0), 40, layers=4),
]


def _inputs(case: GroupedCase):
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    E, dt = len(case.sizes), jnp.dtype(case.dtype)
    x = jnp.asarray(rng.standard_normal((case.rows, case.k)), dt)
    lead = (case.layers,) if case.layers else ()
    ws = [jnp.asarray(rng.standard_normal(lead + (E, case.k, case.n)) / np.sqrt(case.k), dt) for _ in range(2)]
    return x, ws, jnp.asarray(case.sizes, jnp.int32)


def _layer_of(case: GroupedCase) -> int | None:
    return case.layers - 2 if case.layers else None


def _tiled(x, sizes, block_m):
    tiles = group_tiles(sizes, x.shape[0], block_m)
    return tiles, jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[tiles.source]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_group_tiles_layout(case):
    sizes = np.asarray(case.sizes)
    tiles = group_tiles(jnp.asarray(sizes, jnp.int32), case.rows, case.block_m)
    source, dest, tile_group = (np.asarray(a) for a in tiles)
    bm, M, E = case.block_m, case.rows, len(sizes)
    assert tile_group.shape == (tiles_needed(M, E, bm),) and source.shape == (tile_group.size * bm,)
    group_of_row = np.repeat(np.arange(E), sizes)  # rows past sum(sizes) are in no group
    held = source < M
    # every row of a group sits once, in a tile of its own group; padding rows hold M
    assert sorted(source[held].tolist()) == list(range(sizes.sum()))
    assert (group_of_row[source[held]] == np.repeat(tile_group, bm)[held]).all()
    # dest is source's inverse; rows in no group go past the layout
    np.testing.assert_array_equal(source[dest[: sizes.sum()]], np.arange(sizes.sum()))
    assert (dest[sizes.sum():] == source.size).all()
    # the used tiles are exactly each group's whole tiles, in group order; the rest are unused (E)
    used = np.repeat(np.arange(E), -(-sizes // bm))
    np.testing.assert_array_equal(tile_group[: used.size], used)
    assert (tile_group[used.size:] == E).all()


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_grouped_matmul_matches_reference(case, interpret):
    x, (w, w_up), sizes = _inputs(case)
    activation = gelu_tanh if case.gelu else jax.nn.silu
    tiles, xt = _tiled(x, sizes, case.block_m)
    layer = _layer_of(case)
    yt = grouped_matmul_tiled_pallas(xt, tiles.tile_group, w, w_up=w_up if case.gated else None, layer=layer,
                                     activation=activation, limit=case.limit, interpret=interpret)
    if layer is not None:  # the reference reads the layer's slice
        w, w_up = w[layer], w_up[layer]
    got = np.asarray(jnp.concatenate([yt, jnp.zeros((1, yt.shape[1]), yt.dtype)])[tiles.dest], np.float32)
    if case.gated:
        want = grouped_gated_reference(x, w, w_up, sizes, activation=activation, limit=case.limit)
    else:
        want = grouped_matmul_reference(x, w, sizes)
    want = np.asarray(want, np.float32)
    tol = 2e-2 if case.dtype == "bfloat16" else 2e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert (got[sizes.sum():] == 0).all()  # rows in no group are zeros, as ragged_dot leaves them
    # unused tiles are written (zeros), never left as whatever the buffer held
    assert (np.asarray(yt, np.float32)[np.repeat(np.asarray(tiles.tile_group), case.block_m) == len(case.sizes)] == 0).all()
    # each group's weight matters: the reference with two groups' weights swapped is another result
    nonempty = np.flatnonzero(np.asarray(case.sizes))
    if nonempty.size > 1:
        a, b = nonempty[:2]
        swapped = w.at[a].set(w[b]).at[b].set(w[a])
        other = grouped_matmul_reference(x, swapped, sizes)
        if case.gated:
            other = grouped_gated_reference(x, swapped, w_up, sizes, activation=activation, limit=case.limit)
        assert np.abs(np.asarray(other, np.float32) - want).max() > 10 * tol


@pytest.mark.parametrize("case", [c for c in CASES if not c.gated and c.block_m == 16 and not c.layers],
                         ids=lambda c: c.id)
def test_wrapper_equals_ragged_dot(case):
    x, (w, _), sizes = _inputs(case)
    got = grouped_matmul(x, w, sizes, implementation="pallas")
    with jax.default_matmul_precision("highest"):
        want = grouped_matmul(x, w, sizes, implementation="xla")  # jax.lax.ragged_dot
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_widths_without_a_tile_are_refused_or_left_to_xla():
    x = jnp.ones((8, 24), jnp.float32)  # K = 24: no power-of-two divisor >= 16
    w = jnp.ones((2, 24, 32), jnp.float32)
    sizes = jnp.asarray([3, 5], jnp.int32)
    with pytest.raises(NotImplementedError, match=r"\[24, 32\]"):
        grouped_matmul(x, w, sizes, implementation="pallas")
    np.testing.assert_allclose(np.asarray(grouped_matmul(x, w, sizes)), 24.0)  # None on a CPU: ragged_dot
    tiles, xt = _tiled(x, sizes, 16)
    with pytest.raises(NotImplementedError):
        grouped_matmul_tiled_pallas(xt, tiles.tile_group, w, interpret=True)
