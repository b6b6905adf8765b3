"""DeepSeek-V4 attention (HF ``DeepseekV4Attention`` semantics): one shared K = V head over a sliding
window and, in compressed layers, over compressed entries of the whole context.

Per layer, for a query at position p (glossary at the end):

    q_res = RMSNorm(h @ wq_a);  q = RMSNorm_unweighted_per_head(q_res @ wq_b)       # [Hq, D]
    kv    = RMSNorm(h @ wkv)                                                        # [D], K = V
    RoPE (interleaved pairs) on the last R dims of q and kv, at p (main RoPE in sliding layers,
    the compressed layers' own RoPE elsewhere)
    keys  = kv of positions (p - W, p]  +  compressed entries the layer lets p see
    o     = softmax([q . keys * D^-0.5, sink]) . keys    (the sink logit takes weight, not value)
    o     = RoPE^-1(o) at p on its last R dims;  out = concat_g(o_g @ wo_a[g]) @ wo_b

Compressed entries (HF ``DeepseekV4{HCA,CSA}Compressor``). Every token projects compressor inputs
``kv_c = h @ c_wkv`` and ``z = h @ c_wgate``. Entry ``w`` of rate m closes at position (w+1)m - 1:

    HCA: over its m tokens j:      e_w = sum_j softmax_j(z_j + ape_j) * kv_c_j           (per channel)
    CSA: over 2m slots: the first half of the width of window w-1's tokens, the second half of
         window w's (absent before position 0):  width 2m, stride m
    e_w = RoPE(RMSNorm(e_w)) at position w*m

and a query at p sees entry w once (w+1)m <= p + 1. HCA layers attend to every visible entry. CSA
layers run a lightning indexer over the visible entries (its own overlapping compressor at width Di
gives one key per entry; ``score = sum_h w_h relu(q_h . k)``) and attend to the ``index_topk`` best;
exact score ties keep the lower entry (as ``lax.top_k`` orders them; torch's ``topk`` leaves their
order to its algorithm).

Where things live (``jaxspec.kvcache.compressed``): kv rows and compressor inputs in the ring pool,
entries in one pool per rate. A forward runs in one of two modes:

* committing (a prefill or a draft extend: causal rows of real tokens): the entries its tokens close
  are computed once per closed window and written at their index, then read like any entry;
* speculative (a verify, a draft step, a decode step: rows may be rejected): nothing is written to the
  entry pools. Each row computes the entries closed on its own path since the committed prefix (at
  most ``ceil(depth / m)``) from the compressor inputs of its path (committed positions, then its
  ancestors' rows, all in the ring); a verify returns, per node, the entry it closes and where it
  goes, and ``commit`` writes those of the accepted path.

Glossary: B rows, T query rows, Wb block columns, Hq heads, D head width, R RoPE width, W window,
m rate, K path length (m for HCA, 2m for CSA), E committed entries (prefix // m), C entries a row
closes past the prefix, Ke entries its page table covers, Hi / Di indexer heads / width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.kvcache.compressed import CompressedPool, EntryPart, RingPart, compressed_write_targets
from jaxspec.kvcache.layout import draft_scratch_steps
from jaxspec.kvcache.paging import AttentionInputs, positions_to_slots, scratch_dropped
from jaxspec.model.config import RopeConfig
from jaxspec.model.targets.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from jaxspec.pallas.dsa_indexer import index_scores
from jaxspec.pallas.paged_attention import table_slots

_HI = jax.lax.Precision.HIGHEST


# ------------------------------------------------------------------------------------ pieces


def norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """HF V4's RMSNorm: normalized in f32, times the (f32) weight in f32, cast back once."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf if weight is None else xf * weight.astype(jnp.float32)).astype(x.dtype)


