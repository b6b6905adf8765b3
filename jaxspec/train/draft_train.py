"""Training a draft for a loaded target (the engine of ``jaxspec train-draft``).

Each step samples windows from the tokenized corpus, runs the frozen target (dense forward)
for its features and logits, and updates the draft with its method's loss: EAGLE-3's TTT
loss (``Eagle3Method``, ``jaxspec.train.ttt``) or DFlash's block-parallel loss
(``jaxspec.train.dflash_method.DFlashMethod``). The target's embedding (and, for DFlash, its head) is
shared and frozen; everything else in the draft trains. Periodic reports give per-step (or
per-position) top-1 agreement on held-out windows and the mean accept length of a real
``jaxspec.generate`` chain on held-out prompts.
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

from jaxspec.config import SpecConfig
from jaxspec.model.drafts.eagle import EagleConfig, eagle3_config_for, eagle_draft
from jaxspec.model.checkpoints.eagle import eagle_table, export_eagle3
from jaxspec.model.checkpoints.name_tables import init_params
from jaxspec.model.layers import lm_head
from jaxspec.model.targets import Model
from jaxspec.train.corpus import fixed_windows, sample_windows
from jaxspec.train.forward import frozen_target_forward
from jaxspec.train.optim import OptimConfig, lr_at, make_optimizer, set_lr
from jaxspec.train.state import load_checkpoint, save_checkpoint
from jaxspec.train.ttt import chain_accept_estimate, ttt_loss
from jaxspec.train.vocab import build_draft_vocab, token_counts


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftTrainConfig:
    """How to train the head. ``steps`` or ``minutes`` (wall-time budget; the learning-rate
    schedule follows the elapsed fraction). ``ttt_steps``: simulated draft steps (>= 1;
    EAGLE-3 style training uses several). ``eval_spec_steps``: chain depth S of the
    generate-based accept-length report."""

    batch: int = 8
    seq_len: int = 256
    steps: int | None = 1000
    minutes: float | None = None
    ttt_steps: int = 5
    step_weight: float = 0.8
    label: str = "soft"
    draft_vocab_size: int | None = None
    intermediate_size: int | None = None
    eval_every: int = 100
    eval_windows: int = 16
    eval_prompts: int = 4
    eval_max_new_tokens: int = 64
    eval_spec_steps: int = 5
    self_distill_windows: int = 0
    self_distill_frac: float = 0.5
    self_distill_prompt: int | None = None  # corpus prefix length (None: seq_len // 4)
    checkpoint_every: int = 100
    seed: int = 0
    optim: OptimConfig = OptimConfig(lr=1e-3, warmup_steps=50, weight_decay=0.0)

    def __post_init__(self):
        if (self.steps is None) == (self.minutes is None):
            raise ValueError("DraftTrainConfig: give exactly one of steps and minutes")
        if self.ttt_steps < 1:
            raise ValueError(f"DraftTrainConfig.ttt_steps must be >= 1, got {self.ttt_steps}")
        if self.label not in ("soft", "greedy"):
            raise ValueError(f"DraftTrainConfig.label must be 'soft' or 'greedy', got {self.label!r}")
        if self.seq_len < 2 or self.batch < 1:
            raise ValueError("DraftTrainConfig: seq_len must be >= 2 and batch >= 1")
        if not 0 <= self.self_distill_frac <= 1:
            raise ValueError(f"DraftTrainConfig.self_distill_frac must be in [0, 1], got {self.self_distill_frac}")
        if self.self_distill_prompt is not None and not 1 <= self.self_distill_prompt < self.seq_len:
            raise ValueError("DraftTrainConfig.self_distill_prompt must be in [1, seq_len)")


def target_features(target_params: dict, tcfg, aux_layers, tokens):
    """Frozen target over ``tokens: i32[B, T+1]``: (aux [B, T, F] at rows 0..T-1,
    logits f32[B, T, V] at positions 1..T, i.e. l[p+1] for row p)."""
    hidden, aux = frozen_target_forward(target_params, tcfg, tokens, aux_layers=aux_layers)
    logits = lm_head(target_params, hidden[:, 1:])
    return jax.lax.stop_gradient(aux[:, :-1]), jax.lax.stop_gradient(logits)


@dataclasses.dataclass(frozen=True)
class Eagle3Method:
    """EAGLE-3 training-time test: what the generic trainer needs (static, hashable)."""

    dcfg: EagleConfig
    ttt_steps: int = 5
    step_weight: float = 0.8
    label: str = "soft"
    name = "eagle3"
    metric_unit = "step"

    def table(self):
        return eagle_table(self.dcfg)

    def batch_extra(self, rng: np.random.Generator, batch: int, seq_len: int) -> dict:
        return {}

    def eval_extra(self, count: int, seq_len: int) -> dict:
        return {}

    def loss(self, params: dict, target_params: dict, tcfg, tokens: jax.Array, extra: dict):
        aux, logits = target_features(target_params, tcfg, self.dcfg.aux_layers, tokens)
        mask = jnp.ones(logits.shape[:2], bool)
        return ttt_loss(params, self.dcfg, tokens[:, 1:], aux.astype(jnp.float32), logits, mask,
                        num_steps=self.ttt_steps, step_weight=self.step_weight, label=self.label)

    def estimate(self, metrics: dict) -> float:
        return chain_accept_estimate(metrics["acc"])

    def full_params(self, trainable: dict, target_params: dict) -> dict:
        return dict(trainable, embed=target_params["embed"])

    def draft(self, params: dict):
        return eagle_draft(self.dcfg, params)

    def eval_spec(self, depth: int) -> SpecConfig:
        return SpecConfig.chain(depth)

    def export(self, path: str, params: dict, target_cfg, dtype: str) -> None:
        export_eagle3(path, params, self.dcfg, target_num_layers=target_cfg.num_layers, dtype=dtype)

    def describe(self, num_trainable: int) -> str:
        d = self.dcfg
        return (f"head: hidden {d.hidden_size}, intermediate {d.intermediate_size}, heads {d.num_heads}/{d.num_kv_heads}, "
                f"draft vocab {d.draft_vocab_size}/{d.vocab_size}, taps {d.aux_layers}; {num_trainable} trainable params")


def _batch_loss(trainable, frozen, target_params, tcfg, method, tokens, extra):
    return method.loss(dict(trainable, **frozen), target_params, tcfg, tokens, extra)


@functools.partial(jax.jit, static_argnames=("tcfg", "method", "opt"), donate_argnames=("trainable", "opt_state"))
def draft_train_step(tcfg, method, opt, trainable, opt_state, frozen, target_params, tokens, extra, lr):
    (loss, metrics), grads = jax.value_and_grad(_batch_loss, has_aux=True)(
        trainable, frozen, target_params, tcfg, method, tokens, extra
    )
    opt_state = set_lr(opt_state, lr)
    updates, opt_state = opt.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state, loss, metrics


@functools.partial(jax.jit, static_argnames=("tcfg", "method"))
def draft_eval_step(tcfg, method, trainable, frozen, target_params, tokens, extra):
    return _batch_loss(trainable, frozen, target_params, tcfg, method, tokens, extra)


def greedy_windows(target: Model, stream: np.ndarray, count: int, length: int, prompt_len: int,
                   rng: np.random.Generator, batch: int = 16, log=print) -> np.ndarray:
    """``count`` windows of ``length`` tokens: a ``prompt_len``-token corpus prefix followed by
    the target's own greedy continuation (the text a draft sees at inference). i32[count, length]."""
    import jaxspec as js

    prompts = sample_windows(stream, count, prompt_len, rng)
    new = length - prompt_len
    out = []
    bar = tqdm(total=count, desc="self-distill data", unit="window", dynamic_ncols=True)
    for i in range(0, count, batch):
        chunk = [p.tolist() for p in prompts[i:i + batch]]
        res = js.generate(target, chunk, sampling=js.SamplingParams(max_new_tokens=new, stop_token_ids=()),
                          engine=js.EngineConfig(max_batch=batch, max_seq_len=length + 16), progress=False)
        out.extend(p + t for p, t in zip(chunk, res.token_ids))
        bar.update(len(chunk))
    bar.close()
    return np.asarray(out, np.int32)


