"""DFlash / DFlash 2 block drafts: one draft forward proposes a whole block of tokens
(checkpoint names and config parsing: ``jaxspec.model.checkpoints.dflash``).

The draft reads the target's hidden states after the layers in ``target_layer_ids`` (the taps
``l + 1`` of ``jaxspec.model.targets.base.AuxTaps``), concatenated, projected by ``fc`` and
RMS-normed (``hidden_norm``): the *context*. Every draft layer projects the context with its
own k/v (k-norm, RoPE at the context token's position) and keeps it in the draft's paged
pool, written at prefill for the prompt and at extend for the accepted tokens.

One block forward per step runs Qwen3-style layers over ``[anchor, mask x (Q - 1)]`` at
positions ``start .. start + Q - 1`` (``start`` = the anchor's position = the committed length),
embedded with the target's raw embedding table (times ``input_embedding_scale``). The block's
queries attend to the context KV before ``start`` and to the block's own k/v: bidirectionally
inside the block for full-attention layers, causally for sliding layers unless the config's
``is_causal`` says otherwise; a sliding layer sees keys less than ``window`` positions away.
Logits go through the target's head, times ``output_multiplier``, soft-capped if set.

DFlash 2 adds, around attention and around the MLP of every layer, a grouped dynamic causal
convolution over the block positions (``grouped_causal_conv``), and a candidate selector that
chooses the drafted path among the top ``selector_top_k`` candidates of each position with
low-rank predecessor / successor codebooks (``DFlashDraft.candidates`` / ``sample_path``).

Params (linear weights ``[in, out]``):
    fc [n_sel*H, H]; hidden_norm [H]; norm [H]
    layers/ (stacked [L]): attn_norm, wq, wkv (k and v joined: the context projects them alone), wo, q_norm,
        k_norm, mlp_norm, w_gate_up (joined), w_down   (``jaxspec.model.fused``)
    layers/ (DFlash 2): attn_conv_base, mlp_conv_base [L, 2, K, H]; attn_conv_proj, mlp_conv_proj [L, H, 2*K*Ng]
    selector/ (DFlash 2): hidden_proj [H, R]; predecessor, successor [V, R]
    embed [V, H], lm_head [H, V] (absent when tied): the target's own arrays, shared

Glossary: B rows, Q block tokens (anchor + S proposals), S = Q - 1, C context rows, H width,
F = n_sel * H target feature width, V vocabulary, K conv kernel, G conv group, Ng = H / G,
R selector rank, k candidates per position.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxspec.kvcache.paging import AttentionInputs, positions_to_slots
from jaxspec.kvcache.pool import KVPool
from jaxspec.model.config import RopeConfig
from jaxspec.model.drafts.base import Draft, DraftContext, DraftModel, DraftSeed, check_block_tree
from jaxspec.sampling.grammar_masks import Grammar
from jaxspec.model.fused import shards_of
from jaxspec.model.layers import (gated_mlp, lm_head, mask_padded_vocab, project_kv, project_qkv, rms_norm, rope_inv_freq,
                                  write_and_attend)
from jaxspec.sampling.distributions import RowSampling, sample_with_uniform, target_probs

_MASK_VALUE = -1e30


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashConfig:
    """Static shape of a DFlash (``version`` 1) or DFlash 2 (``version`` 2) draft.

    target_layer_ids: target layers whose *outputs* form the context feature, in order.
    block_size: Q, tokens per block including the anchor.
    mask_token_id: the token filling the block after the anchor.
    layer_windows: per draft layer, its sliding window (None: full attention).
    layer_causal: per draft layer, causal inside the block (else bidirectional).
    conv_kernel_size, conv_group_size (K, G), selector_rank, selector_top_k (R, k): DFlash 2.
    num_target_layers: the target depth the draft was built for (from its config).
    """

    version: int = 1
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    block_size: int = 16
    mask_token_id: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    layer_windows: tuple[int | None, ...] = ()
    layer_causal: tuple[bool, ...] = ()
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    attention_bias: bool = False  # (the shared Llama layer projections read these two)
    qk_norm: bool = True

    def __post_init__(self):
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.num_layers)
        if not self.layer_causal:
            object.__setattr__(self, "layer_causal", tuple(w is not None for w in self.layer_windows))
        if len(self.layer_windows) != self.num_layers or len(self.layer_causal) != self.num_layers:
            raise ValueError(f"DFlashConfig: layer_windows / layer_causal need {self.num_layers} entries")
        if self.version not in (1, 2):
            raise ValueError(f"DFlashConfig.version must be 1 or 2, got {self.version}")
        if self.version == 2 and self.hidden_size % max(self.conv_group_size, 1):
            raise ValueError(f"DFlash 2: hidden_size {self.hidden_size} is not a multiple of conv_group_size "
                             f"{self.conv_group_size}")

    @property
    def feature_size(self) -> int:
        """F: width of the concatenated target features."""
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size if self.version == 2 else 0


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's default taps: the middle layer for one draft layer, else spread from
    layer 1 to layer L - 3 (Python ``round``: half to even)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers))


def draft_attention_layout(target_cfg) -> tuple[int, int, int, RopeConfig]:
    """(heads, KV heads, head dim, RoPE) of a new draft's Qwen3-style layers for ``target_cfg``:
    the target's own for Llama-family targets, the sliding layers' for Gemma 4; an MLA target
    (DeepSeek) has no such heads, so the draft takes ``hidden / heads``-wide heads, all of them KV
    heads, with default RoPE."""
    shape = getattr(target_cfg, "sliding", None)  # Gemma 4: per-layer-type attention shapes
    if shape is not None:
        return target_cfg.num_heads, shape.num_kv_heads, shape.head_dim, shape.rope
    if hasattr(target_cfg, "head_dim"):
        return target_cfg.num_heads, target_cfg.num_kv_heads, target_cfg.head_dim, target_cfg.rope
    heads = target_cfg.num_heads
    return heads, heads, target_cfg.hidden_size // heads, RopeConfig()


def dflash_config_for(target_cfg, *, num_layers: int = 2, block_size: int = 16, mask_token_id: int,
                      intermediate_size: int | None = None, target_layer_ids=None) -> DFlashConfig:
    """A DFlash 1 draft shaped for ``target_cfg`` (its width, ``draft_attention_layout``'s heads;
    the reference's default taps for ``num_layers`` draft layers)."""
    L = target_cfg.num_layers
    ids = tuple(target_layer_ids) if target_layer_ids else default_target_layer_ids(L, num_layers)
    heads, kv_heads, head_dim, rope = draft_attention_layout(target_cfg)
    return DFlashConfig(
        version=1,
        hidden_size=target_cfg.hidden_size,
        intermediate_size=intermediate_size or target_cfg.intermediate_size,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=target_cfg.rms_norm_eps,
        rope=rope,
        vocab_size=target_cfg.vocab_size,
        target_layer_ids=ids,
        num_target_layers=L,
        block_size=block_size,
        mask_token_id=mask_token_id,
    )


# ------------------------------------------------------------------------ layer pieces


def layer_params(params: dict, i: int) -> dict:
    """Draft layer ``i``'s params out of the stacked ``params["layers"]``."""
    return jax.tree.map(lambda x: x[i], params["layers"])


def context_features(params: dict, cfg: DFlashConfig, features: jax.Array) -> jax.Array:  # [B, C, F] -> [B, C, H]
    """The target features as every layer's context: ``hidden_norm(fc(features))``."""
    return rms_norm(features.astype(params["fc"].dtype) @ params["fc"], params["hidden_norm"], cfg.rms_norm_eps)


def grouped_causal_conv(
    x: jax.Array,  # [..., Q, H]
    base: jax.Array,  # [K, H] per-channel kernel
    dynamic: jax.Array,  # [..., Q, K, Ng] per-position, per-group kernel
    group_size: int,
) -> jax.Array:  # [..., Q, H]
    """``y[t, c] = sum_o (base[o, c] + dynamic[t, o, c // G]) * x[t - o, c]``, zero before
    the first block position (nothing carried between blocks)."""
    K = base.shape[0]
    Q = x.shape[-2]
    base = base.astype(x.dtype)
    out = jnp.zeros_like(x)
    for o in range(K):
        shifted = x if o == 0 else jnp.pad(x[..., : Q - o, :], [(0, 0)] * (x.ndim - 2) + [(o, 0), (0, 0)])
        kernel = base[o] + jnp.repeat(dynamic[..., o, :], group_size, axis=-1)  # [..., Q, H]
        out = out + kernel * shifted
    return out


def _conv_in(lp: dict, name: str, cfg: DFlashConfig, x: jax.Array):  # -> x, second dynamic kernel (or None)
    """DFlash 2's pre-convolution of a sublayer's normed input; its second dynamic kernel (for
    the post-convolution) is predicted from the same input."""
    if cfg.version != 2:
        return x, None
    K, Ng = cfg.conv_kernel_size, cfg.conv_groups
    dyn = (x @ lp[name + "_proj"]).reshape(x.shape[:-1] + (2, K, Ng))  # [..., Q, 2, K, Ng]
    return grouped_causal_conv(x, lp[name + "_base"][0], dyn[..., 0, :, :], cfg.conv_group_size), dyn[..., 1, :, :]


def _conv_out(lp: dict, name: str, cfg: DFlashConfig, y: jax.Array, dyn) -> jax.Array:
    if dyn is None:
        return y
    return grouped_causal_conv(y, lp[name + "_base"][1], dyn, cfg.conv_group_size)


def block_qkv(
    lp: dict, cfg: DFlashConfig, h: jax.Array, positions: jax.Array, inv_freq  # h [N, Q, H]; positions i32[N, Q]
):  # -> q [N, Q, Hq, D], k, v [N, Q, Hkv, D], the attention post-conv kernel
    """The part of a draft layer before attention, over the block rows."""
    x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
    x, dyn = _conv_in(lp, "attn_conv", cfg, x)
    return (*project_qkv(lp, cfg, x, positions, inv_freq), dyn)


def block_tail(
    lp: dict, cfg: DFlashConfig, h: jax.Array, o: jax.Array, dyn  # h [N, Q, H] residual; o [N, Q, Hq, D]
) -> jax.Array:  # [N, Q, H]
    """Output projection (and post-conv), residual, then the (convolved) SwiGLU MLP."""
    a = o.reshape(o.shape[:-2] + (-1,)) @ lp["wo"]
    h = h + _conv_out(lp, "attn_conv", cfg, a, dyn)
    x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
    x, dyn = _conv_in(lp, "mlp_conv", cfg, x)
    return h + _conv_out(lp, "mlp_conv", cfg, gated_mlp(x, lp["w_gate_up"], lp["w_down"], shards_of(cfg)), dyn)


def block_embedding(params: dict, cfg: DFlashConfig, tokens: jax.Array) -> jax.Array:  # i32[N, Q] -> [N, Q, H]
    """The target's raw embedding rows times ``input_embedding_scale``."""
    emb = params["embed"][tokens]
    return emb if cfg.input_embedding_scale == 1.0 else emb * jnp.asarray(cfg.input_embedding_scale, emb.dtype)


def dflash_logits(params: dict, cfg: DFlashConfig, hidden: jax.Array) -> jax.Array:  # [..., H] -> f32[..., V]
    """The target's head over the draft's normed output, times ``output_multiplier``, then the
    draft's own soft cap (the target's is never applied)."""
    logits = lm_head(params, hidden)  # the target's: its padded vocabulary on a mesh (masked below)
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    cap = cfg.final_logit_softcapping
    if cap is not None and cap > 0:
        logits = cap * jnp.tanh(logits / cap)
    return mask_padded_vocab(logits, cfg.vocab_size)


# ------------------------------------------------------------------------ serving attention


def window_attention(
    q: jax.Array,  # [B, Q, Hq, D] block queries at positions start + j
    pool: KVPool,
    layer: int,
    page_table: jax.Array,  # i32[B, W]
    start: jax.Array,  # i32[B] first block position
    *,
    window: int,
    causal: bool,
) -> jax.Array:  # [B, Q, Hq, D]
    """A sliding draft layer: each block query sees the keys (context and block, already in the
    pool) whose position is less than ``window`` away (and not after it when ``causal``). Reads
    only the ``window - 1 + Q`` positions that can be visible."""
    B, Q, Hq, D = q.shape
    Hkv = pool.k.shape[2]
    span = window - 1 + Q
    pos = start[:, None] - (window - 1) + jnp.arange(span, dtype=jnp.int32)[None, :]  # [B, span]
    slots = positions_to_slots(page_table, pos, pool.page_size)
    k = pool.k[layer, slots].astype(jnp.float32)  # [B, span, Hkv, D]
    v = pool.v[layer, slots].astype(jnp.float32)
    qpos = start[:, None] + jnp.arange(Q, dtype=jnp.int32)[None, :]  # [B, Q]
    diff = qpos[:, :, None] - pos[:, None, :]  # [B, Q, span]
    visible = (pos >= 0)[:, None, :] & (diff < window) & ((diff >= 0) if causal else (diff > -window))
    qg = q.astype(jnp.float32).reshape(B, Q, Hkv, Hq // Hkv, D)
    s = jnp.einsum("bthgd,bkhd->bhgtk", qg, k, precision=jax.lax.Precision.HIGHEST) / math.sqrt(D)
    s = jnp.where(visible[:, None, None], s, _MASK_VALUE)
    o = jnp.einsum("bhgtk,bkhd->bthgd", jax.nn.softmax(s, axis=-1), v, precision=jax.lax.Precision.HIGHEST)
    return o.reshape(B, Q, Hq, D).astype(q.dtype)


# ------------------------------------------------------------------------ the draft kind


@dataclasses.dataclass(frozen=True)
class DFlashDraft(Draft):
    """A DFlash block draft (``proposer`` "block": ``jaxspec.spec.block_loop``)."""

    model: DFlashConfig
    kind: ClassVar[str] = "dflash"
    proposer: ClassVar[str] = "block"

    @property
    def feature(self) -> str:
        return "aux"

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The output of target layer ``l`` is the stream entering layer ``l + 1``."""
        return tuple(l + 1 for l in self.model.target_layer_ids)

    @property
    def block_size(self) -> int:
        return self.model.block_size

    @property
    def mask_token_id(self) -> int:
        """The token filling the block after the anchor."""
        return self.model.mask_token_id

    def block_length(self, num_steps: int) -> int:
        """Q: block slots for S = ``num_steps`` proposals (the anchor's slot drafts nothing)."""
        return num_steps + 1

    seeded: ClassVar[bool] = False  # nothing carried between blocks: the context lives in the pool

    def proposal_hidden(self, hidden: jax.Array, seed: DraftSeed) -> jax.Array:  # [B, Q, H] -> [B, S, H]
        """What ``candidates`` / ``sample_path`` read of the block: its S proposal slots."""
        del seed
        return hidden[:, 1:]

    @property
    def target_hidden_size(self) -> int:
        return self.model.hidden_size

    def empty_seed(self, batch: int, *, dtype, max_len: int):
        del max_len
        return DraftSeed.empty(batch, 1, dtype)  # nothing is carried: the context lives in the pool

    def check_spec(self, spec) -> None:
        """A block of Q = S + 1 tokens (S = num_steps) must fit ``block_size``; a tree hangs at
        most ``topk`` candidates per position, so n - 1 <= S * topk."""
        super().check_spec(spec)  # no grafted n-gram branch
        S, Q = spec.num_steps, self.block_size
        if S + 1 > Q:
            raise ValueError(
                f"this DFlash draft proposes blocks of {Q} tokens (block_size): num_steps={S} needs a block of "
                f"{S + 1}; use num_steps <= {Q - 1} (SpecConfig.chain({Q - 1}) is its natural shape)"
            )
        for S_a in spec.adaptive_steps:
            if S_a + 1 > Q:
                raise ValueError(f"adaptive_steps {spec.adaptive_steps} exceed the draft's block_size {Q} - 1")
        check_block_tree("DFlash", spec)

    def check_fits(self, target_cfg) -> None:
        cfg = self.model
        if cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"DFlash draft vocab_size {cfg.vocab_size} does not match the target's "
                             f"{target_cfg.vocab_size}")
        if cfg.hidden_size != target_cfg.hidden_size:
            raise ValueError(f"DFlash draft hidden_size {cfg.hidden_size} must equal the target's hidden size "
                             f"{target_cfg.hidden_size} (it reads the target's features and embeddings)")
        bad = [l for l in cfg.target_layer_ids if not 0 <= l < target_cfg.num_layers]
        if bad:
            raise ValueError(f"DFlash target_layer_ids {list(cfg.target_layer_ids)} are outside the target's "
                             f"{target_cfg.num_layers} layers (0-based)")
        if len(set(cfg.target_layer_ids)) != len(cfg.target_layer_ids):
            raise ValueError(f"DFlash target_layer_ids {list(cfg.target_layer_ids)} repeat a layer")
        if not 0 <= cfg.mask_token_id < target_cfg.vocab_size:
            raise ValueError(f"DFlash mask_token_id {cfg.mask_token_id} is outside the vocabulary")

    # --------------------------------------------------------------------------- forwards

    def write_context(self, params, features, positions, pool, attn: AttentionInputs):
        """Projects target features ``[B, T, F]`` (at ``positions`` i32[B, T]) into every layer's
        context K/V and writes them at ``attn.write_slots``. Returns (context [B, T, H], pool)."""
        cfg = self.model
        ctx = context_features(params, cfg, features)  # [B, T, H]
        inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
        B, T = positions.shape
        slots = attn.write_slots.reshape(B * T)
        for i in range(cfg.num_layers):
            k, v = project_kv(layer_params(params, i), cfg, ctx, positions, inv_freq)
            pool = pool.write(i, slots, k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:]))
        return ctx, pool

    def block_forward(self, params, tokens, positions, pool, attn: AttentionInputs, *, implementation=None):
        """One block forward: ``tokens`` i32[B, Q] at ``positions`` i32[B, Q] (= start + j with
        start = ``attn.prefix_lens``); the block's K/V are written at ``attn.write_slots`` (the
        context extend overwrites them later). Returns (normed hidden [B, Q, H], pool)."""
        cfg = self.model
        B, Q = tokens.shape
        inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
        h = block_embedding(params, cfg, tokens)
        full_mask = jnp.ones((B, Q, Q), bool)
        for i in range(cfg.num_layers):
            lp = layer_params(params, i)
            q, k, v, dyn = block_qkv(lp, cfg, h, positions, inv_freq)
            window, causal = cfg.layer_windows[i], cfg.layer_causal[i]
            if window is None:  # the paged kernel: prefix = context, block = causal or all-visible
                layer_attn = dataclasses.replace(attn, block_mask=None if causal else full_mask)
                o, pool = write_and_attend(q, k, v, pool, jnp.int32(i), layer_attn, implementation=implementation)
            else:
                slots = attn.write_slots.reshape(B * Q)
                pool = pool.write(i, slots, k.reshape(B * Q, *k.shape[2:]), v.reshape(B * Q, *v.shape[2:]))
                o = window_attention(q, pool, i, attn.page_table, attn.prefix_lens, window=window, causal=causal)
            h = block_tail(lp, cfg, h, o, dyn)
        return rms_norm(h, params["norm"], cfg.rms_norm_eps), pool

    def forward(self, params, tokens, hidden, positions, pool, attn, ctx: DraftContext, *, from_target,
                implementation=None):
        """Extend (``from_target``): context K/V from the target features ``hidden``; otherwise
        a block forward over ``tokens``."""
        if from_target:
            h, pool = self.write_context(params, hidden, positions, pool, attn)
            return h, h, pool
        h, pool = self.block_forward(params, tokens, positions, pool, attn, implementation=implementation)
        return h, h, pool

    def extend(self, params, tokens, features, positions, pool, attn, ctx, *, implementation=None):
        return self.write_context(params, features, positions, pool, attn)

    def logits(self, params, logit_in):
        return dflash_logits(params, self.model, logit_in)

    # --------------------------------------------------------------------------- proposals

    def candidates(self, params, hidden, anchor, width: int, grammar: Grammar | None = None):
        """Greedy proposals and alternatives from one block forward (``position_candidates``).

        hidden: [B, S, H] the block's outputs at the S proposal positions; anchor: i32[B].
        Returns (tokens i32[B, S, k], probs f32[B, S, k]) with k = ``width``: at each position
        the ``width`` best tokens by the draft's softmax, best first, so ``tokens[:, :, 0]`` is
        the greedy path. ``width == 1`` uses argmax (no top_k). With a ``grammar`` each position
        proposes only what its structured-output state allows after the greedy path before it."""
        return position_candidates(self.logits(params, hidden), width, grammar)

    def sample_path(self, params, hidden, anchor, sampling: RowSampling, uniform, *, filtering: bool,
                    grammar: Grammar | None = None):
        """Draws the proposals of every position from the draft's sampling distribution q
        (each row's temperature / top_k / top_p; one-hot argmax for greedy rows), over the tokens a
        ``grammar`` allows after the tokens drawn before (then position by position).

        hidden: [B, S, H]; sampling: every field [B]; uniform: f32[B, S].
        Returns (tokens i32[B, S], q f32[B, S, V]: the distribution each token was drawn from)."""
        return position_samples(self.logits(params, hidden), sampling, uniform, filtering=filtering, grammar=grammar)


