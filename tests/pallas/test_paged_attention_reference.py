"""The f32 reference against the float64 numpy oracle, and the lean XLA path (what
``implementation="xla"`` and the CPU default run) against the reference."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxspec.pallas.paged_attention import paged_attention, paged_attention_reference, paged_attention_xla
from tests.pallas.attention_cases import make_problem, oracle

DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
# Lean path vs the f32 HIGHEST reference, (atol, rtol) by pool dtype. f32: the same math at
# HIGHEST precision (summation order only). bf16: bf16 operands with f32 accumulation, the
# softmax weights rounded to bf16 before P @ V, the output rounded to bf16.
TOL_LEAN_VS_REFERENCE = {"f32": (2e-5, 2e-5), "bf16": (3e-2, 3e-2)}


def _run(fn, p, table=None, **kw):
    return np.asarray(fn(
        jnp.asarray(p.q), jnp.asarray(p.k_pool), jnp.asarray(p.v_pool), jnp.int32(p.layer),
        jnp.asarray(p.page_table if table is None else table), jnp.asarray(p.prefix_lens),
        None if p.block_mask is None else jnp.asarray(p.block_mask),
        page_size=p.page_size, sm_scale=p.sm_scale, **kw,
    )).astype(np.float64)


@pytest.mark.parametrize("kind", ["prefill", "decode", "tree", "draft"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_reference_matches_oracle(kind, page_size):
    p = make_problem(kind, page_size=page_size, W=max(2, 24 // page_size), seed=page_size)
    np.testing.assert_allclose(_run(paged_attention_reference, p), oracle(p), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("kind", ["prefill", "decode", "tree", "draft"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_lean_xla_path_matches_reference(kind, page_size, dtype):
    p = make_problem(kind, Hq=8, Hkv=2, D=32, page_size=page_size, W=max(2, 48 // page_size),
                     seed=7 * page_size + len(kind), dtype=DTYPES[dtype])
    atol, rtol = TOL_LEAN_VS_REFERENCE[dtype]
    want = _run(paged_attention_reference, p)
    np.testing.assert_allclose(_run(paged_attention_xla, p), want, atol=atol, rtol=rtol)
    np.testing.assert_array_equal(_run(paged_attention, p, implementation="xla"), _run(paged_attention_xla, p))


def test_lean_xla_path_reads_only_the_table_it_is_given():
    # The engine passes a page table sliced to the live context's bucket: the answer must not
    # change, and positions past the slice are never read (NaN there stays unseen).
    p = make_problem("tree", B=3, T=4, page_size=4, W=12, seed=5, prefix=(3, 9, 0))
    live = -(-(int(p.prefix_lens.max()) + p.q.shape[1]) // p.page_size)  # pages the rows can see
    sliced = p.page_table[:, :live]
    k, v = p.k_pool.copy(), p.v_pool.copy()
    dead = p.page_table[:, live:].reshape(-1)
    for pool in (k, v):
        for page in dead:
            pool[:, page * p.page_size:(page + 1) * p.page_size] = np.nan
    want = _run(paged_attention_xla, p)
    p.k_pool, p.v_pool = k, v
    got = _run(paged_attention_xla, p, table=sliced)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
