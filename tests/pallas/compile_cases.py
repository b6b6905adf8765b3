"""Realistic shapes at which every Pallas kernel is compiled for an H100 (table-driven).

Each :class:`CompileCase` builds a function that calls one kernel natively (``interpret=False``)
and the abstract arguments for it (``jax.ShapeDtypeStruct``: nothing is allocated). Compiled
under ``triton_compile.as_if_h100`` the kernels take the block sizes an H100 would use (its
entries in the block table, else the heuristics). The CPU test
``tests/pallas/test_triton_compile.py`` and ``scripts/triton_report.py`` run the same table
through :mod:`tests.pallas.triton_compile`. A new kernel or model family is one more row.

Shapes (bf16 pools, 4k context unless said otherwise):
* Llama-3-8B attention: 32 query / 8 KV heads, head dim 128, 32 layers; prefill 2048,
  decode at batch 32, tree verify n=8 at batch 1/16/32, draft rows (topk=4 over a 5-step
  scratch with ancestor masks), page sizes 16 and 64.
* DeepSeek-V3 MLA: 128 heads, latent 512 + rope 64, 61 layers; decode and verify n=8 at
  batch 1 and 32.
* DeepSeek-V3.2 sparse MLA: the same heads over 2048 slots selected per query row (the
  indexer's top-k), decode at batch 1 and 32, verify n=8 at batch 32.
* DeepSeek-V3.2 lightning indexer scores: 64 heads x 128 over 64k positions (page 64), decode
  at batch 1 and tree verify n=8 at batch 32.
* DeepSeek-V4-Flash (43 layers: 21 CSA, 20 HCA; one K = V head of 512): the lightning indexer
  (64 heads x 128) over the CSA entries of a 128k context (32k entries, rate 4; page 64), decode at
  batch 1 and verify n=8 at batch 32, and in a 2048-token prefill (its 513 entries closing in the
  chunk under a block mask); compaction of its ring pool (the K = V rows of every layer, the CSA and
  the HCA layers' compressor inputs of each token; each buffer moves on its own, their layer counts
  differ); the MTP seed gather of the flattened streams (4 x 4096).
* KV move: the MHA pool (K and V) and the MLA + indexer pool; the fused spec-extras gather.
* RoPE and the K/V write (Llama-3-8B: decode, verify n=8 at batch 32, a 2048-token prefill;
  Qwen2.5-7B's 28 / 4 heads, which pad to a power of two); RMSNorm at both models' widths.
* Gemma-4-31B-like attention (report rows): head dim 256 (sliding layers, 32 / 16 heads) and
  512 (full layers, 32 / 4 heads). They need not meet the spill criterion, but then the
  dispatch must route them to XLA on a GPU with the reason recorded.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxspec.model.config import RopeConfig
from jaxspec.model.layers import gelu_tanh
from jaxspec.pallas import block_table
from jaxspec.pallas.dsa_indexer import index_scores_pallas
from jaxspec.pallas.exact_attention import exact_attention
from jaxspec.pallas.fixed_matmul import fixed_matmul_pallas
from jaxspec.pallas.gather_extras import gather_spec_extras_pallas
from jaxspec.pallas.grouped_matmul import grouped_matmul_tiled_pallas, tiles_needed
from jaxspec.pallas.kv_move import kv_move_pallas
from jaxspec.pallas.mla_attention import mla_attention_pallas
from jaxspec.pallas.mla_sparse_attention import mla_sparse_attention_pallas
from jaxspec.pallas.paged_attention import paged_attention_pallas
from jaxspec.pallas.rms_norm import rms_norm_pallas
from jaxspec.pallas.rope_write import rope_write_pallas
from jaxspec.pallas.sinkhorn import sinkhorn_pallas

_BF16 = jnp.bfloat16
_I32 = jnp.int32


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """One paged-attention (or MLA) call: ``rows`` query rows per request over a prefix of
    ``context`` positions, then a block of ``block`` positions (causal when ``mask`` is False)."""

    batch: int
    rows: int  # T
    block: int  # Wb: block positions (T for prefill / decode / verify, topk * S for draft rows)
    context: int  # positions the page table covers
    page_size: int
    mask: bool  # a block mask (tree verify, draft rows) or causal
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    layers: int = 32
    # MLA: latent + rope widths (q_heads heads over one shared latent row)
    latent: int = 0
    rope: int = 0

    @property
    def width(self) -> int:  # W: page-table width
        return -(-self.context // self.page_size)

    @property
    def slots(self) -> int:  # N: pool slots for every request's pages plus the scratch page
        return (self.batch * self.width + 1) * self.page_size


def _attention_args(s: AttentionShape, kv_width: tuple[int, ...]):
    B, T = s.batch, s.rows
    table = _sds((B, s.width), _I32)
    prefix = _sds((B,), _I32)
    mask = _sds((B, T, s.block), jnp.bool_) if s.mask else None
    pool = _sds((s.layers, s.slots) + kv_width, _BF16)
    return pool, table, prefix, mask


def paged_attention_case(s: AttentionShape):
    pool, table, prefix, mask = _attention_args(s, (s.kv_heads, s.head_dim))
    q = _sds((s.batch, s.rows, s.q_heads, s.head_dim), _BF16)

    def fn(q, k, v, layer, table, prefix, mask):  # a fresh closure per call: JAX caches lowerings by function
        return paged_attention_pallas(q, k, v, layer, table, prefix, mask, page_size=s.page_size,
                                      sm_scale=s.head_dim ** -0.5, interpret=False)

    return fn, (q, pool, pool, _sds((), _I32), table, prefix, mask)


def mla_attention_case(s: AttentionShape):
    pool, table, prefix, mask = _attention_args(s, (s.latent + s.rope,))
    q_latent = _sds((s.batch, s.rows, s.q_heads, s.latent), _BF16)
    q_rope = _sds((s.batch, s.rows, s.q_heads, s.rope), _BF16)

    def fn(ql, qr, kv, layer, table, prefix, mask):
        return mla_attention_pallas(ql, qr, kv, layer, table, prefix, mask, page_size=s.page_size,
                                    sm_scale=(128 + 64) ** -0.5, interpret=False)

    return fn, (q_latent, q_rope, pool, _sds((), _I32), table, prefix, mask)


def mla_sparse_attention_case(batch: int, rows: int, selected: int = 2048, context: int = 8192):
    """DeepSeek-V3.2 DSA: every query row attends over ``selected`` slots of a pool holding
    ``context`` positions per request."""
    m = DSV3
    q_latent = _sds((batch, rows, m["q_heads"], m["latent"]), _BF16)
    q_rope = _sds((batch, rows, m["q_heads"], m["rope"]), _BF16)
    pool = _sds((m["layers"], batch * context + 64, m["latent"] + m["rope"]), _BF16)
    slots = _sds((batch, rows, selected), _I32)

    def fn(ql, qr, kv, layer, slots):
        return mla_sparse_attention_pallas(ql, qr, kv, layer, slots, sm_scale=(128 + 64) ** -0.5, interpret=False)

    return fn, (q_latent, q_rope, pool, _sds((), _I32), slots)


def dsa_indexer_case(batch: int, rows: int, context: int = 65536, page_size: int = 64, layers: int = 61,
                     mask_width: int | None = None):
    """DeepSeek-V3.2's lightning indexer scores: 64 heads of width 128 over ``context``
    positions per request (bf16 indexer keys, 61 layers); ``rows`` > 1 is a tree verify (block mask,
    ``mask_width`` columns: default ``rows``). DeepSeek-V4 runs the same scores over compressed
    entries (``context`` entries, its CSA layers)."""
    W = context // page_size
    index_q = _sds((batch, rows, 64, 128), _BF16)
    weights = _sds((batch, rows, 64), jnp.float32)
    pool = _sds((layers, (batch * W + 1) * page_size, 128), _BF16)
    mask = _sds((batch, rows, mask_width or rows), jnp.bool_) if rows > 1 or mask_width else None

    def fn(q, w, k, layer, table, prefix, mask):
        return index_scores_pallas(q, w, k, layer, table, prefix, mask, page_size=page_size, interpret=False)

    return fn, (index_q, weights, pool, _sds((), _I32), _sds((batch, W), _I32), _sds((batch,), _I32), mask)


def kv_move_case(layers: int, slots: int, rows: tuple[tuple[int, ...], ...], batch: int, steps: int):
    """Compaction after verify: ``steps`` moves per request, every buffer of the pool."""
    buffers = tuple(_sds((layers, slots) + r, _BF16) for r in rows)
    moves = _sds((batch * steps,), _I32)

    def fn(buffers, src, dst):
        return kv_move_pallas(buffers, src, dst, interpret=False, moves_per_request=steps)

    return fn, (buffers, moves, moves)


def gather_case(batch: int, rows_per_request: int, hidden: int | None):
    """Draft-extend seed: the root token and the draft's hidden, one row per request out of
    ``rows_per_request``."""
    N = batch * rows_per_request
    args = (_sds((batch,), _I32), _sds((N,), _I32), None if hidden is None else _sds((N, hidden), _BF16))

    def fn(index, tokens, hidden):
        return gather_spec_extras_pallas(index, tokens, hidden, interpret=False)

    return fn, args


def rope_write_case(rows: int, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128, layers: int = 32):
    """RoPE on ``rows`` new tokens' q and k, and their K/V written into the pool."""
    qkv = _sds((rows, q_heads + 2 * kv_heads, head_dim), _BF16)
    pool = _sds((layers, 32 * CTX + 16, kv_heads, head_dim), _BF16)
    inv_freq = RopeConfig(theta=500_000.0).inv_freq(head_dim)

    def fn(qkv, k_pool, v_pool, layer, slots, positions):
        return rope_write_pallas(qkv, k_pool, v_pool, layer, slots, positions, inv_freq, q_heads=q_heads,
                                 interpret=False)

    return fn, (qkv, pool, pool, _sds((), _I32), _sds((rows,), _I32), _sds((rows,), _I32))


