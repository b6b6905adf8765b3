"""DFlash training: block-parallel prediction from random anchors with the target's features.

A training window has tokens ``x[0..T]``; the frozen target gives its features ``f[p]`` (the
outputs of the tapped layers at position ``p``) and its logits ``l[p]`` (its prediction for
``x[p + 1]``). Each window carries ``nA`` random anchors ``a``; for each, the draft sees what it
sees at inference when ``a`` is the last accepted token:

* the context: the features at positions ``0 .. a - 1`` (their K/V, projected per layer);
* the block ``[x[a], mask x (Q - 1)]`` at positions ``a .. a + Q - 1``, bidirectional inside
  the block (or as each layer's causality / sliding window says).

Block position ``j >= 1`` predicts ``x[a + j]``, labelled by the target's ``l[a + j - 1]``. All
anchors of a window run in one forward: the queries of every block attend to the shared context
K/V through a per-block visibility mask (``block_train_mask``), using the same layer pieces as
serving (``jaxspec.model.drafts.dflash``). Position ``j``'s loss weighs ``exp(-(j - 1) / gamma)``:
later positions are only accepted after the earlier ones, so they matter less.

Glossary: B windows, T feature positions, nA anchors per window, Q block size, S = Q - 1, H
width, F feature width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import SpecConfig
from jaxspec.model.drafts.dflash import (
    DFlashConfig,
    block_embedding,
    block_qkv,
    block_tail,
    context_features,
    dflash_draft,
    dflash_logits,
    layer_params,
)
from jaxspec.model.checkpoints.dflash import dflash_table, export_dflash, shared_target_params
from jaxspec.model.layers import project_kv, rms_norm, rope_inv_freq
from jaxspec.train.forward import dense_attention, frozen_block_inputs


def block_train_mask(
    anchors: jax.Array,  # i32[B, nA]
    num_context: int,  # T
    block_size: int,  # Q
    window: int | None,
    causal: bool,
) -> jax.Array:  # bool[B, nA*Q, T + nA*Q]
    """Visibility of every block query over [context keys 0..T-1, every block's keys]: context
    before the block's anchor, its own block only, each within the layer's window / causality."""
    B, nA = anchors.shape
    Q, T = block_size, num_context
    j = jnp.arange(Q, dtype=jnp.int32)
    qpos = (anchors[:, :, None] + j).reshape(B, nA * Q)  # [B, nA*Q]
    p = jnp.arange(T, dtype=jnp.int32)
    ctx = p[None, None, :] < jnp.repeat(anchors, Q, axis=1)[:, :, None]  # [B, nA*Q, T]
    if window is not None:
        ctx = ctx & (qpos[:, :, None] - p[None, None, :] < window)
    blk_id = jnp.repeat(jnp.arange(nA), Q)
    jj = jnp.tile(j, nA)
    same = blk_id[:, None] == blk_id[None, :]  # [nA*Q, nA*Q]
    d = jj[:, None] - jj[None, :]  # query j minus key j'
    if causal:
        same = same & (d >= 0)
    if window is not None:
        same = same & (d < window) & (d > -window)
    return jnp.concatenate([ctx, jnp.broadcast_to(same, (B, nA * Q, nA * Q))], axis=2)


def block_train_forward(
    params: dict,
    cfg: DFlashConfig,
    features: jax.Array,  # [B, T, F] target features at positions 0..T-1
    tokens: jax.Array,  # i32[B, >= T] the window (anchor tokens are read from it)
    anchors: jax.Array,  # i32[B, nA], each in [1, T]
) -> jax.Array:  # [B, nA, Q, H] the draft's normed outputs
    """Every anchor's block forward, all at once (dense attention, no pool)."""
    B, T, _ = features.shape
    nA, Q, H = anchors.shape[1], cfg.block_size, cfg.hidden_size
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    ctx = context_features(params, cfg, features)  # [B, T, H]
    ctx_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)  # [B, nA]
    blk = jnp.concatenate([anchor_tok[:, :, None], jnp.full((B, nA, Q - 1), cfg.mask_token_id, jnp.int32)], axis=2)
    pos = (anchors[:, :, None] + jnp.arange(Q, dtype=jnp.int32)).reshape(B * nA, Q)
    h = block_embedding(params, cfg, blk.reshape(B * nA, Q)).astype(ctx.dtype)  # [B*nA, Q, H]
    for i in range(cfg.num_layers):
        lp = layer_params(params, i)
        q, k, v, dyn = block_qkv(lp, cfg, h, pos, inv_freq)  # [B*nA, Q, ...]
        ck, cv = project_kv(lp, cfg, ctx, ctx_pos, inv_freq)  # [B, T, Hkv, D]
        keys = jnp.concatenate([ck, k.reshape(B, nA * Q, *k.shape[2:])], axis=1)
        values = jnp.concatenate([cv, v.reshape(B, nA * Q, *v.shape[2:])], axis=1)
        mask = block_train_mask(anchors, T, Q, cfg.layer_windows[i], cfg.layer_causal[i])
        o = dense_attention(q.reshape(B, nA * Q, *q.shape[2:]), keys, values, mask)
        h = block_tail(lp, cfg, h, o.reshape(B * nA, Q, *o.shape[2:]), dyn)
    return rms_norm(h, params["norm"], cfg.rms_norm_eps).reshape(B, nA, Q, H)


