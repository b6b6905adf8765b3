"""Next-token training of a Llama-family LM (used to train the demo target).

``train_lm`` samples random windows from a token stream, steps AdamW, reports held-out loss,
checkpoints (and resumes), and returns the final params. Export with
``jaxspec.model.checkpoints.llama.export_llama``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from jaxspec.model.checkpoints.llama import init_llama_params
from jaxspec.model.layers import lm_head
from jaxspec.model.targets.llama_config import LlamaConfig
from jaxspec.train.corpus import fixed_windows, sample_windows
from jaxspec.train.forward import dense_forward
from jaxspec.train.optim import OptimConfig, lr_at, make_optimizer, set_lr
from jaxspec.train.state import load_checkpoint, save_checkpoint


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMTrainConfig:
    """steps: total optimizer steps; or None to size the run by wall time: train for
    ``minutes`` with the learning-rate schedule following the elapsed fraction of the
    budget (robust to a machine whose load changes during the run)."""

    batch: int = 8
    seq_len: int = 256
    steps: int | None = 1000
    minutes: float | None = None
    eval_every: int = 100
    eval_windows: int = 32
    checkpoint_every: int = 100
    seed: int = 0
    init_scale: float = 0.02
    optim: OptimConfig = OptimConfig()

    def __post_init__(self):
        if (self.steps is None) == (self.minutes is None):
            raise ValueError("LMTrainConfig: give exactly one of steps and minutes")


def lm_loss(params: dict, cfg: LlamaConfig, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy over ``tokens: i32[B, T + 1]``."""
    hidden, _ = dense_forward(params, cfg, tokens[:, :-1])
    logits = lm_head(params, hidden)  # f32[B, T, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@functools.partial(jax.jit, static_argnames=("cfg", "opt"), donate_argnames=("params", "opt_state"))
def lm_train_step(cfg: LlamaConfig, opt, params, opt_state, tokens, lr):
    loss, grads = jax.value_and_grad(lm_loss)(params, cfg, tokens)
    opt_state = set_lr(opt_state, lr)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@functools.partial(jax.jit, static_argnames=("cfg",))
def lm_eval_loss(cfg: LlamaConfig, params, tokens):
    return lm_loss(params, cfg, tokens)


def train_lm(
    cfg: LlamaConfig,
    train_stream: np.ndarray,  # i32[N] tokens
    eval_stream: np.ndarray | None,  # i32[M] held-out tokens
    tcfg: LMTrainConfig,
    *,
    run_dir: str | None = None,
    log=print,
) -> tuple[dict, dict]:
    """Trains an LM from scratch (or resumes from ``run_dir/checkpoint``); returns (params, summary)."""
    opt = make_optimizer(tcfg.optim)
    params = init_llama_params(cfg, tcfg.seed, scale=tcfg.init_scale)
    opt_state = opt.init(params)
    step, total, elapsed = 0, tcfg.steps, 0.0
    ckpt = os.path.join(run_dir, "checkpoint") if run_dir else None
    if ckpt and os.path.exists(os.path.join(ckpt, "meta.json")):
        (params, opt_state), meta = load_checkpoint(ckpt, (params, opt_state))
        step, total, elapsed = meta["step"], meta["total_steps"], meta["elapsed_s"]
        log(f"resumed from {ckpt} at step {step}/{total}")
    rng = np.random.default_rng([tcfg.seed, step])
    eval_set = None
    if eval_stream is not None and len(eval_stream) > tcfg.seq_len + 1:
        eval_set = jnp.asarray(fixed_windows(eval_stream, tcfg.eval_windows, tcfg.seq_len + 1))

    def evaluate():
        if eval_set is None:
            return float("nan")
        return float(np.mean([lm_eval_loss(cfg, params, eval_set[i:i + tcfg.batch])
                              for i in range(0, len(eval_set), tcfg.batch)]))

    history = []
    budget = None if tcfg.minutes is None else tcfg.minutes * 60
    bar = tqdm(total=total, initial=step, desc="train-lm", unit="step", dynamic_ncols=True)
    t_start = time.perf_counter() - elapsed
    loss_ema = None

    def progress() -> float:
        if budget is not None:
            return (time.perf_counter() - t_start) / budget
        return step / total

    while progress() < 1.0:
        batch = jnp.asarray(sample_windows(train_stream, tcfg.batch, tcfg.seq_len + 1, rng))
        lr = lr_at(tcfg.optim, step, progress())
        params, opt_state, loss = lm_train_step(cfg, opt, params, opt_state, batch, jnp.float32(lr))
        step += 1
        loss = float(loss)
        loss_ema = loss if loss_ema is None else 0.98 * loss_ema + 0.02 * loss
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{lr:.2e}")
        done = progress() >= 1.0
        if step % tcfg.eval_every == 0 or done:
            ev = evaluate()
            history.append(dict(step=step, train_loss=loss_ema, eval_loss=ev, seconds=time.perf_counter() - t_start))
            log(f"step {step}: train loss {loss_ema:.4f}  held-out loss {ev:.4f}  "
                f"({time.perf_counter() - t_start:.0f}s)")
        if ckpt and (step % tcfg.checkpoint_every == 0 or done):
            save_checkpoint(ckpt, (params, opt_state),
                            dict(step=step, total_steps=total, elapsed_s=time.perf_counter() - t_start))
    bar.close()
    summary = dict(steps=step, tokens=step * tcfg.batch * tcfg.seq_len, seconds=time.perf_counter() - t_start,
                   history=history, final_train_loss=loss_ema, final_eval_loss=history[-1]["eval_loss"] if history else None)
    return params, summary