def rms_norm_case(rows: int, width: int = 4096, layers: int = 32, centred: bool = False, taps: int = 0):
    """RMSNorm of ``rows`` rows with one layer's weights out of the stacked ``[L, H]`` (``centred``:
    zero-centred weights, Qwen3-Next's arithmetic; ``taps``: the rows also recorded into a buffer of
    ``taps + 1`` slots, EAGLE-3's aux taps)."""
    if taps:
        def fn(x, weights, layer, buffer, slots):
            return rms_norm_pallas(x, weights, layer, 1e-5, interpret=False, record=(buffer, slots))

        return fn, (_sds((rows, width), _BF16), _sds((layers, width), _BF16), _sds((), _I32),
                    _sds((taps + 1, rows, width), _BF16), _sds((layers + 1,), _I32))

    def fn(x, weights, layer):
        return rms_norm_pallas(x, weights, layer, 1e-5, interpret=False, centred=centred)

    return fn, (_sds((rows, width), _BF16), _sds((layers, width), _BF16), _sds((), _I32))


def sinkhorn_case(matrices: int, streams: int = 4, iters: int = 20):
    """DeepSeek-V4's hyper-connection mixing matrices (``streams`` x ``streams`` per token)."""

    def fn(logits):
        return sinkhorn_pallas(logits, iters=iters, eps=1e-6, interpret=False)

    return fn, (_sds((matrices, streams, streams), jnp.float32),)


