"""Head logits (``jaxspec.model.layers.head_logits``): a single row of a bf16 head runs as a two-row
product (XLA:GPU turns a one-row bf16 x bf16 -> f32 product into a convert of the whole head to f32
and an f32 GEMV: 1.25 ms a step at Llama-3-8B's head on an H200, against 0.26 ms for a cuBLAS
product), with the same logits; more rows, or an f32 head, run as written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.model.layers import head_logits, lm_head


def _dot_rows(fn, *args) -> list[int]:
    """Rows of the left operand of every dot_general in ``fn``'s jaxpr."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [int(np.prod(e.invars[0].aval.shape[:-1])) for e in jaxpr.eqns if e.primitive.name == "dot_general"]


@pytest.mark.parametrize("rows_of_w", [False, True])
@pytest.mark.parametrize("lead", [(1,), (1, 1), (3,), (2, 4)])
def test_head_logits_equal_the_plain_product(lead, rows_of_w):
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, lead + (64,), jnp.bfloat16)
    w = jax.random.normal(kw, (96, 64) if rows_of_w else (64, 96), jnp.bfloat16)
    spec = "...h,vh->...v" if rows_of_w else "...h,hv->...v"
    want = jnp.einsum(spec, x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    got = jax.jit(lambda x, w: head_logits(x, w, rows_of_w=rows_of_w))(x, w)
    assert got.shape == lead + (96,) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    rows = int(np.prod(lead))
    assert _dot_rows(lambda x, w: head_logits(x, w, rows_of_w=rows_of_w), x, w) == [2 if rows == 1 else rows]


def test_a_batch_one_decode_step_never_runs_a_one_row_bf16_head():
    h = jnp.ones((1, 1, 32), jnp.bfloat16)
    params = dict(lm_head=jnp.ones((32, 50), jnp.bfloat16))
    assert _dot_rows(lm_head, params, h) == [2]
    assert _dot_rows(lm_head, dict(embed=jnp.ones((50, 32), jnp.bfloat16)), h) == [2]  # a tied head
    assert _dot_rows(lm_head, dict(lm_head=jnp.ones((32, 50), jnp.float32)), h.astype(jnp.float32)) == [1]
