"""Qwen3-Next / Qwen3.5 decoder (hybrid: Gated DeltaNet linear attention and gated full attention)
as pure functions.

Layers repeat with a period (e.g. three linear-attention layers then one full-attention layer); the
params of period position ``j`` are stacked over the periods (``p{j}/...``, ``jaxspec.model.checkpoints.hybrid``)
and the forward scans over periods, so one compiled period body serves any depth. Linear weights
``[in, out]``; every RMSNorm is zero-centred (``1 + w``) except the Gated DeltaNet output norm.

    embed [V, H]; norm [H]; lm_head [H, V] (absent when tied)
    p{j}/attn_norm [N, H]; mlp_norm [N, H]
      full attention:   wqkv [N, H, Hq*2*D + 2*Hkv*D]: q_proj ([query | gate] per head), k_proj and v_proj
                        joined (``jaxspec.model.fused``); wo [N, Hq*D, H]; q_norm, k_norm [N, D]
      linear attention: in_qkv [N, H, C] (per key head [q | k | v]); in_z [N, H, Hv*Dv]; in_b, in_a [N, H, Hv]
                        (Qwen3.5: the three joined as in_zba [N, H, Hv*Dv + 2*Hv]);
                        conv_w [N, C, K]; dt_bias, A_log [N, Hv] (f32); gdn_norm [N, Dv]; wo [N, Hv*Dv, H]
      dense MLP:        w_gate_up [N, H, 2I] (joined); w_down [N, I, H]
      MoE:              router [N, H, E]; experts_gate, experts_up [N, E, H, Im]; experts_down [N, E, Im, H];
                        shared_gate_up [N, H, 2Is]; shared_down [N, Is, H]; shared_expert_gate [N, H, 1]

The recurrent state of the linear-attention layers lives in the ``HybridPool``'s state part, one per
request (``jaxspec.kvcache.recurrent``); a verify forward returns it pending (``PendingState``) and
``commit_accepted`` writes the accepted path's end state.

Glossary: B rows, T tokens per row, H hidden, Hq / Hkv attention heads, D head width, Hk / Hv key /
value heads of a linear layer, Dk / Dv their widths, r = Hv / Hk, C = Hk * (2 Dk + r Dv) conv
channels, K conv kernel, N periods, Ll linear-attention layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.kvcache.layout import draft_scratch_steps
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import KVPool
from jaxspec.kvcache.recurrent import HybridPool, RecurrentPool
from jaxspec.model.gated_delta import (conv_chain, conv_state_after, conv_tree, delta_block, delta_chain, delta_rows,
                                       l2norm, state_at)
from jaxspec.model.fused import split_columns
from jaxspec.model.layers import (apply_rope, embed_lookup, gated_mlp, routed_experts, stacked_rms_norm,
                                  with_routed_experts, without_routed_experts, write_and_attend)
from jaxspec.model.layers import centred_rms_norm as norm  # zero-centred RMSNorm, HF's Qwen3-Next arithmetic
from jaxspec.model.targets.base import AuxTaps, ForwardOutput
from jaxspec.model.targets.hybrid_config import FULL, LINEAR, HybridConfig

PREFILL_CHUNK = 64  # tokens per chunk of the chunked gated delta rule in a prefill


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingState:
    """What a verify forward leaves for ``commit_accepted``, per linear-attention layer and node:
    k f32[Ll, B, T, Hk, Dk], u f32[Ll, B, T, Hv, Dv], G f32[Ll, B, T, Hv] (``gated_delta``), and
    conv_in f32[Ll, B, T, C] the conv inputs (the model dtype's values)."""

    k: jax.Array
    u: jax.Array
    G: jax.Array
    conv_in: jax.Array


def create_hybrid_pool(cfg: HybridConfig, *, num_pages: int, page_size: int, dtype, rows: int = 1,
                       snapshot_rows: int = 0) -> HybridPool:
    """The paged KV pool of the full-attention layers, ``rows`` recurrent states and, for the prefix
    cache, ``snapshot_rows`` snapshot slots (0: none)."""
    g = cfg.gdn
    states = lambda n: RecurrentPool.create(  # noqa: E731
        num_layers=cfg.num_linear_layers, rows=n, num_v_heads=g.num_v_heads, head_k_dim=g.head_k_dim,
        head_v_dim=g.head_v_dim, conv_channels=g.conv_dim, conv_kernel=g.conv_kernel, dtype=dtype)
    return HybridPool(
        kv=KVPool.create(num_layers=cfg.num_full_layers, num_pages=num_pages, page_size=page_size,
                         num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype),
        state=states(rows), snapshots=states(snapshot_rows) if snapshot_rows else None,
    )


def gated_norm(x: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """The Gated DeltaNet output norm: plain-weight RMSNorm (cast back first, as HF), times silu(z)."""
    xf = x.astype(jnp.float32)
    h = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return (w * h).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))


