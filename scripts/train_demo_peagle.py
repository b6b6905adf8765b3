#!/usr/bin/env python
"""Trains the demo P-EAGLE head (demo/peagle) for the demo target (demo/target) with the
``speculators`` library's own ``PEagleDraftModel`` and training forward, and checks it with jaxspec.

Three subcommands, two Python environments (jaxspec's venv has no torch; the torch venv has no jaxspec):

    # 1. data (jaxspec venv): the training split of the Python stdlib tokenized with demo/target's
    #    tokenizer, the target's own greedy continuations of training-file prefixes (self-distillation),
    #    the held-out split for reports, the mask token -> runs/demo_peagle/*.npy, meta.json
    PYTHONPATH=. .venv/bin/python scripts/train_demo_peagle.py prep
    # 2. training (torch venv: torch, transformers, speculators 0.9.0), time-budgeted, resumable from
    #    runs/demo_peagle/checkpoint.pt; exports demo/peagle at the end
    nice -n 10 TORCHVENV/bin/python scripts/train_demo_peagle.py train --minutes 60
    # 3. check (jaxspec venv): demo/peagle loads, its chain equals plain greedy output on held-out
    #    prompts, mean accept length next to demo/eagle3's on the same prompts
    PYTHONPATH=. .venv/bin/python scripts/train_demo_peagle.py check

What ``train`` does: the head is ``PEagleDraftModel.from_training_args`` with one Llama layer of the
target's shape (hidden 192, MLP 512, heads 3/1 of width 64), taps (2, 4, 5) (HF ``hidden_states``
indices, as demo/eagle3's), ``num_depths`` 8, ``norm_before_residual`` (the library's training
default), a draft vocabulary of 2048 (``d2t`` / ``t2d`` from the library's
``build_vocab_mappings_from_distribution`` over the training tokens), the mask token the rarest
training token (as demo/dflash's; the tokenizer has no mask token of its own), and its own
embedding, initialised from the target's and trained (P-EAGLE's ``embed_requires_grad``); its
``lm_head`` is the target's head over the draft vocabulary, frozen, as the library loads it.
Each step takes ``--docs`` windows of 257 tokens (half the target's greedy text, half corpus
text), runs the target (HF ``LlamaForCausalLM``, float32) over them for its hidden states, and
calls the library's forward once per window (one document: its COD sampling of the parallel
depths, its mask, its KL loss to the target's logits), aligned as the library's ``shift_batch``
aligns its data (row p: the token at p + 1, the target's features at p, its last hidden state at
p + 1); the gradients of the windows are averaged, then one Adam step (learning rate warmed up,
then cosine over the wall-time budget). Checkpoints (head, optimizer, step, elapsed time, RNG
state) every ``--checkpoint-every`` steps; rerunning resumes, with the same budget, until the
elapsed training time reaches it. Export: ``save_pretrained`` in bfloat16 to demo/peagle, the
library's config module it copies beside the weights deleted, the verifier's path made relative
("../target").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "demo" / "target"
OUT = REPO / "demo" / "peagle"
RUN = REPO / "runs" / "demo_peagle"
SEQ = 256  # rows per window (windows hold SEQ + 1 tokens)
PROMPT = 64  # corpus prefix of a self-distillation window
TAPS = [2, 4, 5]
DEPTHS = 8
DRAFT_VOCAB = 2048


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------- prep (jaxspec)


def prep(args) -> None:
    import jaxspec as js
    from jaxspec.train.corpus import stdlib_files, tokenize_files
    from jaxspec.train.dflash_method import least_frequent_token
    from jaxspec.train.draft_train import greedy_windows

    RUN.mkdir(parents=True, exist_ok=True)
    target = js.load_model(str(TARGET), dtype="float32")
    eos = int(target.eos_token_ids[0])  # as jaxspec train-draft separates files
    train_files, held = stdlib_files("train"), stdlib_files("heldout")
    stream = tokenize_files(target.tokenizer, train_files, eos)
    held_stream = tokenize_files(target.tokenizer, held, eos)
    np.save(RUN / "train_stream.npy", stream)
    np.save(RUN / "heldout_stream.npy", held_stream)
    log(f"{len(train_files)} training files, {len(stream)} tokens; {len(held)} held-out files, "
        f"{len(held_stream)} tokens")
    path = RUN / "self_distill.npy"
    if path.exists():
        distill = np.load(path)
        log(f"reusing {path} ({len(distill)} windows)")
    else:
        t = time.perf_counter()
        distill = greedy_windows(target, stream, args.self_distill, SEQ + 1, PROMPT, np.random.default_rng([args.seed, 1]),
                                 log=log)
        np.save(path, distill)
        log(f"self-distillation: {len(distill)} windows of {SEQ + 1} tokens ({PROMPT}-token corpus prefix, "
            f"the target's greedy continuation) in {time.perf_counter() - t:.0f} s")
    mask = least_frequent_token(stream, target.config.vocab_size, avoid=(eos,))
    meta = {"eos": eos, "mask_token_id": mask, "train_files": len(train_files), "train_tokens": int(len(stream)),
            "heldout_files": len(held), "heldout_tokens": int(len(held_stream)),
            "self_distill_windows": int(len(distill)), "seq_len": SEQ, "prompt_len": PROMPT}
    (RUN / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    log(f"mask token {mask}; wrote {RUN}")


# ---------------------------------------------------------------------------------------------- train (torch)


def build_draft(meta: dict, counts: np.ndarray):
    import torch
    from speculators.models.peagle import PEagleDraftModel
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoConfig, LlamaConfig

    tcfg = AutoConfig.from_pretrained(TARGET)
    layer = LlamaConfig(vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size,
                        intermediate_size=tcfg.intermediate_size, num_hidden_layers=1,
                        num_attention_heads=tcfg.num_attention_heads, num_key_value_heads=tcfg.num_key_value_heads,
                        head_dim=tcfg.head_dim, rms_norm_eps=tcfg.rms_norm_eps, rope_parameters=dict(tcfg.rope_parameters),
                        max_position_embeddings=tcfg.max_position_embeddings)
    freq = {int(t): int(c) for t, c in enumerate(counts) if c > 0}
    d2t, t2d = build_vocab_mappings_from_distribution(freq, DRAFT_VOCAB, tcfg.vocab_size)
    draft = PEagleDraftModel.from_training_args(
        layer, t2d=t2d, d2t=d2t, verifier_name_or_path=str(TARGET), draft_vocab_size=DRAFT_VOCAB,
        target_layer_ids=TAPS, num_depths=DEPTHS, mask_token_id=meta["mask_token_id"], norm_before_residual=True,
        draft_attn_impl="eager")
    return draft.float()


def sample_windows(stream: np.ndarray, count: int, length: int, rng: np.random.Generator) -> np.ndarray:
    starts = rng.integers(0, len(stream) - length, size=count)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int64)


def fixed_windows(stream: np.ndarray, count: int, length: int) -> np.ndarray:
    starts = np.linspace(0, len(stream) - length, num=count).astype(np.int64)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int64)


def target_states(target, ids):
    """The target over windows ids [N, SEQ + 1]: (features [N, SEQ + 1, 3H] at the taps, the last
    layer's output before the final norm [N, SEQ + 1, H])."""
    import torch

    seen = []
    hook = target.model.norm.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    try:
        with torch.no_grad():
            hs = target(ids, output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return torch.cat([hs[a] for a in TAPS], dim=-1), seen[0]


def window_loss(draft, feats, last, ids, loss_cfg):
    """The library's training forward on one window (one document), aligned as its ``shift_batch``."""
    import torch

    T = ids.shape[0] - 1
    _, loss, metrics = draft(hidden_states=feats[None, :-1], input_ids=ids[None, 1:],
                             document_ids=torch.zeros(1, T, dtype=torch.long), loss_mask=torch.ones(1, T),
                             verifier_last_hidden_states=last[None, 1:], num_depths=DEPTHS, loss_config=loss_cfg)
    return loss, metrics


def accuracy(metrics_list) -> list[float]:
    out = []
    for d in range(DEPTHS):
        s = sum(float(m[f"position_{d}_acc_sum"]) for m in metrics_list)
        n = sum(float(m[f"position_{d}_acc_total"]) for m in metrics_list)
        out.append(s / max(n, 1.0))
    return out


def export(draft, out: Path = OUT) -> None:
    """bf16 ``save_pretrained``; no library code beside the weights; the verifier's path relative."""
    import copy

    import torch

    d = copy.deepcopy(draft).to(torch.bfloat16)
    if out.exists():
        for f in out.iterdir():
            f.unlink()
    d.save_pretrained(out, safe_serialization=True)
    (out / "config.py").unlink(missing_ok=True)
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = "../target"
    text = json.dumps(cfg, indent=2, sort_keys=True) + "\n"
    if str(REPO) in text or "/work/" in text:
        raise RuntimeError(f"{path} still holds an absolute path")
    path.write_text(text)


def train(args) -> None:
    import torch
    from speculators.losses import resolve_loss_config
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    meta = json.loads((RUN / "meta.json").read_text())
    stream = np.load(RUN / "train_stream.npy").astype(np.int64)
    distill = np.load(RUN / "self_distill.npy").astype(np.int64)
    held = np.load(RUN / "heldout_stream.npy").astype(np.int64)
    V = 4096
    counts = np.bincount(stream, minlength=V) + np.bincount(distill[:, PROMPT:].reshape(-1), minlength=V)
    target = LlamaForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    draft = build_draft(meta, counts)
    loss_cfg = resolve_loss_config("kl_div", "eager")  # the library's P-EAGLE loss, without Triton
    params = [p for p in draft.parameters() if p.requires_grad]
    n_train = sum(p.numel() for p in params)
    opt = torch.optim.Adam(params, lr=args.lr)
    budget = args.minutes * 60.0
    step, elapsed, history = 0, 0.0, []
    rng = np.random.default_rng([args.seed, 2])
    ckpt = RUN / "checkpoint.pt"
    if ckpt.exists() and not args.fresh:
        state = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["opt"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        rng.bit_generator.state = state["np_rng"]
        torch.set_rng_state(state["torch_rng"])
        log(f"resumed from {ckpt}: step {step}, {elapsed / 60:.1f} of {args.minutes} minutes")
    else:
        torch.manual_seed(args.seed)
    log(f"P-EAGLE head: 1 Llama layer, hidden {draft.hidden_size}, taps {TAPS}, depths {DEPTHS}, draft vocab "
        f"{DRAFT_VOCAB}, mask token {meta['mask_token_id']}; {n_train:,} trainable parameters; {args.docs} windows "
        f"of {SEQ + 1} tokens a step ({len(distill)} self-distillation windows, {len(stream):,} corpus tokens)")
    eval_ids = torch.from_numpy(fixed_windows(held, args.eval_windows, SEQ + 1))

    def save():
        tmp = RUN / "checkpoint.pt.tmp"
        torch.save(dict(draft=draft.state_dict(), opt=opt.state_dict(), step=step, elapsed=elapsed, history=history,
                        np_rng=rng.bit_generator.state, torch_rng=torch.get_rng_state(),
                        args=vars(args)), tmp)
        os.replace(tmp, ckpt)

    def evaluate():
        draft.eval()
        gen_state = torch.get_rng_state()
        torch.manual_seed(1234)  # the same COD draw at every report
        feats, last = target_states(target, eval_ids)
        losses, ms = [], []
        with torch.no_grad():
            for i in range(len(eval_ids)):
                loss, m = window_loss(draft, feats[i], last[i], eval_ids[i], loss_cfg)
                losses.append(float(loss))
                ms.append(m)
        torch.set_rng_state(gen_state)
        draft.train()
        return float(np.mean(losses)), accuracy(ms)

    def lr_at(step, elapsed):
        warm = min(1.0, (step + 1) / args.warmup)
        frac = min(1.0, elapsed / budget)
        return args.lr * warm * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))

    draft.train()
    recent_loss, recent_m = [], []
    while elapsed < budget and (args.max_steps is None or step < args.max_steps):
        t0 = time.perf_counter()
        n_d = args.docs // 2
        ids = np.concatenate([distill[rng.integers(0, len(distill), size=n_d)],
                              sample_windows(stream, args.docs - n_d, SEQ + 1, rng)])
        ids = torch.from_numpy(ids)
        feats, last = target_states(target, ids)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(len(ids)):
            loss, m = window_loss(draft, feats[i], last[i], ids[i], loss_cfg)
            (loss / len(ids)).backward()
            total += float(loss.detach()) / len(ids)
            recent_m.append({k: float(v) for k, v in m.items()})
        for g in opt.param_groups:
            g["lr"] = lr_at(step, elapsed)
        opt.step()
        step += 1
        elapsed += time.perf_counter() - t0
        recent_loss.append(total)
        if step % args.eval_every == 0 or elapsed >= budget or step == args.max_steps:
            hl, hacc = evaluate()
            tacc = accuracy(recent_m)
            rec = dict(step=step, minutes=round(elapsed / 60, 2), train_loss=float(np.mean(recent_loss)),
                       train_acc=[round(a, 3) for a in tacc], heldout_loss=hl, heldout_acc=[round(a, 3) for a in hacc],
                       lr=lr_at(step, elapsed))
            history.append(rec)
            log(f"step {step} ({elapsed / 60:.1f} min, {elapsed / step:.2f} s/step): train loss {rec['train_loss']:.3f} "
                f"acc/depth {' '.join(f'{a:.2f}' for a in tacc)} | held-out loss {hl:.3f} "
                f"acc/depth {' '.join(f'{a:.2f}' for a in hacc)}")
            recent_loss, recent_m = [], []
        if step % args.checkpoint_every == 0:
            save()
    save()
    export(draft)
    (RUN / "history.json").write_text(json.dumps(history, indent=1) + "\n")
    log(f"done: {step} steps, {elapsed / 60:.1f} minutes of training; exported {OUT} "
        f"({sum(f.stat().st_size for f in OUT.iterdir()) / 1e6:.2f} MB)")


# ---------------------------------------------------------------------------------------------- check (jaxspec)


def check(args) -> None:
    import jaxspec as js
    from jaxspec.train.corpus import file_prompts, spread_by_package, stdlib_files

    target = js.load_model(str(TARGET), dtype="float32")
    peagle = js.load_draft(str(OUT), target)
    eagle3 = js.load_draft(str(REPO / "demo" / "eagle3"), target)
    depth = peagle.config.model.num_speculative_tokens  # the parallel depths it was trained for
    prompts = file_prompts(target.tokenizer, spread_by_package(stdlib_files("heldout")), args.prompts, 64)
    sp = js.SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=(), temperature=0.0)
    eng = js.EngineConfig(max_batch=len(prompts), max_seq_len=64 + args.max_new_tokens + 32)
    plain = js.generate(target, prompts, sampling=sp, engine=eng, progress=False).token_ids
    rows = {}
    for name, draft, s in [("peagle", peagle, depth), ("peagle", peagle, 5), ("eagle3", eagle3, 5)]:
        t = time.perf_counter()
        res = js.generate(target, prompts, draft=draft, spec=js.SpecConfig.chain(s), sampling=sp, engine=eng,
                          progress=False)
        same = res.token_ids == plain
        per = [round(st.mean_accept_len, 2) for st in res.stats]
        rows[f"{name} chain{s}"] = dict(mean_accept_len=res.mean_accept_len, per_prompt=per, equal_to_plain=same)
        log(f"{name} chain {s}: mean accept length {res.mean_accept_len:.3f} (per prompt {per}); "
            f"tokens equal to plain greedy: {same} [{time.perf_counter() - t:.0f} s]")
        if not same:
            sys.exit(f"{name} chain {s}: output differs from plain greedy decoding")
    RUN.mkdir(parents=True, exist_ok=True)
    (RUN / "check.json").write_text(json.dumps(rows, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prep", help="data (jaxspec venv)")
    p.add_argument("--self-distill", type=int, default=1024, help="windows of the target's greedy text")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=prep)
    p = sub.add_parser("train", help="training and export (torch venv)")
    p.add_argument("--minutes", type=float, default=60.0, help="wall-time budget of training (resumes count)")
    p.add_argument("--max-steps", type=int, default=None, help="stop earlier (smoke tests)")
    p.add_argument("--docs", type=int, default=8, help="windows a step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=8)
    p.add_argument("--checkpoint-every", type=int, default=25)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint")
    p.set_defaults(func=train)
    p = sub.add_parser("check", help="load, lossless greedy check and accept lengths (jaxspec venv)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.set_defaults(func=check)
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
