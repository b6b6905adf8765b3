"""DeepSeek-V4 target (HF ``DeepseekV4ForCausalLM`` semantics) as pure functions: hyper-connected
residual streams, compressed-KV attention (``deepseek_v4_attention``) and a hash- / top-k-routed MoE.

    x = [embed(tok)] * N                                      # N residual streams [B, T, N, H]
    per layer, twice (attention, then MoE), with that sub-block's hyper-connection weights:
        pre, post, comb = HC(x)        # from RMSNorm(flatten(x)) @ fn: sigmoid / 2 sigmoid / Sinkhorn(softmax)
        y = block(RMSNorm(sum_n pre_n x_n))
        x_k = post_k * y + sum_j comb[j, k] x_j
    hidden = RMSNorm(sum_n pre_n x_n)  with pre from hc_head;  logits = hidden @ lm_head

MoE: ``s = sqrt(softplus(h @ router))``; hash layers take the experts ``tid2eid[token]``, the others
the top-k of ``s + bias``; either way the weights are the chosen ``s`` renormalized, times
``routed_scaling_factor``; experts and the shared expert are SwiGLU with the gate clamped from above
and the up projection clamped to ``[-swiglu_limit, swiglu_limit]``.

Layers run in one ``lax.scan`` whose attention is a ``lax.switch`` over the layer kinds present (one
compiled body per kind, whatever the depth). The layer
params are stacked by what they have in common (``jaxspec.model.checkpoints.deepseek_v4``):

    embed [V, H]; lm_head [H, V]; norm [H]; hc_head_fn f32[N*H, N], hc_head_base [N], hc_head_scale [1]
    layers/ [L]: attn_norm, mlp_norm [H]; hc_{attn,ffn}_fn f32[N*H, (2+N)N], _base [(2+N)N], _scale [3];
        wq_a [H, Rq], q_norm [Rq], wq_b [Rq, Hq*D], wkv [H, D], kv_norm [D], wo_a [Hq*D/G, G*Ro],
        wo_b [G*Ro, H], sinks f32[Hq], router [H, E], experts_gate/up [E, H, I], experts_down [E, I, H],
        shared_gate_up [H, 2I] (joined: ``jaxspec.model.fused``), shared_down [I, H]
    csa/ [Lc]: c_wkv, c_wgate [H, 2D], c_ape f32[m, 2D], c_norm [D]; i_wq_b [Rq, Hi*Di], i_w_proj [H, Hi],
        i_wkv, i_wgate [H, 2Di], i_ape f32[m, 2Di], i_norm [Di]
    hca/ [Lh]: c_wkv, c_wgate [H, D], c_ape f32[m', D], c_norm [D]
    hash/ [Lhash]: tid2eid i32[V, k];  topk/ [Ltopk]: router_bias f32[E]

The ``aux`` of a forward asked for taps (``aux_layers``) is the residual streams, flattened to
[B, T, N*H]: tap l the streams entering layer l, tap L those leaving the last layer (before
``hc_head``), which the MTP layer reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.kvcache.compressed import CompressedPool, entry_pages_for
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.fused import split_columns
from jaxspec.model.layers import embed_lookup, routed_experts, with_routed_experts, without_routed_experts
from jaxspec.model.targets.base import AuxTaps, ForwardOutput
from jaxspec.model.targets.deepseek_v4_attention import (Closing, norm, v4_attention_core, v4_output_projection,
                                                         v4_projections)
from jaxspec.model.targets.deepseek_v4_config import CSA, HASH, HCA, SLIDING, TOPK, DeepseekV4Config
from jaxspec.pallas.sinkhorn import sinkhorn

_HI = jax.lax.Precision.HIGHEST


# ------------------------------------------------------------------------------------ pool


def input_widths(cfg: DeepseekV4Config) -> tuple[int, int]:
    """Per-token compressor inputs a CSA / HCA layer keeps: (kv, gate) of 2D each plus the indexer's
    (kv, gate) of 2Di each; (kv, gate) of D each."""
    return 4 * cfg.head_dim + 4 * cfg.index_head_dim, 2 * cfg.head_dim


def create_v4_pool(cfg: DeepseekV4Config, *, num_pages: int, page_size: int, dtype, window_pages: int | None = None,
                   rows: int = 1, entry_pages: tuple[int, ...] | None = None, num_layers: int | None = None,
                   kinds: tuple[str, ...] | None = None) -> CompressedPool:
    """The ring part (``window_pages`` pages; default ``num_pages``) and one entry part per
    compression rate (``entry_pages``; default ``entry_pages_for``). ``kinds``: the layers' kinds when
    they are not the config's (an MTP layer)."""
    kinds = cfg.layer_kinds if kinds is None else kinds
    n_csa, n_hca = kinds.count(CSA), kinds.count(HCA)
    csa_w, hca_w = input_widths(cfg)
    specs = []
    rates = [(CSA, n_csa, cfg.index_head_dim), (HCA, n_hca, 0)]
    present = [(k, n, di) for k, n, di in rates if n]
    for i, (k, n, di) in enumerate(present):
        pages = entry_pages[i] if entry_pages is not None else entry_pages_for(num_pages, rows, cfg.rate(k))
        specs.append((n, pages, di))
    return CompressedPool.create(
        num_layers=len(kinds) if num_layers is None else num_layers,
        window_pages=num_pages if window_pages is None else window_pages, page_size=page_size,
        head_dim=cfg.head_dim, csa_layers=n_csa, csa_width=csa_w, hca_layers=n_hca, hca_width=hca_w,
        entry_specs=specs, dtype=dtype)