def head_config(target: Model, cfg: DraftTrainConfig) -> EagleConfig:
    return eagle3_config_for(target.config, draft_vocab_size=cfg.draft_vocab_size,
                             intermediate_size=cfg.intermediate_size)


def eagle3_method(target: Model, cfg: DraftTrainConfig) -> Eagle3Method:
    return Eagle3Method(head_config(target, cfg), cfg.ttt_steps, cfg.step_weight, cfg.label)


class DraftTrainer:
    """Holds the draft's params and optimizer state; ``run()`` trains, reports and exports.

    Args:
      target: the loaded target (float32 params recommended for training).
      train_stream: i32[N] training tokens (documents separated by eos).
      eval_stream: i32[M] held-out tokens for agreement reports, or None.
      eval_prompts: held-out token-id prompts for the generate-based report, or [].
      cfg: training settings.
      out_dir: where the exported head goes (config.json + model.safetensors).
      run_dir: checkpoints (resumed automatically when present).
      method: what is trained and how (``Eagle3Method`` by default, or a
        ``jaxspec.train.dflash_method.DFlashMethod``).
      init_from: a draft checkpoint whose arrays of the same name and shape start the training
        (e.g. a DFlash draft's backbone for a DSpark draft); ignored when resuming.
    """

    def __init__(self, target: Model, train_stream, eval_stream, eval_prompts, cfg: DraftTrainConfig,
                 out_dir: str, run_dir: str | None = None, log=print, method=None, init_from: str | None = None):
        self.target, self.cfg, self.out_dir, self.run_dir, self.log = target, cfg, out_dir, run_dir, log
        self.train_stream = np.asarray(train_stream, np.int32)
        self.eval_prompts = list(eval_prompts)
        self.method = method or eagle3_method(target, cfg)
        self.dcfg = self.method.dcfg
        self.trainable = init_params(self.method.table(), cfg.seed)  # the target's arrays are shared, frozen
        self.target_params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), target.params)
        self.frozen = self.method.full_params({}, self.target_params)
        self.shared = set(self.frozen)  # the target's own arrays (embedding, head), not the draft's
        V, Vd = self.dcfg.vocab_size, getattr(self.dcfg, "draft_vocab_size", self.dcfg.vocab_size)
        if Vd != V:
            _, _, hot = build_draft_vocab(token_counts(self.train_stream, V), Vd)
            self.frozen["hot_ids"] = jnp.asarray(hot)
        self.opt = make_optimizer(cfg.optim)
        self.opt_state = self.opt.init(self.trainable)
        self.step, self.elapsed = 0, 0.0
        self.history: list[dict] = []
        self.eval_set = None
        if eval_stream is not None and len(eval_stream) > cfg.seq_len + 1:
            self.eval_set = jnp.asarray(fixed_windows(np.asarray(eval_stream), cfg.eval_windows, cfg.seq_len + 1))
        if run_dir and os.path.exists(os.path.join(run_dir, "checkpoint", "meta.json")):
            self._resume()
        elif init_from is not None:
            self._warm_start(init_from)
        self.distill = None
        if cfg.self_distill_windows:
            path = os.path.join(run_dir, "self_distill.npy") if run_dir else None
            if path and os.path.exists(path):
                self.distill = np.load(path)
            else:
                t = time.perf_counter()
                self.distill = greedy_windows(target, self.train_stream, cfg.self_distill_windows, cfg.seq_len + 1,
                                              cfg.self_distill_prompt or max(1, cfg.seq_len // 4),
                                              np.random.default_rng([cfg.seed, 1]))
                log(f"self-distillation: {len(self.distill)} windows of target greedy text "
                    f"[{time.perf_counter() - t:.0f}s]")
                if path:
                    np.save(path, self.distill)

    # ------------------------------------------------------------------------ state
    def _tree(self):
        return dict(trainable=self.trainable, opt_state=self.opt_state,
                    vocab={k: v for k, v in self.frozen.items() if k == "hot_ids"})

    def _resume(self):
        path = os.path.join(self.run_dir, "checkpoint")
        tree, meta = load_checkpoint(path, self._tree())
        self.trainable, self.opt_state = tree["trainable"], tree["opt_state"]
        self.frozen.update(tree["vocab"])
        self.step, self.elapsed, self.history = meta["step"], meta["elapsed_s"], meta.get("history", [])
        self.log(f"resumed from {path} at step {self.step}")

    def _warm_start(self, path: str) -> None:
        """Copies the arrays of the draft at ``path`` that this one has too (same path, same shape)."""
        import jaxspec as js

        donor = js.load_draft(path, self.target, dtype="float32").params
        flat, taken = dict(jax.tree_util.tree_leaves_with_path(self.trainable)), []

        def pick(keypath, x):
            node = donor
            for k in keypath:
                node = node.get(k.key) if isinstance(node, dict) else None
            if node is not None and getattr(node, "shape", None) == x.shape:
                taken.append(jax.tree_util.keystr(keypath))
                return jnp.asarray(node, x.dtype)
            return x

        self.trainable = jax.tree_util.tree_map_with_path(pick, self.trainable)
        self.opt_state = self.opt.init(self.trainable)
        self.log(f"initialized {len(taken)} of {len(flat)} arrays from {path} (the rest random)")

    def save(self):
        if self.run_dir:
            save_checkpoint(os.path.join(self.run_dir, "checkpoint"), self._tree(),
                            dict(step=self.step, elapsed_s=self.elapsed, history=self.history))

    def params(self) -> dict:
        """Full draft params (its kind's layout), the target's arrays shared."""
        return dict(self.trainable, **{k: v for k, v in self.frozen.items()})

    def export(self, dtype: str = "float32") -> None:
        self.method.export(self.out_dir, self.params(), self.target.config, dtype)

    def draft(self):
        """The draft as a ``DraftModel`` for ``jaxspec.generate`` (in the target's dtype)."""
        dt = jnp.dtype(self.target.dtype)
        cast = lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
        own = {k: v for k, v in self.params().items() if k not in self.shared}
        return self.method.draft(self.method.full_params(jax.tree.map(cast, own), self.target.params))

    # ------------------------------------------------------------------------ reports
    def evaluate(self) -> dict:
        """Held-out TTT metrics and a real speculative run (chain S = eval_spec_steps)."""
        cfg = self.cfg
        out: dict = dict(step=self.step)
        if self.eval_set is not None:
            runs = []
            for i in range(0, len(self.eval_set), cfg.batch):
                tokens = self.eval_set[i:i + cfg.batch]
                extra = {k: jnp.asarray(v) for k, v in self.method.eval_extra(len(tokens), cfg.seq_len).items()}
                _, m = draft_eval_step(self.target.config, self.method, self.trainable, self.frozen,
                                       self.target_params, tokens, extra)
                runs.append(jax.device_get(m))
            m = {k: np.mean([r[k] for r in runs], axis=0) for k in runs[0]}
            out.update(eval_acc=[round(float(a), 4) for a in m["acc"]], eval_loss=[round(float(x), 4) for x in m["loss"]],
                       est_accept_len=round(self.method.estimate(m), 3))
            if "confidence_error" in m:  # DSpark: |predicted - analytic acceptance rate|
                out["confidence_error"] = round(float(m["confidence_error"]), 4)
        if self.eval_prompts:
            import jaxspec as js

            res = js.generate(
                self.target, self.eval_prompts, draft=self.draft(), spec=self.method.eval_spec(cfg.eval_spec_steps),
                sampling=js.SamplingParams(max_new_tokens=cfg.eval_max_new_tokens, stop_token_ids=()),
                engine=js.EngineConfig(page_size=16, max_batch=len(self.eval_prompts),
                                       max_seq_len=max(map(len, self.eval_prompts)) + cfg.eval_max_new_tokens + 16),
                progress=False,
            )
            out["accept_len"] = round(res.mean_accept_len, 3)
        return out

    def _report(self, train_loss, train_acc):
        ev = self.evaluate()
        ev.update(train_loss=round(float(train_loss), 4), train_acc=[round(float(a), 4) for a in train_acc],
                  seconds=round(self.elapsed, 1))
        self.history.append(ev)
        unit = self.method.metric_unit
        msg = f"step {self.step}: train loss {ev['train_loss']:.4f} acc/{unit} {ev['train_acc']}"
        if "eval_acc" in ev:
            msg += f" | held-out acc/{unit} {ev['eval_acc']} (est. accept {ev['est_accept_len']:.2f})"
        if "confidence_error" in ev:
            msg += f", confidence error {ev['confidence_error']:.3f}"
        if "accept_len" in ev:
            depth = self.method.eval_spec(self.cfg.eval_spec_steps).num_steps
            msg += f" | generate chain S={depth} mean accept length {ev['accept_len']:.2f}"
        self.log(msg)

    # ------------------------------------------------------------------------ loop
    def _batch(self, rng: np.random.Generator) -> np.ndarray:  # i32[batch, seq_len + 1]
        cfg = self.cfg
        n = 0 if self.distill is None else int(round(cfg.self_distill_frac * cfg.batch))
        parts = [sample_windows(self.train_stream, cfg.batch - n, cfg.seq_len + 1, rng)] if n < cfg.batch else []
        if n:
            parts.append(self.distill[rng.integers(0, len(self.distill), n)])
        return np.concatenate(parts)

    def run(self, export_dtype: str = "float32") -> dict:
        cfg = self.cfg
        budget = None if cfg.minutes is None else cfg.minutes * 60
        rng = np.random.default_rng([cfg.seed, self.step])
        t_start = time.perf_counter() - self.elapsed

        def progress():
            return (time.perf_counter() - t_start) / budget if budget is not None else self.step / cfg.steps

        bar = tqdm(total=cfg.steps, initial=self.step, desc="train-draft", unit="step", dynamic_ncols=True)
        ema_loss, ema_acc = None, None
        while progress() < 1.0:
            tokens = jnp.asarray(self._batch(rng))
            extra = {k: jnp.asarray(v) for k, v in self.method.batch_extra(rng, len(tokens), cfg.seq_len).items()}
            lr = lr_at(cfg.optim, self.step, progress())
            self.trainable, self.opt_state, loss, metrics = draft_train_step(
                self.target.config, self.method, self.opt, self.trainable, self.opt_state, self.frozen,
                self.target_params, tokens, extra, jnp.float32(lr),
            )
            self.step += 1
            self.elapsed = time.perf_counter() - t_start
            loss, acc = float(loss), np.asarray(metrics["acc"])
            ema_loss = loss if ema_loss is None else 0.95 * ema_loss + 0.05 * loss
            ema_acc = acc if ema_acc is None else 0.95 * ema_acc + 0.05 * acc
            bar.update(1)
            bar.set_postfix(loss=f"{ema_loss:.3f}", acc0=f"{ema_acc[0]:.2f}", lr=f"{lr:.1e}")
            done = progress() >= 1.0
            if self.step % cfg.eval_every == 0 or done:
                self._report(ema_loss, ema_acc)
            if self.step % cfg.checkpoint_every == 0 or done:
                self.save()
                self.export(export_dtype)
        bar.close()
        return dict(steps=self.step, seconds=self.elapsed, history=self.history,
                    final=self.history[-1] if self.history else None)
