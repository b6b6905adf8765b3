"""Paged-attention kernel (interpret mode on CPU) against the XLA reference and the float64
numpy oracle of ``attention_cases``, on fresh random problems.

Interpret mode starts the output at NaN, so a row the kernel forgets to write fails. Each
case also runs on pools poisoned with NaN everywhere no row may look (other layers, pages
past the request, block positions no row sees): the kernel must still match the clean
oracle, which shows it only touches visible KV."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxspec.pallas.block_sizes import AttentionBlocks, attention_blocks
from jaxspec.pallas.paged_attention import paged_attention, paged_attention_pallas, paged_attention_reference
from tests.pallas.attention_cases import Problem, make_problem, oracle, poison_invisible
from tests.pallas.triton_lowering import triton_calls

DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
# Tolerances (atol, rtol) by input dtype. bf16: the kernel feeds bf16 probabilities to the
# P @ V matmul (flash-attention practice) and rounds the output to bf16.
TOL_VS_REFERENCE = {"f32": (2e-5, 2e-5), "bf16": (3e-2, 3e-2)}
TOL_VS_ORACLE = {"f32": (2e-5, 2e-5), "bf16": (3e-2, 3e-2)}
MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="native", marks=pytest.mark.gpu)]

SMALL = AttentionBlocks(block_m=16, block_k=16, block_w=16)  # several tiles on tiny shapes


@dataclasses.dataclass(frozen=True)
class AttnCase:
    id: str
    kind: str  # prefill | decode | tree | draft
    page_size: int
    dtype: str = "f32"
    B: int = 3
    T: int = 4
    Hq: int = 4
    Hkv: int = 2
    D: int = 16
    positions: int = 48  # W * page_size (rounded up to whole pages)
    prefix: tuple[int, ...] | None = None  # None: random, ragged
    padded: int = 0  # trailing engine-padding requests (scratch page table, prefix 0)
    blocks: AttentionBlocks | None = None  # None: the heuristic

    def problem(self) -> Problem:
        W = max(2, -(-self.positions // self.page_size))
        return make_problem(
            self.kind, B=self.B, T=self.T, Hq=self.Hq, Hkv=self.Hkv, D=self.D, page_size=self.page_size,
            W=W, seed=zlib.crc32(self.id.encode()), dtype=DTYPES[self.dtype], prefix=self.prefix,
            padded=self.padded,
        )


CASES = [
    # prefill: causal block, prefix 0 or a cached prefix
    AttnCase("prefill-page1-f32-prefix0", "prefill", 1, prefix=(0, 0, 0)),
    AttnCase("prefill-page16-bf16-ragged", "prefill", 16, "bf16", prefix=(0, 9, 30)),
    AttnCase("prefill-page16-f32-T24-row-tiles", "prefill", 16, T=24, prefix=(0, 17, 3), blocks=SMALL),
    AttnCase("prefill-page16-f32-padded-request", "prefill", 16, padded=1),
    # decode: T = 1
    AttnCase("decode-page16-f32-ragged", "decode", 16, prefix=(0, 31, 47)),
    AttnCase("decode-page64-bf16-gqa4", "decode", 64, "bf16", Hq=8, Hkv=2, positions=128),
    AttnCase("decode-page5-f32-mha-d8", "decode", 5, Hq=2, Hkv=2, D=8),
    # tree verify: T = n, tree mask
    AttnCase("tree-page1-f32", "tree", 1, T=6),
    AttnCase("tree-page16-bf16-n8", "tree", 16, "bf16", T=8),
    AttnCase("tree-page64-f32-splits", "tree", 64, positions=192,
             blocks=AttentionBlocks(block_m=16, block_k=16, block_w=16, kv_splits=3)),
    AttnCase("tree-page16-f32-gqa3-d24", "tree", 16, Hq=6, Hkv=2, D=24),
    # draft step: T = topk rows over a topk * S scratch block (Wb > T), ancestor masks
    AttnCase("draft-page1-f32", "draft", 1),
    AttnCase("draft-page16-bf16", "draft", 16, "bf16"),
    AttnCase("draft-page64-f32-small-tiles", "draft", 64, T=8, positions=128, blocks=SMALL),
    # wide heads: the heuristic re-reads q per KV tile (Gemma-like 256 / 512); forced on small D
    AttnCase("decode-page16-bf16-d256-wide", "decode", 16, "bf16", Hq=4, Hkv=2, D=256),
    AttnCase("tree-page4-f32-reload-q-splits", "tree", 4, T=6,
             blocks=AttentionBlocks(block_m=16, block_k=16, block_w=16, kv_splits=2, reload_q=True)),
]


def run(p: Problem, *, interpret: bool, blocks=None, pools=None):
    k_pool, v_pool = pools if pools is not None else (p.k_pool, p.v_pool)
    return np.asarray(paged_attention_pallas(
        jnp.asarray(p.q), jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.int32(p.layer),
        jnp.asarray(p.page_table), jnp.asarray(p.prefix_lens),
        None if p.block_mask is None else jnp.asarray(p.block_mask),
        page_size=p.page_size, sm_scale=p.sm_scale, interpret=interpret, blocks=blocks,
    )).astype(np.float64)


def reference(p: Problem) -> np.ndarray:
    return np.asarray(paged_attention_reference(
        jnp.asarray(p.q), jnp.asarray(p.k_pool), jnp.asarray(p.v_pool), jnp.int32(p.layer),
        jnp.asarray(p.page_table), jnp.asarray(p.prefix_lens),
        None if p.block_mask is None else jnp.asarray(p.block_mask),
        page_size=p.page_size, sm_scale=p.sm_scale,
    )).astype(np.float64)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernel_matches_reference_and_oracle(case, interpret):
    p = case.problem()
    got = run(p, interpret=interpret, blocks=case.blocks)
    assert np.isfinite(got).all()
    atol, rtol = TOL_VS_REFERENCE[case.dtype]
    np.testing.assert_allclose(got, reference(p), atol=atol, rtol=rtol)
    atol, rtol = TOL_VS_ORACLE[case.dtype]
    want = oracle(p)
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)
    # Same program, pools poisoned wherever no row may look.
    poisoned = run(p, interpret=interpret, blocks=case.blocks, pools=poison_invisible(p))
    np.testing.assert_allclose(poisoned, want, atol=atol, rtol=rtol)


def test_layer_is_traced_under_scan():
    # The model runs its layers under lax.scan: the layer index reaches the kernel traced.
    p = make_problem("tree", B=2, T=4, page_size=16, W=3, L=3, seed=11)
    args = [jnp.asarray(x) for x in (p.q, p.k_pool, p.v_pool)]
    table, prefix, mask = (jnp.asarray(x) for x in (p.page_table, p.prefix_lens, p.block_mask))

    def layer_out(impl):
        def body(carry, layer):
            o = paged_attention(args[0], args[1], args[2], layer, table, prefix, mask,
                                page_size=16, sm_scale=p.sm_scale, implementation=impl)
            return carry, o
        return jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))[1]  # [L, B, T, Hq, D]

    got, want = jax.jit(lambda: layer_out("pallas"))(), jax.jit(lambda: layer_out("xla"))()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert not np.allclose(np.asarray(got[0]), np.asarray(got[1]))  # the layers really differ


def test_rows_that_see_nothing_are_zero():
    # A draft row whose block mask is all False and whose prefix is empty has no keys: the
    # kernel returns zeros for it (never NaN), and other rows are unaffected.
    p = make_problem("draft", B=2, T=4, page_size=4, W=6, seed=12, prefix=(0, 5))
    want = oracle(p)  # rows are independent: blinding one row changes no other row
    p.block_mask[0, 2] = False
    got = run(p, interpret=True)
    np.testing.assert_array_equal(got[0, 2], 0.0)
    rows = np.ones(got.shape[:2], bool)
    rows[0, 2] = False
    np.testing.assert_allclose(got[rows], want[rows], atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------ block sizes, lowering


def test_heuristic_blocks_are_valid_and_split_long_contexts_on_gpu():
    # Llama-3-8B verify at batch 1: too few programs for the GPU, so the prefix is split.
    gpu = attention_blocks(batch=1, kv_heads=8, rows=8 * 4, block_width=8, head_dim=128,
                           max_kv_len=8192, interpret=False)
    assert gpu.kv_splits > 1 and gpu.block_m == 32
    # Interpret mode keeps one program per tile (the CPU runs them one after another).
    cpu = attention_blocks(batch=1, kv_heads=8, rows=8 * 4, block_width=8, head_dim=128,
                           max_kv_len=8192, interpret=True)
    assert cpu.kv_splits == 1
    with pytest.raises(ValueError, match="power of two"):
        AttentionBlocks(block_m=24, block_k=16, block_w=16)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("kind,splits", [("prefill", 1), ("tree", 1), ("decode", 4), ("draft", 2)])
def test_lowers_to_one_triton_kernel(kind, splits, dtype):
    # Llama-3-8B attention shape: 32 q heads over 8 KV heads, D = 128.
    p = make_problem(kind, B=2, T=8, Hq=32, Hkv=8, D=128, page_size=16, W=8, L=2, seed=0)
    dt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    blocks = None if splits == 1 else AttentionBlocks(block_m=16, block_k=64, block_w=16, kv_splits=splits)

    def fn(q, k, v, layer, table, prefix, mask):
        return paged_attention_pallas(q, k, v, layer, table, prefix, mask, page_size=16, sm_scale=0.1,
                                      interpret=False, blocks=blocks)

    mask = None if p.block_mask is None else jnp.asarray(p.block_mask)
    args = (jnp.asarray(p.q, dt), jnp.asarray(p.k_pool, dt), jnp.asarray(p.v_pool, dt), jnp.int32(0),
            jnp.asarray(p.page_table), jnp.asarray(p.prefix_lens), mask)
    assert triton_calls(fn, *args) == 1


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize("kind,T", [("tree", 6), ("draft", 4), ("prefill", 5)])
def test_padding_rows_change_no_real_row(kind, T, implementation):
    # A forward padded to Tp rows a request (``model.layers.padded_tokens``) attends its padding
    # rows too, their block-mask rows False (``pad_attention_rows``; a causal block has none): the
    # real rows' outputs keep their bits and the padding rows' are finite.
    p = make_problem(kind, B=2, T=T, page_size=4, W=6, seed=13, prefix=(3, 9))
    Tp = 8
    rng = np.random.default_rng(14)
    q = np.concatenate([p.q, rng.standard_normal((2, Tp - T) + p.q.shape[2:]).astype(p.q.dtype)], axis=1)
    mask = None if p.block_mask is None else np.pad(p.block_mask, ((0, 0), (0, Tp - T), (0, 0)))

    def attend(q, mask):
        return np.asarray(jax.jit(lambda q, mask: paged_attention(
            q, jnp.asarray(p.k_pool), jnp.asarray(p.v_pool), jnp.int32(p.layer), jnp.asarray(p.page_table),
            jnp.asarray(p.prefix_lens), mask, page_size=p.page_size, sm_scale=p.sm_scale,
            implementation=implementation))(jnp.asarray(q), None if mask is None else jnp.asarray(mask)))

    want, got = attend(p.q, p.block_mask), attend(q, mask)
    np.testing.assert_array_equal(got[:, :T], want)
    assert np.isfinite(got[:, T:]).all()