# ------------------------------------------------------------------------------------ blocks


def hyper_weights(x: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, cfg: DeepseekV4Config, *,
                  implementation=None):
    """HF ``DeepseekV4HyperConnection``: (pre f32[B, T, N], post f32[B, T, N], comb f32[B, T, N, N]) of
    the streams ``x [B, T, N, H]``; comb is Sinkhorn-normalized (columns, then rows and columns; one
    kernel on a GPU, ``jaxspec.pallas.sinkhorn``)."""
    B, T, N, H = x.shape
    flat = norm(x.reshape(B, T, N * H).astype(jnp.float32), None, cfg.rms_norm_eps)
    mix = jnp.dot(flat, fn.astype(jnp.float32), precision=_HI)  # [B, T, (2+N)N]
    eps = cfg.hc_eps
    pre = jax.nn.sigmoid(mix[..., :N] * scale[0] + base[:N]) + eps
    post = 2 * jax.nn.sigmoid(mix[..., N:2 * N] * scale[1] + base[N:2 * N])
    logits = mix[..., 2 * N:].reshape(B, T, N, N) * scale[2] + base[2 * N:].reshape(N, N)
    comb = sinkhorn(logits, iters=cfg.hc_sinkhorn_iters, eps=eps, implementation=implementation,
                    tensor_parallel=cfg.tensor_parallel)
    return pre, post, comb


def collapse(x: jax.Array, pre: jax.Array) -> jax.Array:  # [B, T, N, H], f32[B, T, N] -> [B, T, H]
    return jnp.sum(pre[..., None] * x.astype(jnp.float32), axis=2).astype(x.dtype)


