"""EAGLE-3 training-time test (TTT): the head unrolled over simulated draft steps.

A training window has tokens ``x[0..T]``; the frozen target gives features ``f[p]`` (its aux
taps at ``p``) and logits ``l[p]`` (its prediction for ``x[p+1]``). Every step has T rows,
row ``p`` sitting at position ``p`` and consuming the token ``x[p+1]``:

* step 0, row p: (target feature f[p], x[p+1])  -- what draft-extend computes;
* step k >= 1, row p: (the head's own step-(k-1) output at row p-1, x[p+1])  -- draft step k
  of a chain rooted at position p - k.

Row p of every step predicts the token at p + 2, labelled by ``l[p+1]``. Step-k row p
attends to the step-0 keys at positions <= p - k (the extend prefix) and to the step-j key
at position p - k + j for j = 1..k (its own chain so far), exactly the draft KV it would
see at inference (``jaxspec.spec.step``: ``draft_extend`` then ``draft_propose``). Rows
p < k have no such chain and carry no loss.

Glossary: B windows, T rows, H head width, F target feature width, V target vocabulary,
Vd draft vocabulary, K steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.model.drafts.eagle import EagleConfig, eagle_attention_input, eagle_logits
from jaxspec.model.layers import layer_tail, project_qkv, rope_inv_freq
from jaxspec.train.forward import dense_attention


def ttt_mask(T: int, step: int) -> np.ndarray:  # bool[T, (step + 1) * T]
    """Visibility of step ``step``'s rows over the keys of steps 0..step (concatenated)."""
    p = np.arange(T)[:, None]
    q = np.arange(T)[None, :]
    blocks = [q <= p - step] + [q == p - step + j for j in range(1, step + 1)]
    return np.concatenate(blocks, axis=1)


def ttt_forward(
    params: dict,
    cfg: EagleConfig,
    next_tokens: jax.Array,  # i32[B, T] x[p+1] for row p
    features: jax.Array,  # [B, T, F] target aux features f[p]
    num_steps: int,
) -> list[jax.Array]:  # num_steps x [B, T, H] pre-norm head outputs
    """Runs the head for ``num_steps`` simulated draft steps (``eagle_forward``'s layer body with
    dense attention over the TTT mask). ``params`` in ``jaxspec.model.drafts.eagle`` layout."""
    if cfg.version != 3:
        raise ValueError("ttt_forward trains EAGLE-3 heads")
    B, T = next_tokens.shape
    lp = params["layer"]
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    keys, values, outs = [], [], []
    h, from_target = features, True  # step 0: target features through fc
    for k in range(num_steps):
        if k > 0:  # row p continues from the previous step's row p - 1
            h, from_target = jnp.pad(outs[-1][:, :-1], ((0, 0), (1, 0), (0, 0))), False
        a, residual = eagle_attention_input(params, cfg, next_tokens, h, from_target=from_target)  # [B, T, 2H]
        q, k_new, v_new = project_qkv(lp, cfg, a, positions, inv_freq)
        keys.append(k_new)
        values.append(v_new)
        o = dense_attention(q, jnp.concatenate(keys, 1), jnp.concatenate(values, 1), jnp.asarray(ttt_mask(T, k)))
        outs.append(layer_tail(lp, cfg, residual, o))
    return outs


def ttt_loss(
    params: dict,
    cfg: EagleConfig,
    next_tokens: jax.Array,  # i32[B, T]
    features: jax.Array,  # [B, T, F]
    target_logits: jax.Array,  # f32[B, T, V] l[p+1] for row p
    row_mask: jax.Array,  # bool[B, T] rows that carry a loss
    *,
    num_steps: int,
    step_weight: float = 0.8,
    label: str = "soft",
) -> tuple[jax.Array, dict]:
    """Weighted TTT loss (step k weighs ``step_weight**k``) and per-step metrics.

    label "soft": cross-entropy to the target's distribution restricted to the draft
    vocabulary; "greedy": cross-entropy to the target's argmax. Rows whose target argmax is
    outside the draft vocabulary cannot be drafted and carry no loss (as in EAGLE-3).
    Metrics: ``acc`` f32[K] top-1 agreement of the (mapped) draft argmax with the target's
    argmax, over all valid rows; ``loss`` f32[K].
    """
    outs = ttt_forward(params, cfg, next_tokens, features, num_steps)
    hot = params.get("hot_ids")
    t_logits = target_logits if hot is None else target_logits[..., hot]  # [B, T, Vd]
    t_top = jnp.argmax(target_logits, axis=-1)  # [B, T] target ids
    if hot is None:
        in_vocab = jnp.ones_like(row_mask)
        t_top_draft = t_top
    else:
        t2d = jnp.zeros((cfg.vocab_size,), bool).at[hot].set(True)
        in_vocab = t2d[t_top]
        t_top_draft = jnp.argmax(t_logits, axis=-1)  # the same token, as a draft id, when in_vocab
    t_probs = jax.nn.softmax(t_logits, axis=-1)
    total = jnp.float32(0.0)
    losses, accs = [], []
    rows = jnp.arange(next_tokens.shape[1])[None, :]
    for k, out in enumerate(outs):
        logits = eagle_logits(params, cfg, out)  # f32[B, T, Vd]
        logp = jax.nn.log_softmax(logits, axis=-1)
        if label == "soft":
            ce = -jnp.sum(t_probs * logp, axis=-1)
        elif label == "greedy":
            ce = -jnp.take_along_axis(logp, t_top_draft[..., None], axis=-1)[..., 0]
        else:
            raise ValueError(f"label must be 'soft' or 'greedy', got {label!r}")
        valid = row_mask & (rows >= k)
        m = (valid & in_vocab).astype(jnp.float32)
        loss_k = jnp.sum(ce * m) / jnp.maximum(jnp.sum(m), 1.0)
        pred = jnp.argmax(logits, axis=-1)
        pred = pred if hot is None else hot[pred]
        vf = valid.astype(jnp.float32)
        acc_k = jnp.sum((pred == t_top) * vf) / jnp.maximum(jnp.sum(vf), 1.0)
        total = total + (step_weight**k) * loss_k
        losses.append(loss_k)
        accs.append(acc_k)
    return total, dict(loss=jnp.stack(losses), acc=jnp.stack(accs))


def chain_accept_estimate(acc: np.ndarray) -> float:
    """Expected tokens per step of a chain from per-step agreement rates, treating step k's
    rate as the probability that draft k is right given drafts < k were (a rough proxy for
    the measured mean accept length): 1 + a0 + a0 a1 + ..."""
    out, run = 1.0, 1.0
    for a in np.asarray(acc, np.float64):
        run *= a
        out += run
    return float(out)
