"""Sparse MLA attention over per-row slot lists: the jnp reference against a float64 numpy
oracle, the lean XLA path against the reference, and the Pallas kernel (interpret mode on CPU,
native on a GPU) against both on fresh random problems, also on a pool poisoned with NaN
wherever no row selected a slot. Lowered for CUDA at DeepSeek-V3.2 shapes."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxspec.pallas.block_sizes import AttentionBlocks
from jaxspec.pallas.mla_sparse_attention import (
    mla_sparse_attention, mla_sparse_attention_pallas, mla_sparse_attention_reference, mla_sparse_attention_xla,
)
from tests.pallas.triton_lowering import triton_calls

DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
TOL = {"f32": (2e-5, 2e-5), "bf16": (3e-2, 3e-2)}  # bf16: bf16 probabilities into P @ c, bf16 output
MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="native", marks=pytest.mark.gpu)]


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    dtype: str = "f32"
    B: int = 2
    T: int = 3
    Hq: int = 4
    C: int = 32
    R: int = 8
    Ks: int = 20  # selected entries per row (not a multiple of any tile)
    N: int = 64  # pool slots
    unselected: float = 0.3  # share of -1 entries
    empty_row: bool = False  # one row selects nothing
    blocks: AttentionBlocks | None = None


@dataclasses.dataclass
class Problem:
    q_latent: np.ndarray  # [B, T, Hq, C]
    q_rope: np.ndarray  # [B, T, Hq, R]
    kv_pool: np.ndarray  # [L, N, C + R]
    layer: int
    slots: np.ndarray  # i32[B, T, Ks]
    sm_scale: float


def make(case: Case, seed: int | None = None) -> Problem:
    rng = np.random.default_rng(zlib.crc32(case.id.encode()) if seed is None else seed)
    dt = DTYPES[case.dtype]
    B, T, Ks, N = case.B, case.T, case.Ks, case.N
    slots = np.stack([rng.permutation(N)[:Ks] for _ in range(B * T)]).reshape(B, T, Ks).astype(np.int32)
    slots[rng.random((B, T, Ks)) < case.unselected] = -1
    if case.empty_row:
        slots[B - 1, T - 1] = -1
    return Problem(
        q_latent=rng.standard_normal((B, T, case.Hq, case.C)).astype(dt),
        q_rope=rng.standard_normal((B, T, case.Hq, case.R)).astype(dt),
        kv_pool=rng.standard_normal((2, N, case.C + case.R)).astype(dt),
        layer=int(rng.integers(0, 2)), slots=slots, sm_scale=(case.C + case.R) ** -0.5,
    )


def oracle(p: Problem) -> np.ndarray:
    """Loops over rows and heads; float64."""
    B, T, Hq, C = p.q_latent.shape
    out = np.zeros((B, T, Hq, C))
    for b in range(B):
        for t in range(T):
            sel = [s for s in p.slots[b, t] if s >= 0]
            if not sel:
                continue
            rows = p.kv_pool[p.layer, sel].astype(np.float64)  # [k, C + R]
            for h in range(Hq):
                q = np.concatenate([p.q_latent[b, t, h], p.q_rope[b, t, h]]).astype(np.float64)
                s = rows @ q * p.sm_scale
                w = np.exp(s - s.max())
                out[b, t, h] = (w / w.sum()) @ rows[:, :C]
    return out


def run(p: Problem, fn=mla_sparse_attention_reference, **kw) -> np.ndarray:
    return np.asarray(fn(jnp.asarray(p.q_latent), jnp.asarray(p.q_rope), jnp.asarray(p.kv_pool), jnp.int32(p.layer),
                         jnp.asarray(p.slots), sm_scale=p.sm_scale, **kw)).astype(np.float64)


def poison_unselected(p: Problem) -> Problem:
    """NaN in every pool row no query row selected (the other layer entirely)."""
    kv = np.full_like(p.kv_pool, np.nan)
    keep = np.unique(p.slots[p.slots >= 0])
    kv[p.layer, keep] = p.kv_pool[p.layer, keep]
    return dataclasses.replace(p, kv_pool=kv)


SMALL = AttentionBlocks(block_m=16, block_k=16, block_w=16)
CASES = [
    Case("f32-basic"),
    Case("f32-empty-row", empty_row=True),
    Case("f32-all-selected", unselected=0.0, Ks=16),
    Case("bf16-T1-decode", "bf16", T=1, Ks=40),
    Case("f32-C24-R6-Hq2", C=24, R=6, Hq=2),
    Case("f32-Hq20-two-head-blocks", Hq=20, blocks=SMALL),
    Case("f32-splits", Ks=50, blocks=AttentionBlocks(block_m=16, block_k=16, block_w=16, kv_splits=3)),
    Case("bf16-reload-q-splits", "bf16", Ks=40, empty_row=True,
         blocks=AttentionBlocks(block_m=16, block_k=16, block_w=16, kv_splits=2, reload_q=True)),
]


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[4]], ids=lambda c: c.id)
def test_reference_matches_oracle(case):
    p = make(case)
    np.testing.assert_allclose(run(p), oracle(p), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_lean_xla_path_matches_reference(dtype):
    p = make(Case(f"xla-{dtype}", dtype, Hq=8, C=64, R=16, Ks=24, empty_row=True))
    atol, rtol = TOL[dtype]
    np.testing.assert_allclose(run(p, mla_sparse_attention_xla), run(p), atol=atol, rtol=rtol)
    np.testing.assert_array_equal(run(p, mla_sparse_attention, implementation="xla"), run(p, mla_sparse_attention_xla))


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernel_matches_reference_and_oracle(case, interpret):
    p = make(case)
    got = run(p, mla_sparse_attention_pallas, interpret=interpret, blocks=case.blocks)
    assert np.isfinite(got).all()
    atol, rtol = TOL[case.dtype]
    np.testing.assert_allclose(got, run(p), atol=atol, rtol=rtol)
    want = oracle(p)
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)
    poisoned = run(poison_unselected(p), mla_sparse_attention_pallas, interpret=interpret, blocks=case.blocks)
    np.testing.assert_allclose(poisoned, want, atol=atol, rtol=rtol)


def test_selection_changes_the_output():
    """Dropping one selected slot of one row changes that row only (the kernel reads the list)."""
    p = make(Case("drop-one", unselected=0.0, Ks=16))
    base = run(p, mla_sparse_attention_pallas, interpret=True)
    slots = p.slots.copy()
    slots[0, 1, 5] = -1
    got = run(dataclasses.replace(p, slots=slots), mla_sparse_attention_pallas, interpret=True)
    changed = np.abs(got - base).max(axis=(2, 3)) > 1e-6  # [B, T]
    assert changed[0, 1] and changed.sum() == 1


def test_bad_inputs_are_value_errors():
    p = make(CASES[0])
    with pytest.raises(ValueError, match="slots must be"):
        mla_sparse_attention(jnp.asarray(p.q_latent), jnp.asarray(p.q_rope), jnp.asarray(p.kv_pool), 0,
                             jnp.asarray(p.slots[:, :1]), sm_scale=1.0)
    with pytest.raises(ValueError, match="kv_pool must be"):
        mla_sparse_attention(jnp.asarray(p.q_latent), jnp.asarray(p.q_rope), jnp.asarray(p.kv_pool[..., 1:]), 0,
                             jnp.asarray(p.slots), sm_scale=1.0)


@pytest.mark.parametrize("T,splits", [(1, 4), (8, 1)])
def test_lowers_to_one_triton_kernel(T, splits):
    """DeepSeek-V3.2 shapes (C = 512, R = 64, 16 heads per device, 2048 selected) get through
    the Triton lowering."""
    blocks = None if splits == 1 else AttentionBlocks(block_m=16, block_k=16, block_w=16, kv_splits=splits,
                                                      reload_q=True)

    def fn(ql, qr, kv, layer, slots):
        return mla_sparse_attention_pallas(ql, qr, kv, layer, slots, sm_scale=0.1, interpret=False, blocks=blocks)

    B = 2
    args = (jax.ShapeDtypeStruct((B, T, 16, 512), jnp.bfloat16), jax.ShapeDtypeStruct((B, T, 16, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, 4096, 576), jnp.bfloat16), jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((B, T, 2048), jnp.int32))
    assert triton_calls(fn, *args) == 1
