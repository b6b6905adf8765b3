"""Host arrays placed for a program are copies: the scheduler changes its tables in place after
handing them to an asynchronously dispatched program."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxspec.engine.placement import place_rows, place_table


@pytest.mark.parametrize("place", [place_table, place_rows], ids=["table", "rows"])
@pytest.mark.parametrize("on_mesh", [False, True], ids=["one_device", "mesh"])
def test_a_placed_host_array_does_not_follow_later_writes(place, on_mesh):
    mesh = jax.make_mesh((1, 1), ("data", "model")) if on_mesh else None
    # 256 KiB: allocated page-aligned, which is when a CPU device_put may take the buffer as it is.
    host = np.arange(8192 * 8, dtype=np.int32).reshape(8192, 8)
    placed = place(host, mesh)
    host[:] = -1  # what the scheduler does to its tables between calls
    np.testing.assert_array_equal(np.asarray(placed), np.arange(8192 * 8).reshape(8192, 8))