@dataclasses.dataclass(frozen=True)
class CompileCase:
    """One kernel at one shape, and what it must show once compiled.

    Attributes:
      id: readable name (kernel, model, phase, batch, page size).
      op: the op's dispatch name.
      build: returns ``(fn, args)`` for :func:`triton_compile.compile_for_h100`.
      spill_free: fail on any register spill.
      reads_kv: fail without 16-byte global loads or 16-byte ``cp.async`` (and on scalar
        loads of the 2-byte pool dtype).
      must_pass: False for report rows: when such a row fails a criterion, the dispatch must
        route its shape to XLA on a GPU (and say why).
      shape: the attention shape (None for copies), for the dispatch check.
    """

    id: str
    op: str
    build: Callable[[], tuple[Callable, tuple[Any, ...]]]
    spill_free: bool = True
    reads_kv: bool = True
    must_pass: bool = True
    shape: AttentionShape | None = None

    def shape_class(self) -> str:
        """The block-table class of this launch (what dispatch and the table key on)."""
        s = self.shape
        if s is None:
            return self.op
        phase = block_table.attention_phase(rows=s.rows, block_width=s.block, causal=not s.mask)
        return block_table.attention_class(self.op, phase=phase, head_dim=s.latent or s.head_dim,
                                           page_size=s.page_size)


def exact_attention_case(s: AttentionShape):
    pool, table, prefix, mask = _attention_args(s, (s.kv_heads, s.head_dim))
    q = _sds((s.batch, s.rows, s.q_heads, s.head_dim), _BF16)

    def fn(q, k, v, layer, table, prefix, mask):
        return exact_attention(q, k, v, layer, table, prefix, mask, page_size=s.page_size,
                               sm_scale=s.head_dim ** -0.5, interpret=False)

    return fn, (q, pool, pool, _sds((), _I32), table, prefix, mask)


