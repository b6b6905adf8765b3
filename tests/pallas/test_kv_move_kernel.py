"""KV-move kernel (interpret mode on CPU) against the XLA reference and a sequential numpy
oracle: every pool kind, overlapping moves, padding, empty and zero-layer pools, bounds check.

A move is a copy, so the tolerance is exact equality, and every row that is not a target
must stay bit-identical (the pool is updated in place: it is its own poisoned output)."""

from __future__ import annotations

import dataclasses
import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.spec.compact import compact_pool, compaction_moves
from jaxspec.kvcache.pool import KVPool, MLAPool
from jaxspec.pallas.block_sizes import MoveBlocks
from jaxspec.pallas.kv_move import kv_move, kv_move_checked, kv_move_pallas, kv_move_reference
from tests.pallas.triton_lowering import triton_calls

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="native", marks=pytest.mark.gpu)]


# Buffers of each pool kind, as trailing shapes after [L, N].
POOLS = {
    "mha": ((2, 16), (2, 16)),  # k, v: [L, N, Hkv, D]
    "mha_odd": ((2, 10), (2, 10)),  # row width 20: partial column blocks
    "mla": ((72,),),  # latent + rope: [L, N, C]
    "mla_indexer": ((40,), (24,)),  # latent [L, N, C] and indexer keys [L, N, Di] move together
}


@dataclasses.dataclass(frozen=True)
class MoveCase:
    id: str
    pool: str
    page_size: int
    dtype: str = "f32"
    B: int = 4
    S: int = 4  # moves per request (num_steps)
    L: int = 3
    grouped: bool = False  # pass moves_per_request=S (whole requests per program)
    blocks: MoveBlocks | None = None


CASES = [
    MoveCase("mha-page1-f32", "mha", 1),
    MoveCase("mha-page16-bf16", "mha", 16, "bf16"),
    MoveCase("mha-page16-f32-grouped", "mha", 16, grouped=True),
    MoveCase("mha-page64-bf16-grouped-1req", "mha", 64, "bf16", grouped=True,
             blocks=MoveBlocks(group_rows=4, requests_per_group=1, block_cols=(32, 32))),
    MoveCase("mha_odd-page5-f32-small-tiles", "mha_odd", 5,
             blocks=MoveBlocks(group_rows=16, requests_per_group=None, block_cols=(8, 8))),
    MoveCase("mla-page16-bf16", "mla", 16, "bf16"),
    MoveCase("mla_indexer-page1-f32", "mla_indexer", 1, grouped=True),
    MoveCase("mla_indexer-page16-bf16-B1", "mla_indexer", 16, "bf16", B=1, S=6),
]