@dataclasses.dataclass(frozen=True)
class DFlash2Draft(DFlashDraft):
    """DFlash 2: the grouped dynamic convolutions (in the layers) and the candidate selector,
    which drafts a left-to-right path through the top ``selector_top_k`` candidates of each
    position, scoring each with a trilinear term between the chosen predecessor, the position's
    hidden and the candidate."""

    kind: ClassVar[str] = "dflash2"

    def _selector_inputs(self, params, hidden):
        cfg = self.model
        logits = self.logits(params, hidden)  # [B, S, V]
        unary, cand = jax.lax.top_k(logits, cfg.selector_top_k)  # [B, S, k_sel]
        sel = params["selector"]
        hp = hidden @ sel["hidden_proj"]  # [B, S, R]
        succ = sel["successor"][cand]  # [B, S, k_sel, R]
        return unary, cand.astype(jnp.int32), hp, succ

    def _scores(self, params, pred, unary_t, hp_t, succ_t):  # -> f32[B, k_sel]
        edge = jnp.einsum("br,bkr->bk", params["selector"]["predecessor"][pred] * hp_t, succ_t,
                          preferred_element_type=jnp.float32)
        return unary_t + edge

    def candidates(self, params, hidden, anchor, width: int, grammar: Grammar | None = None):
        """The selector's greedy path (argmax of the score given the chosen predecessor) and, at
        each position, the next best candidates given the same predecessor. probs: the softmax of
        the scores over the ``selector_top_k`` candidates (those a ``grammar`` allows there)."""
        unary, cand, hp, succ = self._selector_inputs(params, hidden)
        pred = anchor
        states = None if grammar is None else grammar.state
        toks, probs = [], []
        for t in range(hidden.shape[1]):
            score = self._scores(params, pred, unary[:, t], hp[:, t], succ[:, t])  # [B, k_sel]
            score = _mask_candidates(score, cand[:, t], grammar, states)
            p = jax.nn.softmax(score, axis=-1)
            if width == 1:
                j = jnp.argmax(score, axis=-1)[:, None]
            else:
                _, j = jax.lax.top_k(score, width)  # [B, width], best first
            toks.append(jnp.take_along_axis(cand[:, t], j, axis=1))
            probs.append(jnp.take_along_axis(p, j, axis=1))
            pred = toks[-1][:, 0]
            states = None if grammar is None else grammar.advance(states, pred)
        return jnp.stack(toks, axis=1), jnp.stack(probs, axis=1)  # [B, S, width]

    def sample_path(self, params, hidden, anchor, sampling: RowSampling, uniform, *, filtering: bool,
                    grammar: Grammar | None = None):
        """The selector's sampled path: at each position ``softmax(score / T)`` over the
        candidates given the drawn predecessor (argmax for greedy rows; only those a ``grammar``
        allows there); q is that distribution placed in the vocabulary."""
        del filtering  # the selector samples from its own q (temperature only)
        unary, cand, hp, succ = self._selector_inputs(params, hidden)
        B, S, k_sel = cand.shape
        greedy = sampling.greedy
        t_safe = jnp.where(greedy, 1.0, sampling.temperature)[:, None]
        pred = anchor
        states = None if grammar is None else grammar.state
        toks, qs = [], []
        for t in range(S):
            score = self._scores(params, pred, unary[:, t], hp[:, t], succ[:, t])
            score = _mask_candidates(score, cand[:, t], grammar, states)
            onehot = jax.nn.one_hot(jnp.argmax(score, axis=-1), k_sel, dtype=jnp.float32)
            q_t = jnp.where(greedy[:, None], onehot, jax.nn.softmax(score / t_safe, axis=-1))  # [B, k_sel]
            j = sample_with_uniform(q_t, uniform[:, t])
            pred = jnp.take_along_axis(cand[:, t], j[:, None], axis=1)[:, 0]
            states = None if grammar is None else grammar.advance(states, pred)
            toks.append(pred)
            qs.append(q_t)
        q_cand = jnp.stack(qs, axis=1)  # [B, S, k_sel]
        V = self.vocab_size
        q = jnp.zeros((B, S, V), jnp.float32).at[
            jnp.arange(B)[:, None, None], jnp.arange(S)[None, :, None], cand].set(q_cand)
        return jnp.stack(toks, axis=1), q

    def check_spec(self, spec) -> None:
        super().check_spec(spec)
        if spec.topk > self.model.selector_top_k:
            raise ValueError(f"a DFlash 2 tree branches over the selector's candidates: topk={spec.topk} > "
                             f"selector_top_k={self.model.selector_top_k}")