def fixed_matmul_case(rows: int, k: int, n: int):
    def fn(x, w):
        return fixed_matmul_pallas(x, w, interpret=False)

    return fn, (_sds((rows, k), _BF16), _sds((k, n), _BF16))


def grouped_matmul_case(rows: int, experts: int, k: int, n: int, block_m: int, gated: bool, limit: float | None = None,
                        activation=jax.nn.silu):
    """An MoE block's routed experts in the tiled layout: ``rows`` assignments over ``experts``
    experts of ``[k, n]`` weights (``gated``: the gate and up products and ``activation``)."""
    tiles = tiles_needed(rows, experts, block_m)

    def fn(xt, tile_group, w, w_up=None):
        return grouped_matmul_tiled_pallas(xt, tile_group, w, w_up=w_up, activation=activation, limit=limit,
                                           interpret=False)

    w = _sds((experts, k, n), _BF16)
    return fn, (_sds((tiles * block_m, k), _BF16), _sds((tiles,), _I32), w) + ((w,) if gated else ())


def _attn(id_, s: AttentionShape, **kw) -> CompileCase:
    return CompileCase(id_, "paged_attention", functools.partial(paged_attention_case, s), shape=s, **kw)


def _mla(id_, s: AttentionShape, **kw) -> CompileCase:
    return CompileCase(id_, "mla_attention", functools.partial(mla_attention_case, s), shape=s, **kw)


CTX = 4096
LLAMA = dict(q_heads=32, kv_heads=8, head_dim=128, layers=32)
DSV3 = dict(q_heads=128, kv_heads=1, head_dim=0, latent=512, rope=64, layers=61)
GEMMA_SLIDING = dict(q_heads=32, kv_heads=16, head_dim=256, layers=60)
GEMMA_FULL = dict(q_heads=32, kv_heads=4, head_dim=512, layers=60)


def _verify(batch, page=16, **model):
    return AttentionShape(batch=batch, rows=8, block=8, context=CTX, page_size=page, mask=True, **model)


def _decode(batch, page=16, **model):
    return AttentionShape(batch=batch, rows=1, block=1, context=CTX, page_size=page, mask=False, **model)


def _prefill(rows, page=16, **model):
    return AttentionShape(batch=1, rows=rows, block=rows, context=rows, page_size=page, mask=False, **model)


def _draft(batch, page=16, topk=4, steps=5, **model):
    return AttentionShape(batch=batch, rows=topk, block=topk * steps, context=CTX, page_size=page, mask=True,
                          **model)