def expand(x: jax.Array, y: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:  # -> [B, T, N, H]
    """``x_k = post_k * y + sum_j comb[j, k] x_j`` (comb rounded to the streams' dtype, the sum in f32
    and rounded once, as HF's product). The N-term sum is written out: one elementwise kernel, where a
    product over an axis of N was a library call with two pads around it."""
    dt = x.dtype
    c, xf = comb.astype(dt).astype(jnp.float32), x.astype(jnp.float32)
    mixed = c[:, :, 0, :, None] * xf[:, :, 0, None, :]
    for j in range(1, x.shape[2]):
        mixed = mixed + c[:, :, j, :, None] * xf[:, :, j, None, :]
    return post.astype(dt)[..., None] * y[:, :, None, :] + mixed.astype(dt)


def hc_head(params: dict, cfg: DeepseekV4Config, x: jax.Array, prefix: str = "hc_head_") -> jax.Array:
    """HF ``DeepseekV4HyperHead``: the streams collapsed with sigmoid weights -> [B, T, H]."""
    B, T, N, H = x.shape
    flat = norm(x.reshape(B, T, N * H).astype(jnp.float32), None, cfg.rms_norm_eps)
    mix = jnp.dot(flat, params[prefix + "fn"].astype(jnp.float32), precision=_HI)
    pre = jax.nn.sigmoid(mix * params[prefix + "scale"][0] + params[prefix + "base"]) + cfg.hc_eps
    return collapse(x, pre)


def clamped_swiglu(x: jax.Array, w_gate_up, w_down, limit: float, shards: int = 1) -> jax.Array:
    """SwiGLU with the gate clamped from above and the up projection to [-limit, limit]; gate and
    up as one product (``jaxspec.model.layers.gated_mlp``'s joined weight)."""
    half = w_gate_up.shape[-1] // 2
    g, u = split_columns(x @ w_gate_up, (half, half), shards)
    return (jax.nn.silu(jnp.minimum(g, limit)) * jnp.clip(u, -limit, limit)) @ w_down


def v4_moe(lp: dict, cfg: DeepseekV4Config, x: jax.Array, tokens: jax.Array, tid2eid: jax.Array | None,
           bias: jax.Array | None, hashed: jax.Array, implementation=None) -> jax.Array:
    """``x [B, T, H]`` -> [B, T, H]: routed experts plus the shared expert. The experts are
    ``tid2eid[token]`` where ``hashed`` (bool[]), else the top-k of score + ``bias``."""
    B, T, H = x.shape
    xf = x.reshape(B * T, H)
    logits = jnp.dot(xf.astype(jnp.float32), lp["router"].astype(jnp.float32), precision=_HI)  # [N, E]
    scores = jnp.sqrt(jax.nn.softplus(logits))
    choices = []
    if tid2eid is not None:
        choices.append(tid2eid[tokens.reshape(B * T)].astype(jnp.int32))  # [N, k]
    if bias is not None:
        choices.append(jax.lax.top_k(scores + bias.astype(jnp.float32), cfg.num_experts_per_tok)[1])
    experts = choices[0] if len(choices) == 1 else jnp.where(hashed, choices[0], choices[1])
    weights = jnp.take_along_axis(scores, experts, axis=1)
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    out = routed_experts(xf, experts, weights, lp["experts_gate"], lp["experts_up"], lp["experts_down"],
                         cfg.tensor_parallel, limit=cfg.swiglu_limit, implementation=implementation)
    shared = clamped_swiglu(xf, lp["shared_gate_up"], lp["shared_down"], cfg.swiglu_limit, cfg.tensor_parallel)
    return (out + shared).reshape(B, T, H)


def v4_block(lp: dict, cfg: DeepseekV4Config, x: jax.Array, tokens: jax.Array, attend, tid2eid: jax.Array | None,
             bias: jax.Array | None, hashed: jax.Array, *, implementation=None):
    """One V4 layer over the streams ``x [B, T, N, H]`` (module docstring): its attention is
    ``attend(h [B, T, H]) -> (o [B, T, H], extra)``, then the MoE (``v4_moe``'s routing arguments).
    Returns (streams [B, T, N, H], extra). The target's layers and DSpark's draft stages share it."""
    pre, post, comb = hyper_weights(x, lp["hc_attn_fn"], lp["hc_attn_base"], lp["hc_attn_scale"], cfg,
                                    implementation=implementation)
    o, extra = attend(norm(collapse(x, pre), lp["attn_norm"], cfg.rms_norm_eps))
    x = expand(x, o.astype(x.dtype), post, comb)
    pre, post, comb = hyper_weights(x, lp["hc_ffn_fn"], lp["hc_ffn_base"], lp["hc_ffn_scale"], cfg,
                                    implementation=implementation)
    y = v4_moe(lp, cfg, norm(collapse(x, pre), lp["mlp_norm"], cfg.rms_norm_eps), tokens, tid2eid, bias, hashed,
               implementation)
    return expand(x, y.astype(x.dtype), post, comb), extra


def _row(tree: dict | None, i: jax.Array):
    """Row ``i`` (i32[]) of every stacked array of ``tree`` (None stays None)."""
    if tree is None:
        return None
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, jnp.clip(i, 0, a.shape[0] - 1), keepdims=False),
                        tree)


