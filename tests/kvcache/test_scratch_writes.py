"""Writes aimed at the scratch page are skipped (``jaxspec.kvcache.paging.scratch_dropped``): padding
rows, positions a ring does not hold and unused checkpoint columns all map to scratch, and on a GPU
many writes to one slot serialize (a sliding-window prefill of a 1k-token prompt on an H200 spent
2.8 s of its 2.9 s in them). Every pool's write leaves the scratch page as it was and writes the rest."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kvcache.pool import KVPool, MLAPool

P = 4


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_scratch_slots_are_not_written(kind):
    if kind == "mha":
        pool = KVPool.create(num_layers=2, num_pages=3, page_size=P, num_kv_heads=1, head_dim=2, dtype=jnp.float32)
    else:
        pool = MLAPool.create(num_layers=2, num_pages=3, page_size=P, kv_dim=2, index_dim=2, dtype=jnp.float32)
    slots = jnp.asarray([0, 0, 5, 3, 9, 0], jnp.int32)  # 0 and 3: the scratch page; 5 and 9: pages 1, 2
    rows = jnp.arange(1, 7, dtype=jnp.float32)[:, None] * jnp.ones((6, 2))
    if kind == "mha":
        out = pool.write(1, slots, rows[:, None], -rows[:, None])
        bufs = [np.asarray(out.k[1, :, 0]), -np.asarray(out.v[1, :, 0])]
    else:
        out = pool.write(1, slots, rows, 2 * rows)
        bufs = [np.asarray(out.kv[1]), np.asarray(out.index_k[1]) / 2]
    for buf in bufs:
        assert not buf[:P].any()  # scratch untouched
        np.testing.assert_array_equal(buf[5], [3, 3])
        np.testing.assert_array_equal(buf[9], [5, 5])
        assert not np.delete(buf, [5, 9], axis=0).any()