def partial_rope(x: jax.Array, positions: jax.Array, cfg: HybridConfig) -> jax.Array:  # [B, T, h, D]
    """RoPE (rotate-half) on the first ``rotary_dim`` dims of each head; the rest pass through."""
    r = cfg.rotary_dim
    rotated = apply_rope(x[..., :r], positions, cfg.rope.inv_freq(r), cfg.rope.cos_sin_scale)
    return jnp.concatenate([rotated, x[..., r:]], axis=-1)


def full_attention(lp: dict, cfg: HybridConfig, h: jax.Array, positions, kv: KVPool, layer, attn: AttentionInputs,
                   implementation) -> tuple[jax.Array, KVPool]:  # h [B, T, H] normed -> [B, T, H]
    """Gated attention over the paged KV pool: the output is scaled by sigmoid(gate) per channel."""
    B, T, _ = h.shape
    D = cfg.head_dim
    kvs = cfg.num_kv_heads * D
    qg, k, v = split_columns(h @ lp["wqkv"], (cfg.num_heads * 2 * D, kvs, kvs), cfg.tensor_parallel)
    qg = qg.reshape(B, T, -1, 2 * D)
    q, gate = qg[..., :D], qg[..., D:]
    q = partial_rope(norm(q, lp["q_norm"], cfg.rms_norm_eps), positions, cfg)
    k = partial_rope(norm(k.reshape(B, T, -1, D), lp["k_norm"], cfg.rms_norm_eps), positions, cfg)
    v = v.reshape(B, T, -1, D)
    o, kv = write_and_attend(q, k, v, kv, layer, attn, implementation=implementation,
                             tensor_parallel=cfg.tensor_parallel)
    o = o.reshape(B, T, -1) * jax.nn.sigmoid(gate.reshape(B, T, -1).astype(jnp.float32)).astype(o.dtype)
    return o @ lp["wo"], kv


