"""The exact mode's kernels in interpret mode on fresh random inputs: each against its pure-jnp
reference, and each row's result bit-identical however many rows are computed beside it (a decode
row, a row of a verify chain or tree, a row of a prefill, a row at another batch position). The
same checks run natively on a GPU (``pytest -m gpu``: the "native" cases). Compilation for an H100
is checked with the other kernels (compile_cases.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kvcache.paging import positions_to_slots
from jaxspec.pallas.exact_attention import exact_attention, exact_attention_reference
from jaxspec.pallas.fixed_matmul import MatmulTiles, fixed_matmul_pallas, fixed_matmul_reference


# Interpret mode everywhere; natively on a CUDA GPU too (skipped elsewhere: tests/conftest.py).
MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="native", marks=pytest.mark.gpu)]


def _bits(x) -> np.ndarray:
    return np.asarray(x.astype(jnp.float32))


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("rows,k,n,dtype", [(37, 320, 200, jnp.bfloat16), (9, 64, 96, jnp.float32),
                                            (1, 130, 17, jnp.bfloat16)])
def test_fixed_matmul_matches_reference_and_is_row_invariant(rows, k, n, dtype, interpret):
    rng = np.random.default_rng(rows * 1000 + k)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.1, dtype)
    tiles = MatmulTiles(bm=16, bn=64, bk=64)
    full = fixed_matmul_pallas(x, w, tiles=tiles, interpret=interpret)
    ref = fixed_matmul_reference(x, w)
    np.testing.assert_allclose(_bits(full), _bits(ref), rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5, atol=1e-3)
    for i in sorted({0, rows // 2, rows - 1}):  # a row alone, and rows inside another slice of the batch
        alone = fixed_matmul_pallas(x[i:i + 1], w, tiles=tiles, interpret=interpret)
        np.testing.assert_array_equal(_bits(alone)[0], _bits(full)[i])
    sub = fixed_matmul_pallas(x[rows // 3:], w, tiles=tiles, interpret=interpret)
    np.testing.assert_array_equal(_bits(sub), _bits(full)[rows // 3:])
    # Leading dims are rows too.
    np.testing.assert_array_equal(_bits(fixed_matmul_pallas(x[None], w, tiles=tiles, interpret=interpret))[0], _bits(full))


P, W, L, HKV, G, D = 16, 8, 2, 2, 2, 16
PARENTS = [-1, 0, 0, 1, 2, 3, 1]  # a tree of 7 nodes, parents first


def _problem(seed: int, batch: int = 2, rows: int = 7, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    N = (batch * W + 1) * P
    k = jnp.asarray(rng.standard_normal((L, N, HKV, D)), dtype)
    v = jnp.asarray(rng.standard_normal((L, N, HKV, D)), dtype)
    table = jnp.asarray(1 + rng.permutation(batch * W).reshape(batch, W), jnp.int32)
    prefix = jnp.asarray(rng.integers(0, W * P - rows - 1, batch), jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, rows, HKV * G, D)), dtype)
    return q, k, v, table, prefix


def _tree_mask(batch: int) -> np.ndarray:
    n = len(PARENTS)
    mask = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = PARENTS[j]
    return np.broadcast_to(mask, (batch, n, n))


def _attend(q, k, v, table, prefix, mask, interpret):
    return exact_attention(q, k, v, jnp.int32(1), table, prefix, None if mask is None else jnp.asarray(mask),
                           page_size=P, sm_scale=D ** -0.5, interpret=interpret)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("kind", ["causal", "chain", "tree"])
def test_exact_attention_matches_reference(kind, interpret):
    q, k, v, table, prefix = _problem(1)
    B, T = q.shape[:2]
    mask = {"causal": None, "chain": np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T)),
            "tree": _tree_mask(B)}[kind]
    out = _attend(q, k, v, table, prefix, mask, interpret)
    ref = exact_attention_reference(q, k, v, jnp.int32(1), table, prefix, None if mask is None else jnp.asarray(mask),
                                    page_size=P, sm_scale=D ** -0.5)
    np.testing.assert_allclose(_bits(out), _bits(ref), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("interpret", MODES)
def test_a_verify_row_equals_the_decode_row_at_its_position_bitwise(interpret):
    """Chain verify rows, a causal prefill block and one-row decodes at the same positions agree bit
    for bit; so does a decode row placed at another batch position."""
    q, k, v, table, prefix = _problem(2)
    B, T = q.shape[:2]
    chain = np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T))
    verify = _bits(_attend(q, k, v, table, prefix, chain, interpret))
    np.testing.assert_array_equal(_bits(_attend(q, k, v, table, prefix, None, interpret)), verify)
    for b, t in ((0, 0), (0, T - 1), (1, 3)):
        decode = _attend(q[b:b + 1, t:t + 1], k, v, table[b:b + 1], prefix[b:b + 1] + t, None, interpret)
        np.testing.assert_array_equal(_bits(decode)[0, 0], verify[b, t])
    # Row 1 of request 0 decoded as the second request of a batch of two.
    pair = _attend(jnp.concatenate([q[1:, :1], q[:1, 1:2]]), k, v, jnp.concatenate([table[1:], table[:1]]),
                   jnp.asarray([prefix[1], prefix[0] + 1]), None, interpret)
    np.testing.assert_array_equal(_bits(pair)[1, 0], verify[0, 1])


@pytest.mark.parametrize("interpret", MODES)
def test_a_tree_node_equals_the_decode_of_its_path_bitwise(interpret):
    """A verify tree's node reads its ancestors where they sit in the block; the decode of the same
    path (the accepted nodes moved to consecutive positions, as compaction does) gives its bits."""
    q, k, v, table, prefix = _problem(3)
    B, T = q.shape[:2]
    mask = _tree_mask(B)
    tree = _bits(_attend(q, k, v, table, prefix, mask, interpret))
    for b, t in ((0, 4), (0, 6), (1, 5), (1, 2)):  # nodes whose paths skip block offsets
        path = [j for j in range(T) if mask[b, t, j]]
        src = positions_to_slots(table[b:b + 1], jnp.asarray([[int(prefix[b]) + j for j in path]]), P)[0]
        dst = positions_to_slots(table[b:b + 1], jnp.asarray([[int(prefix[b]) + d for d in range(len(path))]]), P)[0]
        k2, v2 = k.at[:, dst].set(k[:, src]), v.at[:, dst].set(v[:, src])
        decode = _attend(q[b:b + 1, t:t + 1], k2, v2, table[b:b + 1], prefix[b:b + 1] + len(path) - 1, None, interpret)
        np.testing.assert_array_equal(_bits(decode)[0, 0], tree[b, t])
