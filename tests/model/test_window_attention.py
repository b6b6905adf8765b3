"""The sliding-window layers' attention (``layers.attention_over``) against an f32 HIGHEST oracle, and
what its products run in: K/V in their own dtype with f32 accumulation, not f32 at HIGHEST (which a
GPU runs without tensor cores)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.model.layers import attention_over


def oracle(q, k, v, visible, sm_scale):  # f32 HIGHEST throughout
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    hi = jax.lax.Precision.HIGHEST
    qf = q.astype(jnp.float32).reshape(B, T, Hkv, Hq // Hkv, D)
    s = jnp.einsum("bthgd,bkhd->bhgtk", qf, k.astype(jnp.float32), precision=hi) * sm_scale
    p = jax.nn.softmax(jnp.where(visible[:, None, None], s, -1e30), axis=-1)
    return jnp.einsum("bhgtk,bkhd->bthgd", p, v.astype(jnp.float32), precision=hi).reshape(B, T, Hq, D)


def _inputs(dtype, B=2, T=5, K=12, Hq=4, Hkv=2, D=16):
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((B, T, Hq, D), (B, K, Hkv, D), (B, K, Hkv, D)))
    visible = jnp.asarray(rng.random((B, T, K)) < 0.6).at[:, :, 0].set(True)  # every row sees something
    return q, k, v, visible


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 3e-2)], ids=["f32", "bf16"])
def test_attention_over_matches_the_f32_oracle(dtype, tol):
    q, k, v, visible = _inputs(dtype)
    got = attention_over(q, k, v, visible, 0.25)
    assert got.dtype == dtype and got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(oracle(q, k, v, visible, 0.25)), rtol=tol,
                               atol=tol)


def test_bf16_products_take_bf16_operands_and_accumulate_in_f32():
    q, k, v, visible = _inputs(jnp.bfloat16)
    with jax.default_matmul_precision("default"):  # what the code asks for (the suite sets "highest")
        jaxpr = jax.make_jaxpr(lambda *a: attention_over(*a, 0.25))(q, k, v, visible)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2
    for e in dots:
        assert [x.aval.dtype for x in e.invars] == [jnp.bfloat16, jnp.bfloat16], e
        assert e.params["preferred_element_type"] == jnp.float32
        assert e.params["precision"] in (None, (jax.lax.Precision.DEFAULT, jax.lax.Precision.DEFAULT)), e
