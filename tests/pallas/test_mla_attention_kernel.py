"""MLA attention kernel (interpret mode on CPU; native on a GPU) against the XLA reference and
the float64 numpy oracle, on fresh random problems. Each case also runs on a pool poisoned
with NaN wherever no row may look: the kernel must still match the clean oracle."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxspec.pallas.block_sizes import AttentionBlocks
from jaxspec.pallas.mla_attention import mla_attention, mla_attention_pallas
from tests.pallas.attention_cases import make_problem
from tests.pallas.test_mla_attention import MLAProblem, oracle, run
from tests.pallas.triton_lowering import triton_calls

DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
TOL = {"f32": (2e-5, 2e-5), "bf16": (3e-2, 3e-2)}  # bf16: bf16 probabilities into P @ c, bf16 output
MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="native", marks=pytest.mark.gpu)]
SMALL = AttentionBlocks(block_m=16, block_k=16, block_w=16)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    kind: str  # prefill | decode | tree | draft
    page_size: int
    dtype: str = "f32"
    B: int = 2
    T: int = 4
    Hq: int = 4
    C: int = 32
    R: int = 8
    positions: int = 48
    prefix: tuple[int, ...] | None = None
    blocks: AttentionBlocks | None = None

    def problem(self) -> MLAProblem:
        seed = zlib.crc32(self.id.encode())
        W = max(2, -(-self.positions // self.page_size))
        base = make_problem(self.kind, B=self.B, T=self.T, page_size=self.page_size, W=W, seed=seed,
                            prefix=self.prefix)
        B, T = base.q.shape[:2]
        L, N = base.k_pool.shape[:2]
        rng = np.random.default_rng(seed)
        dt = DTYPES[self.dtype]
        return MLAProblem(
            q_latent=rng.standard_normal((B, T, self.Hq, self.C)).astype(dt),
            q_rope=rng.standard_normal((B, T, self.Hq, self.R)).astype(dt),
            kv_pool=rng.standard_normal((L, N, self.C + self.R)).astype(dt),
            layer=base.layer, page_table=base.page_table, prefix_lens=base.prefix_lens,
            block_mask=base.block_mask, page_size=self.page_size, sm_scale=(self.C + self.R) ** -0.5,
        )


CASES = [
    Case("prefill-page1-f32-prefix0", "prefill", 1, prefix=(0, 0)),
    Case("prefill-page16-bf16-ragged", "prefill", 16, "bf16", prefix=(5, 30)),
    Case("prefill-page16-f32-T12-row-tiles", "prefill", 16, T=12, prefix=(0, 17), blocks=SMALL),
    Case("decode-page16-f32-ragged", "decode", 16, prefix=(0, 40)),
    Case("decode-page4-f32-C24-R6", "decode", 4, C=24, R=6, Hq=2),
    Case("tree-page1-f32", "tree", 1, T=6),
    Case("tree-page16-bf16-n8", "tree", 16, "bf16", T=8),
    Case("tree-page64-f32-splits", "tree", 64, positions=192,
         blocks=AttentionBlocks(block_m=16, block_k=16, block_w=16, kv_splits=3)),
    Case("draft-page1-f32", "draft", 1),
    Case("draft-page16-f32-small-tiles", "draft", 16, T=8, positions=96, blocks=SMALL),
    # queries re-read per KV tile (the DeepSeek-V3 configuration), with and without splits
    Case("tree-page16-bf16-reload-q", "tree", 16, "bf16", T=8, blocks=dataclasses.replace(SMALL, reload_q=True)),
    Case("decode-page4-f32-reload-q-splits", "decode", 4, positions=96,
         blocks=AttentionBlocks(block_m=16, block_k=16, block_w=16, kv_splits=2, reload_q=True)),
]


def poison_invisible(p: MLAProblem) -> MLAProblem:
    """NaN in every pool row no query row may see (other layers entirely)."""
    P = p.page_size
    B, T = p.q_latent.shape[:2]
    keep = np.zeros(p.kv_pool.shape[1], bool)
    for b in range(B):
        prefix = int(p.prefix_lens[b])
        wb = T if p.block_mask is None else p.block_mask.shape[2]
        seen = set(range(prefix))
        for t in range(T):
            for w in range(wb):
                if (w <= t) if p.block_mask is None else bool(p.block_mask[b, t, w]):
                    seen.add(prefix + w)
        for pos in seen:
            keep[p.page_table[b, pos // P] * P + pos % P] = True
    kv = np.full_like(p.kv_pool, np.nan)
    kv[p.layer, keep] = p.kv_pool[p.layer, keep]
    return dataclasses.replace(p, kv_pool=kv)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernel_matches_reference_and_oracle(case, interpret):
    p = case.problem()
    got = run(p, mla_attention_pallas, interpret=interpret, blocks=case.blocks).astype(np.float64)
    assert np.isfinite(got).all()
    atol, rtol = TOL[case.dtype]
    np.testing.assert_allclose(got, run(p).astype(np.float64), atol=atol, rtol=rtol)
    want = oracle(p)
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)
    poisoned = run(poison_invisible(p), mla_attention_pallas, interpret=interpret, blocks=case.blocks)
    np.testing.assert_allclose(poisoned.astype(np.float64), want, atol=atol, rtol=rtol)


def test_dispatch_and_layer_traced_under_scan():
    p = Case("scan", "tree", 16, T=4).problem()
    L = p.kv_pool.shape[0]
    args = [jnp.asarray(x) for x in (p.q_latent, p.q_rope, p.kv_pool, p.page_table, p.prefix_lens, p.block_mask)]

    def layer_out(impl):
        def body(carry, layer):
            return carry, mla_attention(args[0], args[1], args[2], layer, *args[3:], page_size=16,
                                        sm_scale=p.sm_scale, implementation=impl)
        return jax.lax.scan(body, 0, jnp.arange(L, dtype=jnp.int32))[1]

    got, want = jax.jit(lambda: layer_out("pallas"))(), jax.jit(lambda: layer_out("xla"))()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert not np.allclose(np.asarray(got[0]), np.asarray(got[1]))


@pytest.mark.parametrize("kind,splits", [("prefill", 1), ("tree", 1), ("decode", 4)])
def test_lowers_to_one_triton_kernel(kind, splits):
    """DeepSeek-V3 shapes (C = 512, R = 64, 16 heads per device) get through the Triton lowering."""
    base = make_problem(kind, B=2, T=4, page_size=16, W=4, L=2, seed=0)
    B, T = base.q.shape[:2]
    N = base.k_pool.shape[1]
    blocks = None if splits == 1 else AttentionBlocks(block_m=64, block_k=32, block_w=16, kv_splits=splits)

    def fn(ql, qr, kv, layer, table, prefix, mask):
        return mla_attention_pallas(ql, qr, kv, layer, table, prefix, mask, page_size=16, sm_scale=0.1,
                                    interpret=False, blocks=blocks)

    mask = None if base.block_mask is None else jnp.asarray(base.block_mask)
    args = (jnp.zeros((B, T, 16, 512), jnp.bfloat16), jnp.zeros((B, T, 16, 64), jnp.bfloat16),
            jnp.zeros((2, N, 576), jnp.bfloat16), jnp.int32(0), jnp.asarray(base.page_table),
            jnp.asarray(base.prefix_lens), mask)
    assert triton_calls(fn, *args) == 1


def test_model_forward_pallas_equals_xla():
    """The DeepSeek forward with the Pallas MLA path (interpret mode) equals the XLA path."""
    from jaxspec.kvcache.paging import AttentionInputs
    from jaxspec.model.targets.deepseek import create_mla_pool, deepseek_forward
    from tests.model.targets.test_golden_deepseek import v32_model

    cfg, params = v32_model()
    T = 6
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    attn = AttentionInputs.build(jnp.array([[1], [2]], jnp.int32), jnp.zeros(2, jnp.int32), pos, 8)
    outs = []
    for impl in ("xla", "pallas"):
        pool = create_mla_pool(cfg, num_pages=3, page_size=8, dtype=jnp.float32)
        outs.append(deepseek_forward(params, cfg, tokens, pos, pool, attn, implementation=impl))
    np.testing.assert_allclose(np.asarray(outs[1].hidden), np.asarray(outs[0].hidden), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(outs[1].pool.index_k), np.asarray(outs[0].pool.index_k), atol=2e-5)
