"""RoPE-and-write kernel (interpret mode on CPU) against its float32 reference and against the
model's XLA path (``apply_rope`` then ``KVPool.write``), on fresh random joined q/k/v heads.

The pool is updated in place, so every slot the call does not write must stay bit-identical,
and a row whose slot is the scratch page writes nothing. Values are copied, so they are
compared exactly; rotated queries and keys within float rounding of the reference (f32) or one
rounding of the XLA path's bf16 arithmetic."""

from __future__ import annotations

import dataclasses
import zlib

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.kvcache.paging import SCRATCH_PAGE, scratch_dropped, scratch_end
from jaxspec.kvcache.pool import KVPool
from jaxspec.model.config import RopeConfig
from jaxspec.model.layers import Rope, rotate_and_write
from jaxspec.pallas.rope_write import rope_write_pallas, rope_write_reference, rope_write_unsupported
from tests.pallas.triton_lowering import triton_calls

MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="native", marks=pytest.mark.gpu)]
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class RopeCase:
    id: str
    rows: int  # R = B * T
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "f32"
    layers: int = 3
    scale: float = 1.0

    def tolerance(self) -> float:
        return 1e-6 if self.dtype == "f32" else 1e-2


CASES = [
    RopeCase("decode-gqa-d128-page16-bf16", 1, 32, 8, 128, 16, "bf16"),
    RopeCase("verify-gqa-d64-page1-f32", 8, 8, 2, 64, 1),
    RopeCase("prefill-mha-d20-page5-f32", 24, 3, 3, 20, 5),  # half = 10: padded, masked columns
    RopeCase("ragged-heads6-2-d32-page16-bf16", 10, 6, 2, 32, 16, "bf16", scale=1.25),  # non-pow2 heads, YaRN factor
]


def _inputs(case: RopeCase):
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    dt = DTYPES[case.dtype]
    R, D, P = case.rows, case.head_dim, case.page_size
    pages = R + 3
    N = pages * P
    rand = lambda *shape: jnp.asarray(rng.standard_normal(shape), dt)  # noqa: E731
    # Distinct slots outside the scratch page, and every third row from the second aimed at scratch
    # (a padding row).
    slots = rng.choice(np.arange((SCRATCH_PAGE + 1) * P, N), size=R, replace=False).astype(np.int32)
    slots[1::3] = SCRATCH_PAGE * P + rng.integers(0, P, size=len(slots[1::3]))
    positions = rng.integers(0, 70_000, size=R).astype(np.int32)
    inv_freq = RopeConfig(theta=500_000.0).inv_freq(D)
    return dict(qkv=rand(R, case.q_heads + 2 * case.kv_heads, D),
                k_pool=rand(case.layers, N, case.kv_heads, D), v_pool=rand(case.layers, N, case.kv_heads, D),
                layer=jnp.int32(case.layers - 2), slots=jnp.asarray(slots), positions=jnp.asarray(positions),
                inv_freq=inv_freq)


def _close(got, want, tol):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("skip", ["past N", "scratch bound"])
@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rope_write_matches_reference(case, interpret, skip):
    """Scratch rows skipped either way: slots mapped past N beforehand (``scratch_dropped``), or the
    raw slots with the scratch page's bound given to the kernel (what the model passes)."""
    x = _inputs(case)
    N = x["k_pool"].shape[1]
    where = scratch_dropped(x["slots"], case.page_size, N)
    bound = scratch_end(case.page_size) if skip == "scratch bound" else 0
    args = (x["qkv"], x["k_pool"], x["v_pool"], x["layer"], x["slots"] if bound else where, x["positions"],
            x["inv_freq"])
    q, k_pool, v_pool = rope_write_pallas(*args, q_heads=case.q_heads, scale=case.scale, scratch_slots=bound,
                                          interpret=interpret)
    q_ref, k_ref, v_ref = rope_write_reference(*args, q_heads=case.q_heads, scale=case.scale, scratch_slots=bound)
    _close(q, q_ref, case.tolerance())
    _close(k_pool, k_ref, case.tolerance())
    np.testing.assert_array_equal(np.asarray(v_pool), np.asarray(v_ref))  # values are copied
    # In place: every slot the call does not write is untouched, in every layer.
    written = np.zeros((case.layers, N), bool)
    live = np.asarray(where) < N
    assert live.any() and (case.rows == 1 or not live.all()), "the case must write rows and skip scratch rows"
    written[int(x["layer"]), np.asarray(where)[live]] = True
    for got, before in ((k_pool, x["k_pool"]), (v_pool, x["v_pool"])):
        np.testing.assert_array_equal(np.asarray(got)[~written], np.asarray(before)[~written])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fused_path_matches_the_xla_path(case):
    """``rotate_and_write`` with the kernel against the model's own XLA path, through the pool."""
    x = _inputs(case)
    pool = KVPool(k=x["k_pool"], v=x["v_pool"], page_size=case.page_size)
    R = case.rows
    shape = lambda a: a.reshape((2, R // 2) + a.shape[1:]) if R % 2 == 0 else a[None]  # noqa: E731  [B, T, ...]
    rope = Rope(shape(x["positions"]), x["inv_freq"], case.scale)
    outs = {impl: rotate_and_write(shape(x["qkv"]), pool, x["layer"], x["slots"], rope, q_heads=case.q_heads,
                                   implementation=impl)
            for impl in ("pallas", "xla")}
    (q_p, pool_p), (q_x, pool_x) = outs["pallas"], outs["xla"]
    # The XLA path rounds each bf16 product; the kernel rounds once: one bf16 step apart at most.
    tol = case.tolerance() if case.dtype == "f32" else 3e-2
    _close(q_p, q_x, tol)
    _close(pool_p.k, pool_x.k, tol)
    np.testing.assert_array_equal(np.asarray(pool_p.v), np.asarray(pool_x.v))


def test_rope_write_is_one_kernel_per_call():
    case = CASES[0]
    x = _inputs(case)
    where = scratch_dropped(x["slots"], case.page_size, x["k_pool"].shape[1])
    fn = lambda *a: rope_write_pallas(*a, x["inv_freq"], q_heads=case.q_heads, interpret=False)  # noqa: E731
    assert triton_calls(fn, x["qkv"], x["k_pool"], x["v_pool"], x["layer"], where, x["positions"]) == 1


def test_kernel_refuses_what_it_cannot_take():
    assert rope_write_unsupported((2, 64, 4, 31)) is not None  # odd head width
    assert rope_write_unsupported((2**10, 2**18, 8, 128)) is not None  # int32 row index
    assert rope_write_unsupported((32, 2064, 8, 128)) is None
    pool = jnp.zeros((2, 8, 2, 31))
    with pytest.raises(NotImplementedError, match="even head width"):
        rope_write_pallas(jnp.zeros((1, 8, 31)), pool, pool, 0, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                          np.ones(15, np.float32), q_heads=4, interpret=True)
    pool = jnp.zeros((2, 8, 2, 32))
    with pytest.raises(ValueError, match="query heads does not fit"):
        rope_write_pallas(jnp.zeros((1, 7, 32)), pool, pool, 0, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                          np.ones(16, np.float32), q_heads=4, interpret=True)


def test_engine_config_names_the_op():
    js.EngineConfig(implementation={"rope_write": "xla"})
    with pytest.raises(ValueError, match="unknown op"):
        js.EngineConfig(implementation={"rope_writ": "xla"})
