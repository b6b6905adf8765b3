import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kvcache import layout
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
    """The read side: scratch column c (position base + c) holds branch c // S, step c % S, exactly the
    step whose row of ``per_step_draft_locs`` wrote it."""
    steps = np.asarray(draft_scratch_steps(K, S))
    np.testing.assert_array_equal(steps, np.arange(K * S) % S)
    branch, step = layout.draft_scratch_cells(K, S)
    np.testing.assert_array_equal(branch, np.arange(K * S) // S)
    np.testing.assert_array_equal(step, steps)
    per_step = np.asarray(per_step_draft_locs(draft_scratch_positions(jnp.asarray([7], jnp.int32), K, S), 1, K, S))
    for i in range(S):
        np.testing.assert_array_equal(steps[per_step[i] - 7], i)


def test_draft_layout_rejects_wrong_size():
    with pytest.raises(ValueError, match="expected batch_size \\* topk \\* num_steps"):
        per_step_draft_locs(jnp.zeros(10, jnp.int32), 2, 2, 3)


def _last_step_first(topk: int, num_steps: int) -> np.ndarray:
    """A different draft-scratch layout for tests: step-major, the last step first (branch j, step i at
    offset ``(S - 1 - i) * K + j``); unlike plain step-major it moves a chain's columns too."""
    return np.ascontiguousarray(np.arange(topk * num_steps, dtype=np.int32).reshape(num_steps, topk)[::-1].T)


@pytest.mark.parametrize("swap", [False, True], ids=["branch_major", "step_major"])
def test_draft_masks_read_the_layout(monkeypatch, swap):
    """The draft attention masks take which (branch j, step i) each scratch column holds from the layout
    helper: column ``offset(j, i)`` is visible to a row iff i <= step and its step-i ancestor is branch j
    (the chain: iff i <= step), for the real layout (``j * S + i``) and a swapped one (``(S - 1 - i) * K + j``)."""
    from jaxspec.spec.shape import Chain, draft_ancestor_mask

    if swap:
        monkeypatch.setattr(layout, "_scratch_offsets", _last_step_first)
    B, K, S = 2, 3, 4
    ancestors = jnp.asarray(np.random.default_rng(0).integers(0, K, (B, K, S)), jnp.int32)
    for width, offsets in ((K, layout._scratch_offsets(K, S)), (1, layout._scratch_offsets(1, S))):
        np.testing.assert_array_equal(offsets, _last_step_first(width, S) if swap
                                      else np.arange(width * S).reshape(width, S))
    for step in range(S):
        mask = np.asarray(draft_ancestor_mask(ancestors, step, S))  # [B, K, K*S]
        chain = np.asarray(Chain.draft_mask(ancestors[:, :1], None, step, S)[0])  # [B, 1, S]
        offsets, chain_offsets = layout._scratch_offsets(K, S), layout._scratch_offsets(1, S)
        for j in range(K):
            for i in range(S):
                want = (np.asarray(ancestors)[:, :, i] == j) & (i <= step)
                np.testing.assert_array_equal(mask[:, :, offsets[j, i]], want)
        for i in range(S):
            np.testing.assert_array_equal(chain[:, 0, chain_offsets[0, i]], np.full(B, i <= step))