def position_candidates(logits: jax.Array, width: int, grammar: Grammar | None = None):
    """Proposals of a block whose positions are drafted independently (DFlash, P-EAGLE, PARD): at each
    position the ``width`` best tokens of ``softmax(logits)`` (f32[B, S, V]), best first, so
    column 0 is the greedy path; ``width == 1`` uses argmax (no top_k). With a ``grammar`` each
    position proposes only what its structured-output state allows after the greedy path before
    it. Returns (tokens i32[B, S, width], probs f32[B, S, width])."""
    if grammar is not None and grammar.enabled:
        logits = greedy_path_masked(logits, grammar)
    probs = jax.nn.softmax(logits, axis=-1)
    if width == 1:
        return jnp.argmax(logits, axis=-1)[..., None].astype(jnp.int32), jnp.max(probs, axis=-1, keepdims=True)
    p, idx = jax.lax.top_k(probs, width)
    return idx.astype(jnp.int32), p


def position_samples(logits, sampling: RowSampling, uniform, *, filtering: bool, grammar: Grammar | None = None):
    """Draws every position of an independently drafted block from q, the sampling distribution
    of its logits f32[B, S, V] (each row's temperature / top_k / top_p, every field [B]; one-hot
    argmax for greedy rows), over the tokens a ``grammar`` allows after the tokens drawn before
    (then position by position). uniform: f32[B, S].
    Returns (tokens i32[B, S], q f32[B, S, V]: the distribution each token was drawn from)."""
    S = logits.shape[1]
    if grammar is not None and grammar.enabled:
        states, toks, qs = grammar.state, [], []
        for t in range(S):
            q_t = target_probs(grammar.mask(logits[:, t], states), sampling, filtering, min_p=False)
            toks.append(sample_with_uniform(q_t, uniform[:, t]))
            qs.append(q_t)
            states = grammar.advance(states, toks[-1])
        return jnp.stack(toks, axis=1), jnp.stack(qs, axis=1)
    q = target_probs(logits, sampling.broadcast(logits.shape[:2]), filtering, min_p=False)
    return sample_with_uniform(q, uniform), q


