"""Optimizer and learning-rate schedule shared by the LM and draft-head trainers.

The learning rate is an injected hyperparameter set from the host every step, so a run
can be sized by wall time (the total step count is fixed once throughput is measured) and
resumed at any step with the same schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay to ``final_lr_frac * lr``."""

    lr: float = 1e-3
    warmup_steps: int = 50
    final_lr_frac: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"OptimConfig.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.final_lr_frac <= 1:
            raise ValueError(f"OptimConfig.final_lr_frac must be in [0, 1], got {self.final_lr_frac}")


@functools.cache
def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Cached per config, so jitted steps that take the optimizer as a static argument
    compile once per config (e.g. across a resume in the same process)."""
    adamw = optax.inject_hyperparams(optax.adamw)(
        learning_rate=cfg.lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay
    )
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)


def lr_at(cfg: OptimConfig, step: int, progress: float) -> float:
    """Learning rate for (0-based) ``step`` when ``progress`` (in [0, 1]) of the run is done:
    linear warmup over the first ``warmup_steps`` steps, then cosine decay in ``progress``
    (the fraction of steps, or of the wall-time budget, that has elapsed)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(max(progress, 0.0), 1.0)
    cos = 0.5 * (1 + math.cos(math.pi * frac))
    return cfg.lr * (cfg.final_lr_frac + (1 - cfg.final_lr_frac) * cos)


def set_lr(opt_state, lr):
    """Returns ``opt_state`` (from ``make_optimizer``) with its learning rate set to ``lr``
    (a float or a traced scalar: usable inside a jitted step)."""
    clip_state, adam_state = opt_state
    hp = dict(adam_state.hyperparams)
    hp["learning_rate"] = jnp.asarray(lr, jnp.asarray(hp["learning_rate"]).dtype)
    return (clip_state, adam_state._replace(hyperparams=hp))