def layer_schedule(kinds: tuple[str, ...], mlp: tuple[str, ...]) -> dict[str, jax.Array]:
    """Per layer (i32[L] each): its attention branch, its row among the layers of its kind, whether it
    is hash-routed and its row among the layers of its routing kind (the scan's per-layer inputs)."""
    present = [k for k in (SLIDING, CSA, HCA) if k in kinds]
    count = {k: 0 for k in present}
    branch, row = [], []
    for k in kinds:
        branch.append(present.index(k))
        row.append(count[k])
        count[k] += 1
    mcount = {HASH: 0, TOPK: 0}
    mrow = []
    for k in mlp:
        mrow.append(mcount[k])
        mcount[k] += 1
    i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
    return {"branch": i32(branch), "row": i32(row), "hashed": jnp.asarray([k == HASH for k in mlp]),
            "mlp_row": i32(mrow), "layer": i32(range(len(kinds)))}


def run_layers(params: dict, cfg: DeepseekV4Config, kinds: tuple[str, ...], mlp: tuple[str, ...], x: jax.Array,
               tokens: jax.Array, positions: jax.Array, pool: CompressedPool, attn: AttentionInputs, taps: AuxTaps,
               aux, *, implementation=None):
    """The layers (``params``: ``layers/`` stacked, ``csa/`` ``hca/`` ``hash/`` ``topk/`` as present;
    attention ``kinds`` and routing ``mlp`` kinds per layer) over the streams ``x [B, T, N, H]``: one
    ``lax.scan``, its attention a ``lax.switch`` over the kinds present (one compiled body per kind,
    whatever the depth). Returns (streams, pool, aux, Closing [L, ...] of a verify or None)."""
    B, T, N, H = x.shape
    present = [k for k in (SLIDING, CSA, HCA) if k in kinds]
    sched = layer_schedule(kinds, mlp)

    def attention(kind):
        def run(sinks, row, layer, h, projected, pool):
            cp = None if kind == SLIDING else _row(params[kind], row)
            return v4_attention_core(sinks, cp, cfg, kind, h, projected, positions, pool, layer, row, attn,
                                     implementation=implementation)
        return run

    branches = [attention(k) for k in present]

    def body(carry, xs):
        x, pool, aux = carry
        lp, s = xs
        lp = with_routed_experts(lp, params["layers"], s["layer"])  # the experts read where they lie
        aux = taps.record(aux, s["layer"], x.reshape(B, T, N * H))

        def attend(h):
            # The products every kind shares run here, outside the switch, where each reads its layer's
            # slice of the stacked weights in place: a weight handed to a branch is a buffer of its own,
            # copied every layer (wq_a, wq_b, wkv, wo_a, wo_b: 204 MB a layer at V4-Flash's widths, in
            # the program compiled for an H100).
            args = (lp["sinks"], s["row"], s["layer"], h, v4_projections(lp, cfg, h), pool)
            if len(branches) == 1:
                o, p, closing = branches[0](*args)
            else:
                o, p, closing = jax.lax.switch(s["branch"], branches, *args)
            return v4_output_projection(lp, cfg, o), (p, closing)

        tid2eid = _row(params.get(HASH), s["mlp_row"])
        bias = _row(params.get(TOPK), s["mlp_row"])
        x, (pool, closing) = v4_block(lp, cfg, x, tokens, attend, None if tid2eid is None else tid2eid["tid2eid"],
                                      None if bias is None else bias["router_bias"], s["hashed"],
                                      implementation=implementation)
        return (x, pool, aux), closing

    (x, pool, aux), closings = jax.lax.scan(body, (x, pool, aux), (without_routed_experts(params["layers"]), sched))
    return x, pool, aux, closings


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class V4Pending:
    """What a verify forward leaves for ``commit_accepted``: per layer, the entry each node closes and
    where it goes (``Closing`` with a leading [L] axis; sliding layers' slots are -1)."""

    closings: Closing


