"""Paged MLA attention (absorbed form): the jnp reference against an independent numpy oracle,
and against HF's non-absorbed math (expanded per-head keys and values); the lean XLA path
against the reference."""

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxspec.pallas.mla_attention import mla_attention, mla_attention_reference, mla_attention_xla
from tests.pallas.attention_cases import make_problem

DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
# Lean path vs the f32 HIGHEST reference, (atol, rtol) by pool dtype (see the MHA twin in
# test_paged_attention_reference.py).
TOL_LEAN_VS_REFERENCE = {"f32": (2e-5, 2e-5), "bf16": (3e-2, 3e-2)}


@dataclasses.dataclass
class MLAProblem:
    q_latent: np.ndarray  # [B, T, Hq, C]
    q_rope: np.ndarray  # [B, T, Hq, R]
    kv_pool: np.ndarray  # [L, N, C + R]
    layer: int
    page_table: np.ndarray  # [B, W]
    prefix_lens: np.ndarray  # [B]
    block_mask: np.ndarray | None  # [B, T, Wb]
    page_size: int
    sm_scale: float


def make_mla_problem(kind: str, *, page_size: int, Hq=4, C=16, R=8, seed=0, dtype=np.float32) -> MLAProblem:
    """Page tables, prefixes and masks from the MHA cases; fresh random MLA tensors."""
    base = make_problem(kind, page_size=page_size, W=max(2, 24 // page_size), seed=seed)
    B, T = base.q.shape[:2]
    L, N = base.k_pool.shape[:2]
    rng = np.random.default_rng(seed + 100)
    return MLAProblem(
        q_latent=rng.standard_normal((B, T, Hq, C)).astype(dtype),
        q_rope=rng.standard_normal((B, T, Hq, R)).astype(dtype),
        kv_pool=rng.standard_normal((L, N, C + R)).astype(dtype),
        layer=base.layer, page_table=base.page_table, prefix_lens=base.prefix_lens,
        block_mask=base.block_mask, page_size=page_size, sm_scale=(C + R) ** -0.5,
    )


def oracle(p: MLAProblem) -> np.ndarray:
    """Loops over rows and heads; float64."""
    B, T, Hq, C = p.q_latent.shape
    P = p.page_size
    out = np.zeros((B, T, Hq, C))
    for b in range(B):
        prefix = int(p.prefix_lens[b])
        wb = T if p.block_mask is None else p.block_mask.shape[2]
        for t in range(T):
            visible = list(range(prefix))
            for w in range(wb):
                if (w <= t) if p.block_mask is None else bool(p.block_mask[b, t, w]):
                    visible.append(prefix + w)
            slots = [p.page_table[b, pos // P] * P + pos % P for pos in visible]
            rows = p.kv_pool[p.layer, slots].astype(np.float64)  # [K, C + R]
            for h in range(Hq):
                q = np.concatenate([p.q_latent[b, t, h], p.q_rope[b, t, h]]).astype(np.float64)
                s = rows @ q * p.sm_scale
                w_ = np.exp(s - s.max())
                out[b, t, h] = (w_ / w_.sum()) @ rows[:, :C]
    return out


def run(p: MLAProblem, fn=mla_attention_reference, **kw):
    return np.asarray(fn(
        jnp.asarray(p.q_latent), jnp.asarray(p.q_rope), jnp.asarray(p.kv_pool), jnp.int32(p.layer),
        jnp.asarray(p.page_table), jnp.asarray(p.prefix_lens),
        None if p.block_mask is None else jnp.asarray(p.block_mask),
        page_size=p.page_size, sm_scale=p.sm_scale, **kw,
    ))


@pytest.mark.parametrize("kind", ["prefill", "decode", "tree", "draft"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_reference_matches_oracle(kind, page_size):
    p = make_mla_problem(kind, page_size=page_size, seed=page_size)
    np.testing.assert_allclose(run(p), oracle(p), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("kind", ["prefill", "decode", "tree", "draft"])
def test_lean_xla_path_matches_reference(kind, dtype):
    p = make_mla_problem(kind, page_size=4, Hq=8, C=64, R=16, seed=7 + len(kind), dtype=DTYPES[dtype])
    atol, rtol = TOL_LEAN_VS_REFERENCE[dtype]
    got = run(p, mla_attention_xla).astype(np.float64)
    np.testing.assert_allclose(got, run(p).astype(np.float64), atol=atol, rtol=rtol)
    np.testing.assert_array_equal(run(p, mla_attention, implementation="xla"), run(p, mla_attention_xla))


def test_absorbed_equals_expanded_heads():
    """q_latent = W_uk^T q_nope and o = W_uv o_latent give HF's per-head attention with
    k = [W_uk c | k_rope] and v = W_uv c."""
    p = make_mla_problem("prefill", page_size=4, seed=3)
    B, T, Hq, C = p.q_latent.shape
    Dn, Dv = 6, 5
    rng = np.random.default_rng(9)
    w_uk = rng.standard_normal((Hq, Dn, C)).astype(np.float32)
    w_uv = rng.standard_normal((Hq, C, Dv)).astype(np.float32)
    q_nope = rng.standard_normal((B, T, Hq, Dn)).astype(np.float32)
    absorbed = dataclasses.replace(p, q_latent=np.einsum("bthd,hdc->bthc", q_nope, w_uk))
    got = np.einsum("bthc,hcv->bthv", run(absorbed), w_uv)
    # Expanded: per-head keys and values, explicit softmax over the visible positions.
    P = p.page_size
    want = np.zeros((B, T, Hq, Dv))
    for b in range(B):
        for t in range(T):
            n = int(p.prefix_lens[b]) + t + 1
            slots = [p.page_table[b, pos // P] * P + pos % P for pos in range(n)]
            rows = p.kv_pool[p.layer, slots].astype(np.float64)
            c, k_rope = rows[:, :C], rows[:, C:]
            for h in range(Hq):
                k = np.concatenate([c @ w_uk[h].T, k_rope], axis=1)  # [n, Dn + R]
                q = np.concatenate([q_nope[b, t, h], p.q_rope[b, t, h]])
                s = k @ q * p.sm_scale
                w_ = np.exp(s - s.max())
                want[b, t, h] = (w_ / w_.sum()) @ (c @ w_uv[h])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