def linear_attention(lp: dict, cfg: HybridConfig, h: jax.Array, state: RecurrentPool, scratch, layer,
                     attn: AttentionInputs, snapshots: RecurrentPool | None = None):
    """Gated DeltaNet over T tokens per row; returns (out [B, T, H], state, scratch, pending or None,
    snapshots).

    Three uses: a prefill or draft extend (``attn.pending`` False, no block mask: a causal chain,
    chunked) writes each row's state after its last valid token (with the prefix cache's
    ``snapshots`` and the prefill's ``attn.snapshots`` table, a row with a cached prefix starts from
    its restored slot, and the states after the table's marks are saved into theirs); a verify
    (``attn.pending``) returns every node's pending quantities and writes nothing; a draft step over
    the draft-scratch region (a block mask wider than T: a hybrid standalone draft's frontier) reads
    its ancestors from ``scratch`` and writes its own there."""
    g = cfg.gdn
    B, T, _ = h.shape
    Hk, Dk, Dv, r, K = g.num_k_heads, g.head_k_dim, g.head_v_dim, g.group, g.conv_kernel
    rows = jnp.arange(B, dtype=jnp.int32) if attn.state_rows is None else attn.state_rows
    Bs = state.ssm.shape[1]
    fresh = attn.prefix_lens == 0  # a request's first tokens start from a zero state
    table = attn.snapshots if snapshots is not None else None
    # A prefill with the prefix cache: a cached prefix's state comes from its snapshot slot.
    source, take = (state, jnp.minimum(rows, Bs - 1)) if table is None else (snapshots, table.restore)
    s0 = jnp.where(fresh[:, None, None, None], 0.0, source.ssm[layer, take])  # f32[B, Hv, Dk, Dv]
    conv0 = jnp.where(fresh[:, None, None], 0, source.conv[layer, take])  # [B, C, K-1]
    valid = attn.write_positions >= 0  # [B, T] (padding: no effect on the state)

    mixed = h @ lp["in_qkv"]  # [B, T, C]
    if "in_zba" in lp:  # Qwen3.5: z, b and a joined at load (``jaxspec.model.fused``)
        z, b, a = split_columns(h @ lp["in_zba"], (g.value_dim, g.num_v_heads, g.num_v_heads), cfg.tensor_parallel)
    else:  # Qwen3-Next: z comes out of its in_proj_qkvz tensor, b and a out of in_proj_ba
        z, b, a = h @ lp["in_z"], h @ lp["in_b"], h @ lp["in_a"]
    z = z.reshape(B, T, -1, Dv)  # b, a [B, T, Hv]
    drafting = attn.block_mask is not None and not attn.pending  # a draft step over the scratch region
    path = None if drafting else attn.block_mask
    if drafting:
        W = attn.block_mask.shape[-1]
        col = attn.write_positions - attn.prefix_lens[:, None]  # [B, T] each row's own scratch column (< 0: none)
        S = W // T  # steps: T branches x S steps
        level = draft_scratch_steps(T, S)  # [W] the step each scratch column holds (the layout helper's)
        step = level[jnp.clip(col, 0, W - 1)]  # [B, T] each row's own step
        cols = jnp.arange(W, dtype=jnp.int32)
        ancestors = attn.block_mask & (cols[None, None, :] != col[..., None])  # [B, T, W]
        at_step = lambda d: ancestors & (level[None, None, :] == (step - d)[..., None])  # noqa: E731
        conv = conv_from_scratch(mixed, conv0, lp["conv_w"], scratch.conv_in[layer], at_step, step)
    elif path is None:
        conv = conv_chain(mixed, conv0, lp["conv_w"])
    else:
        conv = conv_tree(mixed, conv0, lp["conv_w"], path)
    conv = jax.nn.silu(conv).astype(h.dtype).reshape(B, T, -1, 2 * Dk + r * Dv)
    q = l2norm(conv[..., :Dk]) * Dk**-0.5  # f32[B, T, Hk, Dk]
    k = l2norm(conv[..., Dk:2 * Dk])
    v = conv[..., 2 * Dk:].reshape(B, T, -1, Dv).astype(jnp.float32)  # [B, T, Hv, Dv]
    beta = jnp.where(valid[..., None], jax.nn.sigmoid(b.astype(jnp.float32)), 0.0)
    decay = -jnp.exp(lp["A_log"]) * jax.nn.softplus(a.astype(jnp.float32) + lp["dt_bias"])
    decay = jnp.where(valid[..., None], decay, 0.0)
    q_rep, k_rep = (jnp.repeat(x, r, axis=2) for x in (q, k))  # value head h reads key head h // r

    pending = None
    if drafting:
        parent = at_step(1)  # [B, T, W]: the ancestor one step up (none at step 0)
        G_parent = jnp.einsum("btw,bwh->bth", parent.astype(jnp.float32), scratch.G[layer])
        ks = jnp.repeat(scratch.k[layer], r, axis=2)
        o, u, G = delta_rows(q_rep, k_rep, v, decay, beta, s0, ks, scratch.u[layer], scratch.G[layer], ancestors,
                             G_parent)
        where = jnp.where(col >= 0, col, W)  # [B, T]; inactive rows write nothing
        bi = jnp.arange(B)[:, None]
        put = lambda buf, x: buf.at[layer, bi, where].set(x.astype(buf.dtype), mode="drop")  # noqa: E731
        scratch = dataclasses.replace(scratch, k=put(scratch.k, k), u=put(scratch.u, u), G=put(scratch.G, G),
                                      conv_in=put(scratch.conv_in, mixed))
    elif attn.pending:
        path = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T)) if path is None else path
        o, u, G = delta_block(q_rep, k_rep, v, decay, beta, s0, path)
        # The conv inputs kept in f32 (bf16 -> f32 -> bf16 is exact): kept as the in_qkv product's own
        # output, that product's weight was copied out of the stacked weights every layer on a GPU
        # (XLA:GPU then does not hand cuBLAS the slice where it lies; 64 MB a layer at Qwen3.5-9B).
        pending = (k, u, G, mixed.astype(jnp.float32))
    else:
        C = min(PREFILL_CHUNK, T)
        chain = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        n = jnp.sum(valid, axis=1).astype(jnp.int32)
        keep = (jnp.any(valid, axis=1) & (rows < Bs))  # padding rows write nothing
        if table is None:
            o, s_end = delta_chain(q_rep, k_rep, v, decay, beta, s0, chunk=C)
        else:
            marks = table.at - attn.prefix_lens[:, None] - 1  # [B, M] the suffix token each save follows
            marks = jnp.where(keep[:, None] & (marks < n[:, None]), marks, -1)
            o, s_end, s_marks = delta_chain(q_rep, k_rep, v, decay, beta, s0, chunk=C, marks=marks)
            conv_marks = jnp.stack([conv_state_after(mixed, conv0, chain, marks[:, m] + 1)
                                    for m in range(marks.shape[1])], axis=1)  # [B, M, C, K-1]
            slot = jnp.where(marks >= 0, table.slots, snapshots.ssm.shape[1])  # no save: dropped
            snapshots = dataclasses.replace(snapshots, ssm=snapshots.ssm.at[layer, slot].set(s_marks, mode="drop"),
                                            conv=snapshots.conv.at[layer, slot].set(conv_marks, mode="drop"))
        conv_end = conv_state_after(mixed, conv0, chain, n)
        write = jnp.where(keep, rows, Bs)
        state = dataclasses.replace(state, ssm=state.ssm.at[layer, write].set(s_end, mode="drop"),
                                    conv=state.conv.at[layer, write].set(conv_end, mode="drop"))
    o = gated_norm(o.astype(h.dtype), z, lp["gdn_norm"], cfg.rms_norm_eps).astype(h.dtype)  # [B, T, Hv, Dv]
    return o.reshape(B, T, -1) @ lp["wo"], state, scratch, pending, snapshots