def deepseek_v4_forward(
    params: dict,
    cfg: DeepseekV4Config,
    tokens: jax.Array,  # i32[B, T]
    positions: jax.Array,  # i32[B, T]
    pool: CompressedPool,
    attn: AttentionInputs,
    *,
    aux_layers: tuple[int, ...] = (),
    implementation=None,
) -> ForwardOutput:
    """Runs the decoder over T new tokens per row (module docstring); same contract as every target
    forward. A verify (``attn.pending``) writes no compressed entry and returns ``V4Pending``."""
    e = embed_lookup(params["embed"], tokens, cfg.tensor_parallel)  # [B, T, H]
    B, T, H = e.shape
    N = cfg.hc_mult
    pool = pool.copy_entry_pages(attn.entry_copy)  # a prefill after a cached prefix: its partial entry pages
    x = jnp.broadcast_to(e[:, :, None, :], (B, T, N, H))
    taps = AuxTaps(cfg.num_layers, aux_layers)
    aux = taps.empty(x.reshape(B, T, N * H))
    x, pool, aux, closings = run_layers(params, cfg, cfg.layer_kinds, cfg.mlp_kinds, x, tokens, positions, pool,
                                        attn, taps, aux, implementation=implementation)
    streams = x.reshape(B, T, N * H)
    hidden = norm(hc_head(params, cfg, x), params["norm"], cfg.rms_norm_eps)
    pending = V4Pending(closings=closings) if attn.pending else None
    return ForwardOutput(hidden=hidden, aux=taps.features(aux, streams), pool=pool, pending=pending)


def commit_accepted(
    cfg: DeepseekV4Config,
    pool: CompressedPool,
    pending: V4Pending | None,
    accept_index: jax.Array,  # i32[B, A] accepted nodes, root first (-1 past the end)
    accept_lens: jax.Array,  # i32[B]
    active: jax.Array,  # bool[B]
) -> CompressedPool:
    """Writes the entries the accepted path closes (each node's, at its slot); a rejected node's entry
    is never written."""
    if pending is None:
        return pool
    c = pending.closings  # [L, B, T, ...]
    L, B, T = c.slots.shape
    node = jnp.arange(T, dtype=jnp.int32)
    on_path = jnp.any((accept_index[:, :, None] == node[None, None, :]) & (accept_index[:, :, None] >= 0), axis=1)
    on_path = on_path & active[:, None]  # [B, T]
    entries = list(pool.entries)
    for kind in (CSA, HCA):
        layers = cfg.layers_of(kind)
        if not layers:
            continue
        r = cfg.entry_table_index(kind)
        part = entries[r]
        idx = jnp.asarray(layers, jnp.int32)
        slots = jnp.where(on_path[None], c.slots[idx], -1)  # [Lk, B, T]
        n = slots.shape[1] * T
        where = jnp.where(slots >= 0, slots, part.kv.shape[1]).reshape(len(layers), n)
        rows = jnp.arange(len(layers), dtype=jnp.int32)[:, None]
        kv = part.kv.at[rows, where].set(c.kv[idx].reshape(len(layers), n, -1).astype(part.kv.dtype), mode="drop")
        index_k = part.index_k
        if index_k is not None:
            index_k = index_k.at[rows, where].set(c.index_k[idx].reshape(len(layers), n, -1).astype(index_k.dtype),
                                                  mode="drop")
        entries[r] = dataclasses.replace(part, kv=kv, index_k=index_k)
    return dataclasses.replace(pool, entries=tuple(entries))