def rope_tail(x: jax.Array, positions: jax.Array, rope: RopeConfig, rope_dim: int, *, inverse: bool = False
              ) -> jax.Array:  # x [B, T, h, Dx], positions i32[B, T] -> [B, T, h, Dx]
    """Interleaved RoPE (pairs (x0, x1), (x2, x3), ...) on the last ``rope_dim`` dims; ``inverse``
    rotates back (the attention output). cos / sin are rounded to ``x.dtype`` and the rotation runs
    in f32, as HF does."""
    inv_freq = jnp.asarray(rope.inv_freq(rope_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, R/2]
    cos = (jnp.cos(freqs) * rope.cos_sin_scale).astype(x.dtype).astype(jnp.float32)[:, :, None, :]
    sin = (jnp.sin(freqs) * rope.cos_sin_scale).astype(x.dtype).astype(jnp.float32)[:, :, None, :]
    if inverse:
        sin = -sin
    tail = x[..., -rope_dim:].astype(jnp.float32)
    even, odd = tail[..., 0::2], tail[..., 1::2]
    rot = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(tail.shape)
    return jnp.concatenate([x[..., :-rope_dim], rot.astype(x.dtype)], axis=-1)


def compress_window(kv: jax.Array, gate: jax.Array, valid: jax.Array, ape: jax.Array, norm_w: jax.Array,
                    start: jax.Array, cfg: DeepseekV4Config, *, overlap: bool) -> jax.Array:
    """Entries of windows given their tokens' compressor inputs along their path.

    kv, gate: [..., K, Wc] (positions ascending, the window's last token last; Wc = 2 * Dc with
    ``overlap`` (CSA), else Dc); valid: bool[..., K] (False before position 0); ape f32[m, Wc];
    start: i32[...] the window's first position (its RoPE position). Returns [..., Dc]."""
    m = ape.shape[0]
    if overlap:  # first half of the width from the previous window, second half from this one
        Dc = kv.shape[-1] // 2
        kv = jnp.concatenate([kv[..., :m, :Dc], kv[..., m:, Dc:]], axis=-2)
        z = jnp.concatenate([gate[..., :m, :Dc] + ape[:, :Dc], gate[..., m:, Dc:] + ape[:, Dc:]], axis=-2)
    else:
        z = gate + ape
    z = jnp.where(valid[..., None], z.astype(jnp.float32), -jnp.inf)
    kv = jnp.where(valid[..., None], kv, 0)
    weights = jax.nn.softmax(z, axis=-2).astype(kv.dtype)  # per channel, over the window's slots
    e = norm(jnp.sum(kv * weights, axis=-2), norm_w, cfg.rms_norm_eps)  # [..., Dc]
    lead = e.shape[:-1]
    flat = e.reshape((lead[0], -1, 1, e.shape[-1]))
    out = rope_tail(flat, start.reshape(lead[0], -1), cfg.compress_rope, cfg.rope_dim)
    return out.reshape(e.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Closing:
    """What a verify leaves for the commit, per node, for one layer: the entry it closes
    (``kv [B, T, D]``, ``index_k [B, T, Di]``: zeros where the layer has no indexer) and the entry-pool
    slot it goes to if the node is accepted (``slots i32[B, T]``, -1 when it closes no window, and in
    a sliding layer)."""

    kv: jax.Array
    index_k: jax.Array
    slots: jax.Array

    @classmethod
    def none(cls, B: int, T: int, cfg: DeepseekV4Config, dtype) -> "Closing":
        return cls(kv=jnp.zeros((B, T, cfg.head_dim), dtype), index_k=jnp.zeros((B, T, cfg.index_head_dim), dtype),
                   slots=jnp.full((B, T), -1, jnp.int32))


# ------------------------------------------------------------------------------------ paths


def block_columns(attn: AttentionInputs, positions: jax.Array, T: int):
    """(logical position i32[B, Wb], write position i32[B, Wb]) of the block columns of a masked
    forward: a verify's nodes (its rows, at prefix + node), or the draft-scratch columns of a draft
    step (column c written at prefix + c holds step i at logical position prefix + i, i from the one
    layout helper ``jaxspec.kvcache.layout.draft_scratch_steps``: ``c = j * S + i`` for branch j)."""
    Wb = attn.block_mask.shape[-1]
    col = jnp.arange(Wb, dtype=jnp.int32)[None, :]
    write = attn.prefix_lens[:, None] + col
    if attn.pending:  # verify: the columns are the rows
        return positions, write
    S = Wb // T  # draft steps: T branches x S steps; which step each column holds is the layout helper's
    return attn.prefix_lens[:, None] + draft_scratch_steps(T, S)[None, :], write


def path_write_positions(attn: AttentionInputs, positions: jax.Array, want: jax.Array) -> jax.Array:
    """Where the tokens on each row's path at logical positions ``want`` i32[B, T, ...] were written
    (-1 before position 0): committed positions (< prefix) and causal blocks at their own position,
    a masked block's at the write position of the visible column holding that logical position."""
    if attn.block_mask is None:
        return jnp.where(want >= 0, want, -1)
    B, T = positions.shape
    logical, write = block_columns(attn, positions, T)  # [B, Wb]
    flat = want.reshape(B, T, -1)  # [B, T, n]
    hit = attn.block_mask[:, :, None, :] & (logical[:, None, None, :] == flat[..., None])  # [B, T, n, Wb]
    col = jnp.argmax(hit, axis=-1)
    from_block = jnp.take_along_axis(jnp.broadcast_to(write[:, None, None, :], hit.shape), col[..., None], -1)[..., 0]
    prefix = attn.prefix_lens[:, None, None]
    out = jnp.where(flat < prefix, flat, jnp.where(jnp.any(hit, axis=-1), from_block, -1))
    return jnp.where(flat >= 0, out, -1).reshape(want.shape)


def prefix_ring(attn: AttentionInputs):
    """Where a forward reads ring positions before its prefix: a prefill after a cached prefix reads
    the cached window pages through its read table (``jaxspec.engine.window``), anything else the ring."""
    return attn.window if attn.window_read is None else attn.window_read


def _inputs_along(buf: jax.Array, ring_slots, layer, own: jax.Array | None, own_rows: jax.Array | None
                  ) -> jax.Array:
    """Compressor inputs at ring slots, or (where ``own_rows >= 0``) from this forward's own rows."""
    x = buf[layer, ring_slots]
    if own is None:
        return x
    B = own.shape[0]
    rows = jnp.clip(own_rows, 0, own.shape[1] - 1).reshape(B, -1)
    mine = jnp.take_along_axis(own, rows[..., None], axis=1).reshape(x.shape)
    return jnp.where((own_rows >= 0)[..., None], mine.astype(x.dtype), x)


# ------------------------------------------------------------------------------------ attention


def _indexer_query(cp: dict, cfg: DeepseekV4Config, h, q_res, positions):
    """Indexer queries [B, T, Hi, Di] (compressed RoPE on their last R dims) and f32 head weights
    [B, T, Hi] carrying both of HF's scales (``Hi^-0.5`` and ``Di^-0.5``, which moves through the ReLU)."""
    B, T, _ = h.shape
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    iq = rope_tail((q_res @ cp["i_wq_b"]).reshape(B, T, Hi, Di), positions, cfg.compress_rope, cfg.rope_dim)
    w = jnp.dot(h.astype(jnp.float32), cp["i_w_proj"].astype(jnp.float32), precision=_HI)
    return iq, w * (Hi ** -0.5 * Di ** -0.5)


def _split_inputs(x: jax.Array, cfg: DeepseekV4Config, kind: str):
    """A token's compressor inputs -> (kv, gate) of the main compressor, (kv, gate) of the indexer's."""
    D, Di = cfg.head_dim, cfg.index_head_dim
    if kind == HCA:
        return (x[..., :D], x[..., D:2 * D]), None
    return (x[..., :2 * D], x[..., 2 * D:4 * D]), (x[..., 4 * D:4 * D + 2 * Di], x[..., 4 * D + 2 * Di:])


def _entries_of(inputs, valid, starts, cp, cfg, kind):
    """(entry [..., D], indexer key [..., Di] | None) of windows from their path inputs [..., K, P]."""
    (kv, gate), idx = _split_inputs(inputs, cfg, kind)
    e = compress_window(kv, gate, valid, cp["c_ape"], cp["c_norm"], starts, cfg, overlap=kind == CSA)
    ik = None if idx is None else compress_window(idx[0], idx[1], valid, cp["i_ape"], cp["i_norm"], starts, cfg,
                                                  overlap=True)
    return e, ik


def v4_attention_core(
    sinks: jax.Array,  # [Hq] the layer's attention sinks
    cp: dict | None,  # its compressor (and indexer) params, None in a sliding layer
    cfg: DeepseekV4Config,
    kind: str,
    h: jax.Array,  # [B, T, H] (after the attention norm)
    projected: Projected,  # ``v4_projections`` of h
    positions: jax.Array,  # i32[B, T] logical (RoPE) positions
    pool: CompressedPool,
    layer: jax.Array,  # i32[] the layer's row in the ring kv buffer
    kind_index: jax.Array,  # i32[] its row among its kind's layers
    attn: AttentionInputs,
    *,
    implementation=None,
) -> tuple[jax.Array, CompressedPool, Closing | None]:  # o [B, T, Hq, D] (RoPE undone), pool, closing
    """One layer's attention between its products (``v4_projections`` before, ``v4_output_projection``
    after; module docstring): RoPE of the layer's kind on ``projected``; its rows' K = V rows and
    compressor inputs go into the ring (at the write targets ``compressed_write_targets`` gives), the
    entries a committing forward closes into the entry pool; then one softmax over the window, the
    compressed entries it sees and the sink."""
    B, T, _ = h.shape
    D, W = cfg.head_dim, cfg.sliding_window
    rope = cfg.rope_of(kind)
    ring_table = attn.window
    ring = pool.window
    P = ring.page_size

    q, q_res = rope_tail(projected.q, positions, rope, cfg.rope_dim), projected.q_res
    kv = rope_kv(projected.kv, positions, rope, cfg)

    m = cfg.rate(kind) if kind != SLIDING else 1
    wslots, (closes,) = compressed_write_targets(ring_table, attn.write_positions, positions, (m,), P)
    wslots = wslots.reshape(B * T)
    # A prefill's checkpoint pages for the prefix cache (``jaxspec.engine.window``): written there too.
    targets = [wslots] + ([attn.window_keep.slots(attn.write_positions, P).reshape(B * T)]
                          if attn.window_keep is not None else [])
    targets = [scratch_dropped(t, P, ring.num_slots) for t in targets]  # scratch writes skipped (mode="drop")
    for slots in targets:
        ring = dataclasses.replace(ring, kv=ring.kv.at[layer, slots].set(kv.reshape(B * T, D).astype(ring.kv.dtype),
                                                                         mode="drop"))
    inputs = None
    if kind != SLIDING:
        parts = [h @ cp["c_wkv"], h @ cp["c_wgate"]] + ([h @ cp["i_wkv"], h @ cp["i_wgate"]] if kind == CSA else [])
        inputs = jnp.concatenate(parts, axis=-1)  # [B, T, P_in]
        name = "csa_in" if kind == CSA else "hca_in"
        for slots in targets:
            buf = getattr(ring, name)
            ring = dataclasses.replace(ring, **{name: buf.at[kind_index, slots].set(
                inputs.reshape(B * T, -1).astype(buf.dtype), mode="drop")})

    # ---- window keys: the W - 1 positions before the prefix, then the block
    pre_pos = attn.prefix_lens[:, None] - (W - 1) + jnp.arange(W - 1, dtype=jnp.int32)[None, :]  # [B, W-1]
    k_pre = ring.kv[layer, prefix_ring(attn).slots(pre_pos, P)]  # [B, W-1, D]
    ok_pre = (pre_pos >= 0)[:, None, :] & (pre_pos[:, None, :] > positions[:, :, None] - W)  # [B, T, W-1]
    if attn.block_mask is None:
        k_blk = kv.astype(ring.kv.dtype)
        rows = jnp.arange(T, dtype=jnp.int32)
        dist = rows[:, None] - rows[None, :]
        ok_blk = jnp.broadcast_to((dist >= 0) & (dist < W), (B, T, T))
    else:
        Wb = attn.block_mask.shape[-1]
        blk_pos = attn.prefix_lens[:, None] + jnp.arange(Wb, dtype=jnp.int32)[None, :]
        k_blk = ring.kv[layer, ring_table.slots(blk_pos, P)]
        ok_blk = attn.block_mask
    keys = [(k_pre[:, None], ok_pre), (k_blk[:, None], ok_blk)]  # keys shared by a request's rows: [B, 1, K, D]

    closing = Closing.none(B, T, cfg, h.dtype) if attn.pending else None
    entries = pool.entries
    if kind != SLIDING:
        keys_c, entries, closing = _compressed_keys(cp, cfg, kind, h, q_res, positions, inputs, ring, pool,
                                                    kind_index, attn, closes, implementation)
        keys += keys_c
    pool = dataclasses.replace(pool, window=ring, entries=entries)

    o = sink_attention(q, keys, sinks, cfg.sm_scale)
    return rope_tail(o.astype(h.dtype), positions, rope, cfg.rope_dim, inverse=True), pool, closing


def sink_attention(q: jax.Array, keys, sinks: jax.Array, sm_scale: float) -> jax.Array:
    """One softmax over every key set and the per-head sink (HF's eager attention with ``s_aux``);
    K = V, so the keys are the values. q [B, T, Hq, D]; ``keys``: pairs (k [B, 1 | T, K, D]: one set
    per request or per row, ok bool[B, T, K]) -> f32[B, T, Hq, D]."""
    B, T, Hq, D = q.shape
    qf = q.astype(jnp.float32)
    logits = []
    for k, ok in keys:
        spec = "bthd,bkd->bthk" if k.shape[1] == 1 else "bthd,btkd->bthk"
        kf = k[:, 0] if k.shape[1] == 1 else k
        s = jnp.einsum(spec, qf, kf.astype(jnp.float32), precision=_HI) * sm_scale
        logits.append(jnp.where(ok[:, :, None, :], s, -jnp.inf))
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, None, :, None], (B, T, Hq, 1))
    probs = jax.nn.softmax(jnp.concatenate(logits + [sink], axis=-1), axis=-1)
    o = jnp.zeros((B, T, Hq, D), jnp.float32)
    at = 0
    for k, _ in keys:
        n = k.shape[2]
        spec = "bthk,bkd->bthd" if k.shape[1] == 1 else "bthk,btkd->bthd"
        kf = k[:, 0] if k.shape[1] == 1 else k
        o = o + jnp.einsum(spec, probs[..., at:at + n], kf.astype(jnp.float32), precision=_HI)
        at += n
    return o


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Projected:
    """A layer's attention inputs before RoPE (which depends on the layer's kind): q [B, T, Hq, D]
    per-head normed, its low-rank residual q_res [B, T, Rq] (which the indexer reads), and the one
    K = V row of each position kv [B, T, D], normed."""

    q: jax.Array
    q_res: jax.Array
    kv: jax.Array