def conv_from_scratch(x, conv0, w, scratch_in, at_step, step):  # -> f32[B, T, C]
    """The conv of a draft step's rows: input d steps up the path from the scratch (``at_step(d)``:
    that ancestor's column), above the first draft step from the conv state."""
    K = w.shape[1]
    xf, wf = x.astype(jnp.float32), w.astype(jnp.float32)
    out = xf * wf[:, K - 1]
    for d in range(1, K):
        from_scratch = jnp.einsum("btw,bwc->btc", at_step(d).astype(jnp.float32), scratch_in.astype(jnp.float32))
        rel = step - d  # < 0: above the first draft step
        from_state = jnp.take_along_axis(jnp.swapaxes(conv0, 1, 2).astype(jnp.float32),
                                         jnp.clip(K - 1 + rel, 0, K - 2)[..., None], axis=1)
        out = out + jnp.where((rel >= 0)[..., None], from_scratch, from_state) * wf[:, K - 1 - d]
    return out


def moe_mlp(lp: dict, cfg: HybridConfig, x: jax.Array, implementation=None) -> jax.Array:  # [B, T, H] -> [B, T, H]
    """Softmax top-k routing (renormalized when ``norm_topk_prob``), the routed experts, and the
    shared expert scaled by sigmoid(shared_expert_gate(x))."""
    B, T, H = x.shape
    m = cfg.moe
    xf = x.reshape(B * T, H)
    logits = jnp.dot(xf.astype(jnp.float32), lp["router"].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, m.num_experts_per_tok)
    if m.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    out = routed_experts(xf, experts, weights, lp["experts_gate"], lp["experts_up"], lp["experts_down"],
                         cfg.tensor_parallel, implementation=implementation)
    shared = gated_mlp(xf, lp["shared_gate_up"], lp["shared_down"], cfg.tensor_parallel)
    gate = jax.nn.sigmoid((xf @ lp["shared_expert_gate"]).astype(jnp.float32)).astype(x.dtype)
    return (out + gate * shared).reshape(B, T, H)