def position_weights(block_size: int, gamma: float) -> np.ndarray:  # f32[Q - 1]
    """exp(-(j - 1) / gamma) for block positions j = 1..Q-1."""
    return np.exp(-np.arange(block_size - 1, dtype=np.float32) / np.float32(gamma))


def sample_anchors(rng: np.random.Generator, batch: int, num_anchors: int, seq_len: int, block_size: int) -> np.ndarray:
    """i32[batch, num_anchors] anchors in [1, seq_len - block_size + 2]: each has context and
    every block position has a target label inside a window of ``seq_len + 1`` tokens."""
    hi = seq_len - block_size + 2
    if hi < 1:
        raise ValueError(f"seq_len {seq_len} is too short for blocks of {block_size}")
    return rng.integers(1, hi + 1, size=(batch, num_anchors)).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class DFlashMethod:
    """``jaxspec train-draft --method dflash``: what the generic trainer needs (static, hashable:
    it rides in the jitted step)."""

    dcfg: DFlashConfig
    num_anchors: int = 16
    gamma: float = 7.0
    label: str = "soft"
    name = "dflash"
    metric_unit = "position"

    def table(self):
        return dflash_table(self.dcfg)

    def batch_extra(self, rng: np.random.Generator, batch: int, seq_len: int) -> dict:
        return {"anchors": sample_anchors(rng, batch, self.num_anchors, seq_len, self.dcfg.block_size)}

    def eval_extra(self, count: int, seq_len: int) -> dict:
        """Fixed, evenly spread anchors for the held-out report."""
        hi = seq_len - self.dcfg.block_size + 2
        a = np.linspace(1, hi, self.num_anchors).round().astype(np.int32)
        return {"anchors": np.broadcast_to(a, (count, self.num_anchors)).copy()}

    def loss(self, params: dict, target_params: dict, tcfg, tokens: jax.Array, extra: dict):
        """tokens: i32[B, T+1] windows. Returns (weighted loss, metrics: ``loss`` / ``acc`` per
        block position f32[S], ``accept`` the mean greedy accept length of the blocks)."""
        cfg = self.dcfg
        # [B, T+1, V] labels, [B, T, F] features
        t_logits, features = frozen_block_inputs(target_params, tcfg, tokens, cfg.target_layer_ids)
        anchors = extra["anchors"]
        out = block_train_forward(params, cfg, features, tokens, anchors)[:, :, 1:]  # [B, nA, S, H]
        logits = dflash_logits(params, cfg, out)  # f32[B, nA, S, V]
        S = cfg.block_size - 1
        at = anchors[:, :, None] + jnp.arange(S, dtype=jnp.int32)  # l[a + j - 1] labels position j
        B, nA = anchors.shape
        labels = jnp.take_along_axis(t_logits, at.reshape(B, nA * S)[:, :, None], axis=1).reshape(B, nA, S, -1)
        logp = jax.nn.log_softmax(logits, axis=-1)
        top = jnp.argmax(labels, axis=-1)
        if self.label == "soft":
            ce = -jnp.sum(jax.nn.softmax(labels, axis=-1) * logp, axis=-1)  # [B, nA, S]
        else:
            ce = -jnp.take_along_axis(logp, top[..., None], axis=-1)[..., 0]
        per_pos = jnp.mean(ce, axis=(0, 1))  # [S]
        w = jnp.asarray(position_weights(cfg.block_size, self.gamma))
        total = jnp.sum(w * per_pos) / jnp.sum(w)
        right = jnp.argmax(logits, axis=-1) == top  # [B, nA, S]
        accept = 1.0 + jnp.mean(jnp.sum(jnp.cumprod(right.astype(jnp.float32), axis=-1), axis=-1))
        return total, dict(loss=per_pos, acc=jnp.mean(right.astype(jnp.float32), axis=(0, 1)), accept=accept)

    def estimate(self, metrics: dict) -> float:
        return float(metrics["accept"])

    def full_params(self, trainable: dict, target_params: dict) -> dict:
        return shared_target_params(trainable, target_params)

    def draft(self, params: dict):
        return dflash_draft(self.dcfg, params)

    def eval_spec(self, depth: int | None = None) -> SpecConfig:
        return SpecConfig.chain(self.dcfg.block_size - 1)

    def export(self, path: str, params: dict, target_cfg, dtype: str) -> None:
        export_dflash(path, params, self.dcfg, dtype=dtype)

    def describe(self, num_trainable: int) -> str:
        d = self.dcfg
        return (f"DFlash draft: {d.num_layers} layers, hidden {d.hidden_size}, intermediate {d.intermediate_size}, "
                f"heads {d.num_heads}/{d.num_kv_heads}, block {d.block_size}, taps {list(d.target_layer_ids)}, "
                f"mask token {d.mask_token_id}, {self.num_anchors} anchors/window, position decay gamma "
                f"{self.gamma:g}; {num_trainable} trainable params")


def least_frequent_token(stream: np.ndarray, vocab_size: int, avoid: tuple[int, ...] = ()) -> int:
    """A mask token for a draft trained without one of its own: the rarest token of the corpus
    (its embedding row carries least meaning), skipping ``avoid`` (eos, bos)."""
    counts = np.bincount(np.asarray(stream).reshape(-1), minlength=vocab_size).astype(np.float64)
    counts[list(avoid)] = math.inf
    return int(np.argmin(counts))