def v4_projections(lp: dict, cfg: DeepseekV4Config, h: jax.Array) -> Projected:
    """The products of ``h [B, T, H]`` every attention kind shares (``run_layers`` computes them
    outside its switch over the kinds, where each reads its layer's weights in place)."""
    B, T, _ = h.shape
    q_res = norm(h @ lp["wq_a"], lp["q_norm"], cfg.rms_norm_eps)  # [B, T, Rq]
    q = norm((q_res @ lp["wq_b"]).reshape(B, T, cfg.num_heads, cfg.head_dim), None, cfg.rms_norm_eps)
    return Projected(q=q, q_res=q_res, kv=norm(h @ lp["wkv"], lp["kv_norm"], cfg.rms_norm_eps))


def v4_query(lp: dict, cfg: DeepseekV4Config, h: jax.Array, positions: jax.Array, rope: RopeConfig):
    """Queries of ``h [B, T, H]``: (q [B, T, Hq, D] per-head normed, RoPE on the tail; the low-rank
    residual q_res [B, T, Rq], which the indexer reads). The unused kv product is traced and dropped."""
    projected = v4_projections(lp, cfg, h)
    return rope_tail(projected.q, positions, rope, cfg.rope_dim), projected.q_res


def v4_kv(lp: dict, cfg: DeepseekV4Config, h: jax.Array, positions: jax.Array, rope: RopeConfig) -> jax.Array:
    """The one K = V row of each position of ``h [B, T, H]`` -> [B, T, D] (RoPE on the tail)."""
    return rope_kv(v4_projections(lp, cfg, h).kv, positions, rope, cfg)


