"""DSpark training: DFlash's block-parallel training plus the Markov and confidence heads' losses,
as the ``speculators`` library defines them.

The backbone runs exactly as ``jaxspec.train.dflash_method`` runs it: every window carries ``nA`` random
anchors ``a``; block ``[x[a], mask, ...]`` at positions ``a ..`` reads the features before ``a``.
Then, for each block slot, teacher-forced: the Markov head's bias from the *true* token before the
slot (``x[a]`` for the first drafting slot; the rnn state runs from the block's first slot), added
to the head's logits; with ``sample_from_anchor`` slot ``j`` predicts ``x[a + j + 1]`` (labelled by
the target's ``l[a + j]``), without it slot ``j >= 1`` predicts ``x[a + j]``. The token loss is the
soft cross-entropy to the target's distribution, weighed ``exp(-k / gamma)`` at the k-th drafting
slot (DFlash's decay). The confidence head learns the analytic acceptance rate of its slot,
``sum_v min(q_v, p_v) = 1 - TV(q, p)`` (q the corrected draft distribution, p the target's, both
held constant), by binary cross-entropy with the same decay, times ``confidence_alpha``.

Glossary: B windows, T feature positions, nA anchors per window, Q block slots, S drafting slots,
H width, r Markov rank, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import SpecConfig
from jaxspec.model.drafts.dflash import DFlashConfig, dflash_logits
from jaxspec.model.drafts.dspark import DSparkConfig, confidence_logits, dspark_draft, markov_bias
from jaxspec.model.checkpoints.dflash import shared_target_params
from jaxspec.model.checkpoints.speculators import dspark_table, export_speculators
from jaxspec.train.dflash_method import DFlashMethod, block_train_forward, position_weights, sample_anchors
from jaxspec.train.forward import frozen_block_inputs


def dspark_config_for(dcfg: DFlashConfig, *, markov_rank: int, markov_head_type: str = "vanilla",
                      confidence_head: bool = True, confidence_with_markov: bool = True,
                      sample_from_anchor: bool = True) -> DSparkConfig:
    """A DSpark draft with ``dcfg``'s backbone (``jaxspec.model.drafts.dflash.dflash_config_for``)."""
    base = {f.name: getattr(dcfg, f.name) for f in dataclasses.fields(DFlashConfig)}
    return DSparkConfig(**base, sample_from_anchor=sample_from_anchor, markov_rank=markov_rank,
                        markov_head_type=markov_head_type, confidence_head=confidence_head,
                        confidence_with_markov=confidence_head and confidence_with_markov and markov_rank > 0)


def slot_prev_tokens(tokens: jax.Array, anchors: jax.Array, cfg: DSparkConfig) -> jax.Array:  # -> i32[B, nA, Q]
    """The true token before every block slot: ``x[a + max(k - first, 0)]`` (the anchor for the
    first drafting slot; the anchor's own slot, which drafts nothing without sample_from_anchor,
    sees the anchor too)."""
    k = jnp.arange(cfg.block_size, dtype=jnp.int32)
    at = anchors[:, :, None] + jnp.maximum(k - cfg.first_draft_slot, 0)  # [B, nA, Q]
    B, nA, Q = at.shape
    return jnp.take_along_axis(tokens, at.reshape(B, nA * Q), axis=1).reshape(B, nA, Q)


def teacher_forced_logits(params: dict, cfg: DSparkConfig, hidden: jax.Array, prev: jax.Array):
    """hidden [N, Q, H], prev i32[N, Q] -> (the drafting slots' corrected logits f32[N, S, V],
    their confidence logits f32[N, S] or None)."""
    N, Q, _ = hidden.shape
    logits = dflash_logits(params, cfg, hidden)  # [N, Q, V]
    if cfg.markov_rank:
        state = jnp.zeros((N, cfg.markov_rank), jnp.float32)
        bias = []
        for k in range(Q):  # the rnn state runs over every slot (Q is small)
            b, state, _ = markov_bias(params, cfg, prev[:, k], hidden[:, k], state)
            bias.append(b)
        bias = jnp.stack(bias, axis=1)
        logits = logits + jnp.pad(bias, ((0, 0), (0, 0), (0, logits.shape[-1] - bias.shape[-1])))
    s = cfg.first_draft_slot
    conf = confidence_logits(params, cfg, hidden[:, s:], prev[:, s:]) if cfg.confidence_head else None
    return logits[:, s:], conf


