import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas.paged_attention import paged_attention_reference
from tests.pallas.attention_cases import make_problem, oracle


@pytest.mark.parametrize("kind", ["prefill", "decode", "tree", "draft"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_reference_matches_oracle(kind, page_size):
    p = make_problem(kind, page_size=page_size, W=max(2, 24 // page_size), seed=page_size)
    got = paged_attention_reference(
        jnp.asarray(p.q), jnp.asarray(p.k_pool), jnp.asarray(p.v_pool), jnp.int32(p.layer),
        jnp.asarray(p.page_table), jnp.asarray(p.prefix_lens),
        None if p.block_mask is None else jnp.asarray(p.block_mask),
        page_size=p.page_size, sm_scale=p.sm_scale,
    )
    np.testing.assert_allclose(np.asarray(got), oracle(p), atol=2e-5, rtol=2e-5)