def greedy_path_masked(logits: jax.Array, grammar: Grammar) -> jax.Array:  # f32[B, S, V] -> f32[B, S, V]
    """A block's logits with each position masked by the structured-output state after the greedy
    tokens of the positions before it (the grammar's states followed left to right)."""
    states, out = grammar.state, []
    for t in range(logits.shape[1]):
        masked = grammar.mask(logits[:, t], states)
        out.append(masked)
        states = grammar.advance(states, jnp.argmax(masked, axis=-1).astype(jnp.int32))
    return jnp.stack(out, axis=1)


def _mask_candidates(score, cand, grammar: Grammar | None, states):  # f32[B, k], i32[B, k] -> f32[B, k]
    """The selector's scores with the candidates the rows' grammar states do not allow at -inf."""
    if grammar is None or not grammar.enabled:
        return score
    ok = jnp.take_along_axis(grammar.allowed(states), cand, axis=1)
    ok = ok | ~jnp.any(ok, axis=1, keepdims=True)  # none allowed: leave them (nothing of this block is accepted)
    return jnp.where(ok, score, -jnp.inf)


def dflash_draft_for(cfg: DFlashConfig) -> DFlashDraft:
    return DFlash2Draft(model=cfg) if cfg.version == 2 else DFlashDraft(model=cfg)


def dflash_draft(cfg: DFlashConfig, params: dict, path: str | None = None) -> DraftModel:
    """Wraps DFlash params (from a checkpoint, ``init_dflash_params`` or training; the target's
    ``embed`` / ``lm_head`` included) as a draft."""
    return DraftModel(config=dflash_draft_for(cfg), params=params, path=path)