def random_compaction(rng, *, B, S, page_size, n_nodes=None):
    """Page table, and the flat moves of a random accepted path per request (via the engine's
    own ``compaction_moves``), as numpy arrays. Returns (num_slots, src [B*S], dst [B*S])."""
    n_nodes = n_nodes or 2 * S + 2
    W = -(-(40 + n_nodes) // page_size) + 1
    num_pages = B * W + 1
    table = (1 + rng.permutation(B * W)).reshape(B, W).astype(np.int32)
    seq_lens = rng.integers(0, W * page_size - n_nodes, size=B).astype(np.int32)
    accept_index = np.full((B, S + 1), -1, np.int32)
    accept_lens = rng.integers(1, S + 2, size=B).astype(np.int32)
    accept_lens[0] = S + 1  # request 0 accepts a full path that skips node 1: it moves
    for b in range(B):
        k = accept_lens[b]
        accept_index[b, 0] = 0
        accept_index[b, 1:k] = np.sort(rng.choice(np.arange(1 + (b == 0), n_nodes), size=k - 1, replace=False))
    active = np.ones(B, bool)
    if B > 1:
        active[-1] = False  # an inactive row: all padding
    src, dst = compaction_moves(jnp.asarray(table), jnp.asarray(seq_lens), jnp.asarray(accept_index),
                                jnp.asarray(accept_lens), jnp.asarray(active), page_size)
    return num_pages * page_size, np.asarray(src), np.asarray(dst)


def random_buffers(rng, kind, L, N, dtype):
    return tuple(jnp.asarray(rng.standard_normal((L, N) + tail), dtype) for tail in POOLS[kind])


def sequential_oracle(buffers, src, dst):
    """Moves applied one at a time in list order (exact for the a_j >= j layout)."""
    out = [np.array(b) for b in buffers]
    for s, d in zip(src, dst):
        if s >= 0 and d >= 0:
            for o in out:
                o[:, d] = o[:, s]
    return out


def assert_moved(got, buffers, src, dst):
    want = sequential_oracle(buffers, src, dst)
    ref = kv_move_reference(buffers, jnp.asarray(src), jnp.asarray(dst))
    targets = np.zeros(buffers[0].shape[1], bool)
    targets[dst[(src >= 0) & (dst >= 0)]] = True
    for g, w, r, before in zip(got, want, ref, buffers):
        g = np.asarray(g)
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(g, np.asarray(r))
        np.testing.assert_array_equal(g[:, ~targets], np.asarray(before)[:, ~targets])  # untouched rows


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kv_move_matches_reference(case, interpret):
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    N, src, dst = random_compaction(rng, B=case.B, S=case.S, page_size=case.page_size)
    assert (src >= 0).any(), "the case must move something"
    buffers = random_buffers(rng, case.pool, case.L, N, DTYPES[case.dtype])
    got = kv_move_pallas(buffers, jnp.asarray(src), jnp.asarray(dst), interpret=interpret,
                         moves_per_request=case.S if case.grouped else None, blocks=case.blocks)
    assert_moved(got, buffers, src, dst)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("grouped", [False, True], ids=["one-group", "per-request"])
def test_overlapping_moves_are_exact(grouped, interpret):
    # Request 0 (seq_len 10) accepts nodes 0, 2, 3, 5: moves 12->11, 13->12, 15->13. The target
    # of each later move is the source of the one before it. Request 1 (seq_len 30) accepts
    # 0, 1, 4: node 1 stays (no move, -1) and 34 -> 32.
    src = np.array([12, 13, 15, -1, 34, -1], np.int32)
    dst = np.array([11, 12, 13, -1, 32, -1], np.int32)
    assert set(dst[1:3]) <= set(src[:2])
    rng = np.random.default_rng(1)
    buffers = random_buffers(rng, "mha", 2, 48, jnp.float32)
    got = kv_move_pallas(buffers, jnp.asarray(src), jnp.asarray(dst), interpret=interpret,
                         moves_per_request=3 if grouped else None)
    assert_moved(got, buffers, src, dst)
    # The exact values: slot 11 <- old 12, slot 12 <- old 13, slot 13 <- old 15.
    for g, b in zip(got, buffers):
        np.testing.assert_array_equal(np.asarray(g)[:, [11, 12, 13]], np.asarray(b)[:, [12, 13, 15]])


@pytest.mark.parametrize("interpret", MODES)
def test_all_padding_empty_and_zero_layer_are_noops(interpret):
    rng = np.random.default_rng(2)
    buffers = random_buffers(rng, "mla_indexer", 2, 32, jnp.float32)
    pad = jnp.full((8,), -1, jnp.int32)
    for src, dst in [(pad, pad), (jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32))]:
        got = kv_move_pallas(buffers, src, dst, interpret=interpret)
        for g, b in zip(got, buffers):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(b))
    # All padding but traced: the kernel's programs skip their work.
    got = jax.jit(functools.partial(kv_move_pallas, interpret=interpret))(buffers, pad, pad)
    for g, b in zip(got, buffers):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(b))
    empty = (jnp.zeros((0, 32, 2, 16)), jnp.zeros((0, 32, 2, 16)))
    got = kv_move_pallas(empty, jnp.array([3], jnp.int32), jnp.array([1], jnp.int32), interpret=interpret)
    assert [g.shape for g in got] == [(0, 32, 2, 16)] * 2