def hybrid_forward(
    params: dict,
    cfg: HybridConfig,
    tokens: jax.Array,  # i32[B, T]
    positions: jax.Array,  # i32[B, T]
    pool: HybridPool,
    attn: AttentionInputs,
    *,
    aux_layers: tuple[int, ...] = (),
    implementation=None,
) -> ForwardOutput:
    """Runs the decoder over T new tokens per row: full-attention layers write their K/V; linear
    layers write their state (a prefill) or return it pending (a verify, ``attn.pending``)."""
    x = embed_lookup(params["embed"], tokens, cfg.tensor_parallel)  # [B, T, H]
    taps = AuxTaps(cfg.num_layers, aux_layers)
    p = cfg.period
    kinds = cfg.kinds[:p]
    lin_per, full_per = sum(m == LINEAR for m, _ in kinds), sum(m == FULL for m, _ in kinds)

    # The snapshot slots ride through the layers only in a prefill that reads or writes them.
    snapshots = pool.snapshots if attn.snapshots is not None and not attn.pending else None

    def layer_norm(x, j, name, n):  # the stacked weights read where they lie (one kernel on a GPU)
        return stacked_rms_norm(x, params[f"p{j}"][name], n, eps=cfg.rms_norm_eps, implementation=implementation,
                                tensor_parallel=cfg.tensor_parallel, centred=True)

    def period(carry, lps):
        x, kv, state, snaps, scratch, aux, n = carry
        pend = []
        li = fi = 0
        for j, (mixer, mlp) in enumerate(kinds):
            lp = with_routed_experts(lps[j], params[f"p{j}"], n)  # the experts read where they lie
            aux = taps.record(aux, n * p + j, x)
            h = layer_norm(x, j, "attn_norm", n)
            if mixer == FULL:
                o, kv = full_attention(lp, cfg, h, positions, kv, n * full_per + fi, attn, implementation)
                fi += 1
            else:
                o, state, scratch, pending, snaps = linear_attention(lp, cfg, h, state, scratch, n * lin_per + li,
                                                                     attn, snaps)
                pend.append(pending)
                li += 1
            x = x + o
            h = layer_norm(x, j, "mlp_norm", n)
            x = x + (moe_mlp(lp, cfg, h, implementation) if mlp == "moe" else gated_mlp(h, lp["w_gate_up"], lp["w_down"], cfg.tensor_parallel))
        ys = tuple(pend) if attn.pending else None
        return (x, kv, state, snaps, scratch, aux, n + 1), ys

    layer_params = tuple(without_routed_experts(params[f"p{j}"]) for j in range(p))
    carry = (x, pool.kv, pool.state, snapshots, pool.scratch, taps.empty(x), jnp.int32(0))
    (x, kv, state, snapshots, scratch, aux, _), ys = jax.lax.scan(period, carry, layer_params)
    hidden = norm(x, params["norm"], cfg.rms_norm_eps)
    pending = None
    if attn.pending and lin_per:
        # ys: per linear position of the period, [N, ...]; layer n * lin_per + i is ys[i][n].
        stack = lambda parts: jnp.stack(parts, axis=1).reshape((-1,) + parts[0].shape[1:])  # noqa: E731
        pending = PendingState(*(stack([y[f] for y in ys]) for f in range(4)))
    return ForwardOutput(hidden=hidden, aux=taps.features(aux, hidden),
                         pool=HybridPool(kv=kv, state=state, scratch=scratch,
                                         snapshots=pool.snapshots if snapshots is None else snapshots),
                         pending=pending)


def commit_accepted(
    cfg: HybridConfig,
    pool: HybridPool,
    pending: PendingState,
    accept_index: jax.Array,  # i32[B, A] accepted nodes, root first (-1 past the end)
    accept_lens: jax.Array,  # i32[B]
    active: jax.Array,  # bool[B]
) -> HybridPool:
    """Writes, for every active row, each linear layer's state after the last accepted node (and the
    conv state: the path's last K-1 inputs); nothing of the rejected nodes is kept."""
    state = pool.state
    if pending is None or state.num_layers == 0:
        return pool
    T = pending.G.shape[2]
    r = cfg.gdn.group
    node = jnp.arange(T, dtype=jnp.int32)
    on_path = jnp.any((accept_index[:, :, None] == node[None, None, :]) & (accept_index[:, :, None] >= 0), axis=1)
    last = jnp.take_along_axis(accept_index, (accept_lens - 1)[:, None], axis=1)[:, 0]

    def layer(_, xs):  # one linear layer at a time: a single new state is live
        s0, conv0, k, u, G, conv_in = xs
        s = state_at(s0, jnp.repeat(k, r, axis=2), u, G, on_path, last)
        c = conv_state_after(conv_in, conv0, accept_index, accept_lens)
        return None, (jnp.where(active[:, None, None, None], s, s0), jnp.where(active[:, None, None], c, conv0))

    _, (ssm, conv) = jax.lax.scan(layer, None, (state.ssm, state.conv, pending.k, pending.u, pending.G,
                                                pending.conv_in))
    return dataclasses.replace(pool, state=dataclasses.replace(state, ssm=ssm, conv=conv))
