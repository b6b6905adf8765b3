import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kvcache.layout import draft_scratch_positions, draft_scratch_steps, per_step_draft_locs
from jaxspec.kvcache.paging import positions_to_slots


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_positions_to_slots_matches_formula(page_size):
    rng = np.random.default_rng(page_size)
    B, W = 3, 5
    table = rng.permutation(np.arange(1, B * W + 1)).reshape(B, W).astype(np.int32)
    pos = rng.integers(0, W * page_size, size=(B, 7)).astype(np.int32)
    pos[0, 0] = -1  # padding -> scratch slot 0
    got = np.asarray(positions_to_slots(jnp.asarray(table), jnp.asarray(pos), page_size))
    for b in range(B):
        for t in range(7):
            p = pos[b, t]
            want = 0 if p < 0 else table[b, p // page_size] * page_size + p % page_size
            assert got[b, t] == want


@pytest.mark.parametrize("B,K,S", [(1, 1, 1), (2, 1, 5), (3, 4, 5), (2, 8, 3)])
def test_draft_layout_jit_equals_eager(B, K, S):
    base = jnp.asarray(np.arange(B) * 100 + 7, jnp.int32)

    def steps(base):
        return per_step_draft_locs(draft_scratch_positions(base, K, S), B, K, S)

    jitted = np.asarray(jax.jit(steps)(base))
    with jax.disable_jit():
        eager = np.asarray(steps(base))
    np.testing.assert_array_equal(jitted, eager)
    # Row i holds step i of every (request, branch): base + branch * S + i.
    for i in range(S):
        want = (np.arange(B)[:, None] * 100 + 7 + np.arange(K)[None, :] * S + i).reshape(-1)
        np.testing.assert_array_equal(jitted[i], want)


@pytest.mark.parametrize("K,S", [(1, 1), (1, 5), (4, 5), (8, 3)])
def test_draft_scratch_steps_inverts_the_layout(K, S):
    """The read side: scratch column c (position base + c) holds step c % S, exactly the step whose
    row of ``per_step_draft_locs`` wrote it."""
    steps = np.asarray(draft_scratch_steps(K, S))
    np.testing.assert_array_equal(steps, np.arange(K * S) % S)
    per_step = np.asarray(per_step_draft_locs(draft_scratch_positions(jnp.asarray([7], jnp.int32), K, S), 1, K, S))
    for i in range(S):
        np.testing.assert_array_equal(steps[per_step[i] - 7], i)


def test_draft_layout_rejects_wrong_size():
    with pytest.raises(ValueError, match="expected batch_size \\* topk \\* num_steps"):
        per_step_draft_locs(jnp.zeros(10, jnp.int32), 2, 2, 3)