@dataclasses.dataclass(frozen=True)
class DSparkMethod(DFlashMethod):
    """``jaxspec train-draft --method dspark``."""

    dcfg: DSparkConfig
    confidence_alpha: float = 1.0
    name = "dspark"
    metric_unit = "slot"

    def table(self):
        return dspark_table(self.dcfg)

    @property
    def span(self) -> int:
        """Tokens a block needs labels for past its anchor, as a DFlash block length."""
        return self.dcfg.block_size + 1 - self.dcfg.first_draft_slot

    def batch_extra(self, rng: np.random.Generator, batch: int, seq_len: int) -> dict:
        return {"anchors": sample_anchors(rng, batch, self.num_anchors, seq_len, self.span)}

    def eval_extra(self, count: int, seq_len: int) -> dict:
        a = np.linspace(1, seq_len - self.span + 2, self.num_anchors).round().astype(np.int32)
        return {"anchors": np.broadcast_to(a, (count, self.num_anchors)).copy()}

    def loss(self, params: dict, target_params: dict, tcfg, tokens: jax.Array, extra: dict):
        """tokens: i32[B, T+1] windows. Returns (loss, metrics: ``loss`` / ``acc`` per drafting slot
        f32[S], ``accept`` the blocks' mean greedy accept length, ``confidence_error`` the mean
        |sigmoid(confidence) - acceptance rate|)."""
        cfg = self.dcfg
        # [B, T+1, V] labels, [B, T, F] features
        t_logits, features = frozen_block_inputs(target_params, tcfg, tokens, cfg.target_layer_ids)
        anchors = extra["anchors"]
        B, nA = anchors.shape
        Q, s = cfg.block_size, cfg.first_draft_slot
        S = Q - s
        out = block_train_forward(params, cfg, features, tokens, anchors).reshape(B * nA, Q, -1)
        prev = slot_prev_tokens(tokens, anchors, cfg).reshape(B * nA, Q)
        logits, conf = teacher_forced_logits(params, cfg, out, prev)  # [B*nA, S, V], [B*nA, S]
        at = anchors[:, :, None] + jnp.arange(S, dtype=jnp.int32)  # l[a + k] labels the k-th drafting slot
        labels = jnp.take_along_axis(t_logits, at.reshape(B, nA * S)[:, :, None], axis=1).reshape(B * nA, S, -1)
        logp = jax.nn.log_softmax(logits, axis=-1)
        p = jax.nn.softmax(labels, axis=-1)
        top = jnp.argmax(labels, axis=-1)
        if self.label == "soft":
            ce = -jnp.sum(p * logp, axis=-1)  # [B*nA, S]
        else:
            ce = -jnp.take_along_axis(logp, top[..., None], axis=-1)[..., 0]
        w = jnp.asarray(position_weights(S + 1, self.gamma))  # exp(-k / gamma), k = 0..S-1
        per_slot = jnp.mean(ce, axis=0)  # [S]
        total = jnp.sum(w * per_slot) / jnp.sum(w)
        metrics = {}
        if conf is not None:
            rate = jax.lax.stop_gradient(jnp.sum(jnp.minimum(jnp.exp(logp), p), axis=-1))  # 1 - TV, [B*nA, S]
            bce = jnp.maximum(conf, 0) - conf * rate + jnp.log1p(jnp.exp(-jnp.abs(conf)))  # stable BCE with logits
            total = total + self.confidence_alpha * jnp.sum(w * jnp.mean(bce, axis=0)) / jnp.sum(w)
            metrics["confidence_error"] = jnp.mean(jnp.abs(jax.nn.sigmoid(conf) - rate))
        right = jnp.argmax(logits, axis=-1) == top  # [B*nA, S]
        accept = 1.0 + jnp.mean(jnp.sum(jnp.cumprod(right.astype(jnp.float32), axis=-1), axis=-1))
        return total, dict(metrics, loss=per_slot, acc=jnp.mean(right.astype(jnp.float32), axis=0), accept=accept)

    def full_params(self, trainable: dict, target_params: dict) -> dict:
        return shared_target_params(trainable, target_params)

    def draft(self, params: dict):
        return dspark_draft(self.dcfg, params)

    def eval_spec(self, depth: int | None = None) -> SpecConfig:
        return SpecConfig.chain(self.dcfg.num_speculative_tokens)

    def export(self, path: str, params: dict, target_cfg, dtype: str) -> None:
        export_speculators(path, params, self.dcfg, dtype=dtype)

    def describe(self, num_trainable: int) -> str:
        d = self.dcfg
        heads = f"{d.markov_head_type} Markov head of rank {d.markov_rank}" if d.markov_rank else "no Markov head"
        conf = ("a confidence head on [h, W1[prev]]" if d.confidence_with_markov else
                "a confidence head on h" if d.confidence_head else "no confidence head")
        return (f"DSpark draft: {d.num_layers} layers, hidden {d.hidden_size}, intermediate {d.intermediate_size}, "
                f"heads {d.num_heads}/{d.num_kv_heads}, block {d.block_size} ({d.num_speculative_tokens} draft tokens, "
                f"sample_from_anchor {str(d.sample_from_anchor).lower()}), taps {list(d.target_layer_ids)}, mask token "
                f"{d.mask_token_id}, {heads}, {conf}, {self.num_anchors} anchors/window, decay gamma {self.gamma:g}; "
                f"{num_trainable} trainable params")