def rope_kv(kv: jax.Array, positions: jax.Array, rope: RopeConfig, cfg: DeepseekV4Config) -> jax.Array:
    return rope_tail(kv[:, :, None], positions, rope, cfg.rope_dim)[:, :, 0]  # [B, T, D] -> [B, T, D]


def v4_output_projection(lp: dict, cfg: DeepseekV4Config, o: jax.Array) -> jax.Array:
    """``o [B, T, Hq, D]`` (its RoPE undone) through the grouped low-rank output projection -> [B, T, H]."""
    B, T, Hq, D = o.shape
    G = cfg.o_groups
    o = o.reshape(B, T, G, Hq * D // G)
    wo_a = lp["wo_a"].reshape(Hq * D // G, G, cfg.o_lora_rank)
    o = jnp.einsum("btgi,igr->btgr", o, wo_a).reshape(B, T, G * cfg.o_lora_rank)
    return o @ lp["wo_b"]


def v4_attention_output(lp: dict, cfg: DeepseekV4Config, o: jax.Array, positions: jax.Array, rope: RopeConfig
                        ) -> jax.Array:
    """``o [B, T, Hq, D]`` (the values are the keys, so their RoPE is undone at the query's position)
    through the grouped low-rank output projection -> [B, T, H]."""
    return v4_output_projection(lp, cfg, rope_tail(o, positions, rope, cfg.rope_dim, inverse=True))


def _compressed_keys(cp, cfg: DeepseekV4Config, kind: str, h, q_res, positions, inputs, ring: RingPart,
                     pool: CompressedPool, kind_index, attn: AttentionInputs, closes: jax.Array, implementation):
    """The compressed key sets of one layer ([(keys, visibility)]), the entry pools (written in a
    committing forward) and, for a verify, the entries its nodes close."""
    B, T = positions.shape
    m = cfg.rate(kind)
    K = 2 * m if kind == CSA else m
    rate_index = cfg.entry_table_index(kind)
    table = attn.compressed[rate_index]  # i32[B, We]
    part: EntryPart = pool.entries[rate_index]
    P = part.page_size
    buf = ring.csa_in if kind == CSA else ring.hca_in
    E = attn.prefix_lens // m  # [B] committed entries
    offs = jnp.arange(K, dtype=jnp.int32) - (K - 1)  # path offsets before a window's last token
    committing = attn.block_mask is None and not attn.pending
    closing = None

    if committing:
        # One entry per window closed in this chunk (window E + j closes at (E + j + 1) m - 1).
        Wn = T // m + 1
        w = E[:, None] + jnp.arange(Wn, dtype=jnp.int32)[None, :]  # [B, Wn]
        last = (w + 1) * m - 1
        row = last - attn.prefix_lens[:, None]
        real = (row < T) & (jnp.take_along_axis(attn.write_positions, jnp.clip(row, 0, T - 1), axis=1) >= 0)
        path = last[..., None] + offs  # [B, Wn, K] positions (< prefix: in the ring; else this chunk's rows)
        own_rows = jnp.where(path >= attn.prefix_lens[:, None, None], path - attn.prefix_lens[:, None, None], -1)
        x = _inputs_along(buf, prefix_ring(attn).slots(path, ring.page_size), kind_index, inputs, own_rows)
        e, ik = _entries_of(x, path >= 0, w * m, cp, cfg, kind)  # [B, Wn, D], [B, Wn, Di]
        slots = positions_to_slots(table, jnp.where(real, w, -1), P)
        slots = jnp.where(real, slots, -1).reshape(-1)
        part = part.write(kind_index, slots, e.reshape(B * Wn, -1), None if ik is None else ik.reshape(B * Wn, -1))
        # Entry E + j is visible to a row at p once (E + j + 1) m <= p + 1.
        visible_blk = (w[:, None, :] + 1) * m <= positions[:, :, None] + 1  # [B, T, Wn]
        blk_kv = blk_ik = None
        blk_ok = None
    else:
        # Each row: the entries closed on its own path past the prefix (at most C).
        if attn.block_mask is None:
            depth = T
        else:
            depth = attn.block_mask.shape[-1] if attn.pending else attn.block_mask.shape[-1] // T
        C = (depth - 1) // m + 1
        w = E[:, None, None] + jnp.arange(C, dtype=jnp.int32)[None, None, :]  # [B, 1, C]
        last = (w + 1) * m - 1
        blk_ok = (last <= positions[:, :, None]) & (attn.write_positions >= 0)[:, :, None]  # [B, T, C]
        path = jnp.broadcast_to(last[..., None] + offs, (B, T, C, K))
        written = path_write_positions(attn, positions, path)  # [B, T, C, K]
        x = buf[kind_index, attn.window.slots(written.reshape(B, -1), ring.page_size)].reshape(B, T, C, K, -1)
        blk_kv, blk_ik = _entries_of(x, path >= 0, jnp.broadcast_to(w * m, (B, T, C)), cp, cfg, kind)
        visible_blk = None
        if attn.pending:  # a verify: the entry each node closes, and where the commit puts it
            k_self = jnp.clip(closes - E[:, None], 0, C - 1)  # [B, T] the row's own closing among its C
            pick = lambda x: jnp.take_along_axis(x, k_self[:, :, None, None], 2)[:, :, 0]  # noqa: E731
            index_k = pick(blk_ik) if blk_ik is not None else jnp.zeros((B, T, cfg.index_head_dim), blk_kv.dtype)
            closing = Closing(kv=pick(blk_kv), index_k=index_k,
                              slots=jnp.where(closes >= 0, positions_to_slots(table, closes, P), -1))
    pool_entries = tuple(part if i == rate_index else e for i, e in enumerate(pool.entries))

    # Entries in the pool: committed ones (< E) for every row, plus (committing) this chunk's.
    all_slots = table_slots(table, P)  # [B, Ke]
    Ke = all_slots.shape[1]
    idx = jnp.arange(Ke, dtype=jnp.int32)[None, None, :]
    pool_ok = idx < E[:, None, None]
    if committing:
        pool_ok = pool_ok | ((idx >= E[:, None, None]) & ((idx + 1) * m <= positions[:, :, None] + 1))
    pool_ok = jnp.broadcast_to(pool_ok, (B, T, Ke))
    if kind == HCA:
        keys = [(part.kv[kind_index, all_slots][:, None], pool_ok)]
        if blk_kv is not None:
            keys.append((blk_kv, blk_ok))
        return keys, pool_entries, closing

    # CSA: the indexer picks index_topk of the visible entries (pool ones, then the row's own).
    iq, iw = _indexer_query(cp, cfg, h, q_res, positions)
    if committing:
        block_mask = jnp.broadcast_to(visible_blk, (B, T, visible_blk.shape[-1]))
    else:
        block_mask = jnp.zeros((B, T, 1), bool)
    scores = index_scores(iq, iw, part.index_k, kind_index, table, E, block_mask, page_size=P,
                          implementation=implementation)  # f32[B, T, Ke], -inf where invisible
    scores = jnp.where(pool_ok, scores, -jnp.inf)
    if blk_kv is not None:
        s = jnp.einsum("bthd,btcd->bthc", iq.astype(jnp.float32), blk_ik.astype(jnp.float32), precision=_HI)
        s_blk = jnp.einsum("bthc,bth->btc", jax.nn.relu(s), iw, precision=_HI)
        scores = jnp.concatenate([scores, jnp.where(blk_ok, s_blk, -jnp.inf)], axis=-1)
    k = min(cfg.index_topk, scores.shape[-1])
    best, pick = jax.lax.top_k(scores, k)  # [B, T, k]; ties: the lower entry first
    sel = jnp.take_along_axis(jnp.broadcast_to(all_slots[:, None, :], (B, T, Ke)), jnp.clip(pick, 0, Ke - 1), 2)
    chosen = part.kv[kind_index, sel]  # [B, T, k, D]
    if blk_kv is not None:
        mine = jnp.take_along_axis(blk_kv, jnp.clip(pick - Ke, 0, blk_kv.shape[2] - 1)[..., None], 2)
        chosen = jnp.where((pick >= Ke)[..., None], mine.astype(chosen.dtype), chosen)
    return [(chosen, best > -jnp.inf)], pool_entries, closing