def test_compact_pool_with_pallas_moves_every_pool_kind():
    rng = np.random.default_rng(3)
    B, S, P = 3, 3, 4
    W = 12
    table = jnp.asarray((1 + rng.permutation(B * W)).reshape(B, W), jnp.int32)
    seq_lens = jnp.array([5, 0, 17], jnp.int32)
    accept_index = jnp.array([[0, 2, 3, 6], [0, 1, 5, -1], [0, -1, -1, -1]], jnp.int32)
    accept_lens = jnp.array([4, 3, 1], jnp.int32)
    active = jnp.ones((B,), bool)
    N = (B * W + 1) * P
    pools = [
        KVPool(*random_buffers(rng, "mha", 2, N, jnp.float32), page_size=P),
        MLAPool(*random_buffers(rng, "mla_indexer", 2, N, jnp.bfloat16), page_size=P),
        MLAPool(random_buffers(rng, "mla", 2, N, jnp.float32)[0], page_size=P),
        KVPool(jnp.zeros((0, N, 2, 16)), jnp.zeros((0, N, 2, 16)), page_size=P),
    ]
    for pool in pools:
        want = compact_pool(pool, table, seq_lens, accept_index, accept_lens, active, implementation="xla")
        got = compact_pool(pool, table, seq_lens, accept_index, accept_lens, active, implementation="pallas")
        for g, w in zip(got.buffers, want.buffers):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_kv_move_in_place_under_jit_with_donation():
    rng = np.random.default_rng(4)
    N, src, dst = random_compaction(rng, B=2, S=3, page_size=16)
    buffers = random_buffers(rng, "mha", 2, N, jnp.float32)
    want = kv_move_reference(buffers, jnp.asarray(src), jnp.asarray(dst))
    step = jax.jit(lambda bufs, s, d: kv_move(bufs, s, d, implementation="pallas"), donate_argnums=0)
    donated = tuple(jnp.array(b) for b in buffers)
    args = (jnp.asarray(src), jnp.asarray(dst))
    # The pool buffers are aliased to the outputs (updated in place, no copy of the pool) ...
    aliases = re.search(r"input_output_alias=\{([^\n]*)\}", step.lower(donated, *args).compile().as_text())
    assert aliases and all(f"({i}, {{}}" in aliases.group(1) for i in range(len(buffers))), aliases
    got = step(donated, *args)
    # ... so the donated inputs are gone after the call.
    assert all(b.is_deleted() for b in donated)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# ------------------------------------------------------------------ bounds check


@pytest.mark.parametrize("bad,implementation", [
    ("src_high", "pallas"), ("dst_high", "pallas"), ("dst_below_padding", "pallas"), ("src_high", "xla"),
])
def test_out_of_bounds_slot_raises_clear_error(bad, implementation):
    rng = np.random.default_rng(5)
    buffers = random_buffers(rng, "mha", 2, 32, jnp.float32)
    src = np.array([4, 9, -1, 20], np.int32)
    dst = np.array([3, 8, -1, 19], np.int32)
    if bad == "src_high":
        src[1] = 32
    elif bad == "dst_high":
        dst[3] = 1000
    else:
        dst[0] = -7
    with pytest.raises(Exception, match=r"kv_move: slot out of bounds in move \d.*the pool has 32 slots"):
        kv_move_checked(buffers, jnp.asarray(src), jnp.asarray(dst), implementation=implementation)
    with pytest.raises(Exception, match="slot out of bounds"):  # eager, opt-in flag
        kv_move(buffers, jnp.asarray(src), jnp.asarray(dst), implementation=implementation, check_bounds=True)


def test_unchecked_out_of_bounds_moves_never_touch_memory():
    # Without the check the kernel drops a bad move like padding (the pool stays intact).
    rng = np.random.default_rng(6)
    buffers = random_buffers(rng, "mha", 2, 32, jnp.float32)
    src = jnp.array([4, 40, 7], jnp.int32)
    dst = jnp.array([3, 2, 99], jnp.int32)
    got = kv_move_pallas(buffers, src, dst, interpret=True)
    want = sequential_oracle(buffers, np.array([4, -1, -1]), np.array([3, -1, -1]))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_checked_move_passes_good_input():
    rng = np.random.default_rng(7)
    N, src, dst = random_compaction(rng, B=2, S=2, page_size=1)
    buffers = random_buffers(rng, "mha", 1, N, jnp.float32)
    got = kv_move_checked(buffers, jnp.asarray(src), jnp.asarray(dst), implementation="pallas")
    assert_moved(got, buffers, src, dst)


# ------------------------------------------------------------------ Triton lowering


@pytest.mark.parametrize("kind", ["mha", "mla_indexer"])
def test_lowers_to_one_triton_kernel(kind):
    buffers = tuple(jnp.zeros((4, 256) + tail, jnp.bfloat16) for tail in POOLS[kind])
    slots = jnp.zeros((12,), jnp.int32)
    fn = functools.partial(kv_move_pallas, interpret=False, moves_per_request=3)
    assert triton_calls(fn, buffers, slots, slots) == 1