CASES: list[CompileCase] = [
    # Llama-3-8B
    _attn("llama3-8b prefill T=2048 p16", _prefill(2048, **LLAMA)),
    _attn("llama3-8b decode B=32 p16", _decode(32, **LLAMA)),
    _attn("llama3-8b decode B=32 p64", _decode(32, page=64, **LLAMA)),
    _attn("llama3-8b verify n=8 B=1 p16", _verify(1, **LLAMA)),
    _attn("llama3-8b verify n=8 B=16 p16", _verify(16, **LLAMA)),
    _attn("llama3-8b verify n=8 B=32 p16", _verify(32, **LLAMA)),
    _attn("llama3-8b verify n=8 B=16 p64", _verify(16, page=64, **LLAMA)),
    _attn("llama3-8b draft topk=4 S=5 B=1 p16", _draft(1, **LLAMA)),
    _attn("llama3-8b draft topk=4 S=5 B=16 p64", _draft(16, page=64, **LLAMA)),
    # DeepSeek-V3 MLA
    _mla("deepseek-v3 mla decode B=1 p16", _decode(1, **DSV3)),
    _mla("deepseek-v3 mla decode B=32 p16", _decode(32, **DSV3)),
    _mla("deepseek-v3 mla verify n=8 B=1 p16", _verify(1, **DSV3)),
    _mla("deepseek-v3 mla verify n=8 B=32 p64", _verify(32, page=64, **DSV3)),
    # DeepSeek-V3.2 sparse MLA over the indexer's 2048 picks per row
    CompileCase("deepseek-v3.2 sparse mla decode B=1", "mla_sparse_attention",
                functools.partial(mla_sparse_attention_case, 1, 1)),
    CompileCase("deepseek-v3.2 sparse mla decode B=32", "mla_sparse_attention",
                functools.partial(mla_sparse_attention_case, 32, 1)),
    CompileCase("deepseek-v3.2 sparse mla verify n=8 B=32", "mla_sparse_attention",
                functools.partial(mla_sparse_attention_case, 32, 8)),
    # DeepSeek-V3.2 lightning indexer scores at 64k context (top-k stays in XLA)
    CompileCase("deepseek-v3.2 indexer decode B=1 64k", "dsa_indexer", functools.partial(dsa_indexer_case, 1, 1)),
    CompileCase("deepseek-v3.2 indexer verify n=8 B=32 64k", "dsa_indexer",
                functools.partial(dsa_indexer_case, 32, 8)),
    # DeepSeek-V4-Flash: the indexer over 32k CSA entries (a 128k context at rate 4) and in a 2048-token prefill
    # (the 2048 / 4 + 1 entries closing in the chunk under a block mask, a table of 9 pages of 64 entries), the ring
    # pool's compaction (K = V rows of 43 layers, 21 CSA layers' compressor inputs 4*512 + 4*128 wide, 20 HCA
    # layers' 2*512; a ring of 4 pages of 64 per request) and the MTP seed gather of the streams
    CompileCase("deepseek-v4-flash indexer decode B=1 32k entries", "dsa_indexer",
                functools.partial(dsa_indexer_case, 1, 1, 32768, layers=21, mask_width=1)),
    CompileCase("deepseek-v4-flash indexer verify n=8 B=32 32k entries", "dsa_indexer",
                functools.partial(dsa_indexer_case, 32, 8, 32768, layers=21, mask_width=1)),
    CompileCase("deepseek-v4-flash indexer prefill T=2048 B=1 576 entries", "dsa_indexer",
                functools.partial(dsa_indexer_case, 1, 2048, 576, layers=21, mask_width=2048 // 4 + 1)),
    CompileCase("kv_move deepseek-v4-flash ring kv B=32 S=6", "kv_move",
                functools.partial(kv_move_case, 43, (32 * 4 + 1) * 64, ((512,),), 32, 6)),
    CompileCase("kv_move deepseek-v4-flash ring csa inputs B=32 S=6", "kv_move",
                functools.partial(kv_move_case, 21, (32 * 4 + 1) * 64, ((2560,),), 32, 6)),
    CompileCase("kv_move deepseek-v4-flash ring hca inputs B=32 S=6", "kv_move",
                functools.partial(kv_move_case, 20, (32 * 4 + 1) * 64, ((1024,),), 32, 6)),
    CompileCase("gather deepseek-v4-flash mtp streams B=32 n=8", "gather_spec_extras",
                functools.partial(gather_case, 32, 8, 4 * 4096), reads_kv=False),
    # KV move (tree compaction, S = 5 accepted at most) and the fused gather
    CompileCase("kv_move llama3-8b k+v B=32 S=6", "kv_move",
                functools.partial(kv_move_case, 32, 32 * CTX + 16, ((8, 128), (8, 128)), 32, 6)),
    CompileCase("kv_move deepseek-v3 latent+indexer B=32 S=6", "kv_move",
                functools.partial(kv_move_case, 61, 32 * CTX + 16, ((576,), (128,)), 32, 6)),
    CompileCase("gather eagle3 llama3-8b B=32 n=8", "gather_spec_extras",
                functools.partial(gather_case, 32, 8, 4096), reads_kv=False),
    CompileCase("gather tokens only B=32 n=8", "gather_spec_extras",
                functools.partial(gather_case, 32, 8, None), reads_kv=False),
    # RoPE and the K/V write of one layer: decode, tree verify, a prefill chunk; 28 / 4 heads
    CompileCase("rope_write llama3-8b decode B=1", "rope_write", functools.partial(rope_write_case, 1)),
    CompileCase("rope_write llama3-8b verify n=8 B=32", "rope_write", functools.partial(rope_write_case, 256)),
    CompileCase("rope_write llama3-8b prefill 2048", "rope_write", functools.partial(rope_write_case, 2048)),
    CompileCase("rope_write qwen2.5-7b decode B=16 (28/4 heads)", "rope_write",
                functools.partial(rope_write_case, 16, 28, 4, 128, 28)),
    # RMSNorm: Llama-3-8B's width at decode and in a prefill chunk; Qwen2.5-7B's 3584 (padded)
    CompileCase("rms_norm llama3-8b decode B=1", "rms_norm", functools.partial(rms_norm_case, 1)),
    CompileCase("rms_norm llama3-8b prefill 2048", "rms_norm", functools.partial(rms_norm_case, 2048)),
    CompileCase("rms_norm qwen2.5-7b decode B=16 (H=3584)", "rms_norm", functools.partial(rms_norm_case, 16, 3584, 28)),
    CompileCase("rms_norm llama3-8b verify 8 rows, recording EAGLE-3's taps", "rms_norm",
                functools.partial(rms_norm_case, 8, taps=3)),
    CompileCase("rms_norm qwen3.5 centred decode B=1", "rms_norm",
                functools.partial(rms_norm_case, 1, 4096, 8, centred=True)),
    # Sinkhorn: V4-Flash's 4 streams, 20 iterations, at decode B=1 and a verify n=8 B=32
    CompileCase("sinkhorn deepseek-v4-flash decode B=1", "sinkhorn", functools.partial(sinkhorn_case, 1),
                reads_kv=False),
    CompileCase("sinkhorn deepseek-v4-flash verify n=8 B=32", "sinkhorn", functools.partial(sinkhorn_case, 256),
                reads_kv=False),
    # The exact mode's kernels (fixed tiles: the same programs for 1 row as for n)
    CompileCase("exact attention llama3-8b decode B=32 p16", "exact_attention",
                functools.partial(exact_attention_case, _decode(32, **LLAMA))),
    CompileCase("exact attention llama3-8b verify n=8 B=16 p16", "exact_attention",
                functools.partial(exact_attention_case, _verify(16, **LLAMA))),
    CompileCase("fixed matmul llama3-8b q/k/v 1 row", "fixed_matmul", functools.partial(fixed_matmul_case, 1, 4096, 6144),
                reads_kv=False),
    CompileCase("fixed matmul llama3-8b down 16 rows", "fixed_matmul",
                functools.partial(fixed_matmul_case, 16, 14336, 4096), reads_kv=False),
    # Routed experts: DeepSeek-V4-Flash (256 experts of 4096 x 2048, 6 routed) at a verify n=8 B=16
    # (768 assignments, 16-row tiles) and a 2048-token prefill (64-row tiles); Gemma-4-26B-A4B
    # (128 experts of 2816 x 704, 8 routed, GELU-tanh) at a verify n=8 B=4
    CompileCase("grouped matmul v4-flash gate/up verify n=8 B=16", "grouped_matmul",
                functools.partial(grouped_matmul_case, 768, 256, 4096, 2048, 16, True, 10.0)),
    CompileCase("grouped matmul v4-flash down verify n=8 B=16", "grouped_matmul",
                functools.partial(grouped_matmul_case, 768, 256, 2048, 4096, 16, False)),
    CompileCase("grouped matmul v4-flash gate/up prefill 2048", "grouped_matmul",
                functools.partial(grouped_matmul_case, 12288, 256, 4096, 2048, 64, True)),
    CompileCase("grouped matmul gemma4-26b gate/up verify n=8 B=4", "grouped_matmul",
                functools.partial(grouped_matmul_case, 256, 128, 2816, 704, 16, True, activation=gelu_tanh)),
    CompileCase("grouped matmul gemma4-26b down verify n=8 B=4", "grouped_matmul",
                functools.partial(grouped_matmul_case, 256, 128, 704, 2816, 16, False)),
    # Gemma-4-31B-like (report rows)
    _attn("gemma4-31b sliding D=256 decode B=32 p16", _decode(32, **GEMMA_SLIDING), must_pass=False),
    _attn("gemma4-31b sliding D=256 verify n=8 B=16 p16", _verify(16, **GEMMA_SLIDING), must_pass=False),
    _attn("gemma4-31b full D=512 decode B=32 p16", _decode(32, **GEMMA_FULL), must_pass=False),
    _attn("gemma4-31b full D=512 verify n=8 B=16 p16", _verify(16, **GEMMA_FULL), must_pass=False),
]


def problems(case: CompileCase, report) -> list[str]:
    """What is wrong with one compiled kernel of ``case`` (a ``triton_compile.KernelReport``)."""
    if report.error is not None:
        return [f"does not compile: {report.error}"]
    found = []
    if case.spill_free and report.spills:
        found.append(f"spills {report.spill_stores} B stores / {report.spill_loads} B loads per thread")
    if case.reads_kv:
        if not (report.wide_loads or report.wide_copies):
            found.append("no 16-byte vector load or cp.async: KV is read element by element")
        if report.scalar_loads.get(2):
            found.append(f"{report.scalar_loads[2]} scalar 2-byte loads (bf16 elements read one at a time)")
    return found
