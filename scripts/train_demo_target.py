"""Trains the demo target: a small Llama on the training split of the Python stdlib.

    # the demo target, as recorded in benchmarks/RESULTS.md:
    PYTHONPATH=. python scripts/train_demo_target.py --minutes 120 --lr 3e-3 --warmup 30 --eval-every 50
    PYTHONPATH=. python scripts/train_demo_target.py --steps 20 --out /tmp/t   # a quick smoke run

Needs ``tokenizer.json`` in ``--out`` (``scripts/train_demo_tokenizer.py``). Tokenizes the
training split (held-out files are never read; the stream is cached under ``--run-dir``),
trains with ``jaxspec.train.lm`` (checkpointing to ``--run-dir``; rerunning resumes), and
exports an HF ``LlamaForCausalLM`` checkpoint (bf16 weights by default) to ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxspec.model.targets.llama_config import LlamaConfig  # noqa: E402
from jaxspec.model.checkpoints.tokenizer import load_tokenizer  # noqa: E402
from jaxspec.train.corpus import stdlib_files, tokenize_files  # noqa: E402
from jaxspec.model.checkpoints.llama import export_llama  # noqa: E402
from jaxspec.train.lm import LMTrainConfig, train_lm  # noqa: E402
from jaxspec.train.optim import OptimConfig  # noqa: E402


def cached_stream(tok, split: str, tok_file: str, run_dir: str, eos: int) -> np.ndarray:
    digest = hashlib.sha256(open(tok_file, "rb").read()).hexdigest()[:12]
    path = os.path.join(run_dir, f"tokens_{split}_{digest}.npy")
    if os.path.exists(path):
        return np.load(path)
    t = time.perf_counter()
    stream = tokenize_files(tok, stdlib_files(split), eos)
    np.save(path, stream)
    print(f"tokenized {split}: {len(stream)} tokens in {time.perf_counter() - t:.0f}s")
    return stream


def export_checkpoint(cfg, tcfg, args, eos) -> None:
    """Exports a training checkpoint (e.g. of a run in progress) as an HF checkpoint."""
    import shutil

    from jaxspec.model.checkpoints.llama import init_llama_params
    from jaxspec.train.optim import make_optimizer
    from jaxspec.train.state import load_checkpoint

    params = init_llama_params(cfg)
    (params, _), meta = load_checkpoint(os.path.join(args.run_dir, "checkpoint"),
                                        (params, make_optimizer(tcfg.optim).init(params)))
    export_llama(args.export_checkpoint, params, cfg, dtype=args.dtype, bos_token_id=eos, eos_token_id=eos)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(args.out, name), args.export_checkpoint)
    print(f"exported step {meta['step']} to {args.export_checkpoint}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="demo/target")
    ap.add_argument("--run-dir", default="runs/demo_target")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--steps", type=int, default=None)
    group.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="exported weight dtype")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--export-checkpoint", metavar="DIR", default=None,
                    help="only export the latest checkpoint in --run-dir to DIR (with the tokenizer) and exit")
    args = ap.parse_args()
    if args.steps is None and args.minutes is None:
        args.steps = 1000

    tok_file = os.path.join(args.out, "tokenizer.json")
    if not os.path.exists(tok_file):
        sys.exit(f"error: {tok_file} not found; run scripts/train_demo_tokenizer.py --out {args.out} first")
    tok = load_tokenizer(tok_file)
    eos = tok.token_to_id("<|endoftext|>")
    os.makedirs(args.run_dir, exist_ok=True)
    train = cached_stream(tok, "train", tok_file, args.run_dir, eos)
    heldout = cached_stream(tok, "heldout", tok_file, args.run_dir, eos)
    cfg = LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, rms_norm_eps=1e-5, max_position_embeddings=2048,
    )
    tcfg = LMTrainConfig(
        batch=args.batch, seq_len=args.seq_len, steps=args.steps, minutes=args.minutes,
        eval_every=args.eval_every, checkpoint_every=args.eval_every, seed=args.seed,
        optim=OptimConfig(lr=args.lr, warmup_steps=args.warmup, weight_decay=args.weight_decay),
    )
    print(f"target {cfg}\ntrain {len(train)} tokens, held-out {len(heldout)} tokens", flush=True)

    def log(msg):
        print(msg, flush=True)
        with open(os.path.join(args.run_dir, "log.txt"), "a") as f:
            f.write(msg + "\n")

    if args.export_checkpoint:
        export_checkpoint(cfg, tcfg, args, eos)
        return
    params, summary = train_lm(cfg, train, heldout, tcfg, run_dir=args.run_dir, log=log)
    export_llama(args.out, params, cfg, dtype=args.dtype, bos_token_id=eos, eos_token_id=eos)
    summary.update(config=vars(args), train_tokens=int(len(train)), heldout_tokens=int(len(heldout)))
    with open(os.path.join(args.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    log(f"exported {args.out}: steps {summary['steps']}, {summary['tokens']} tokens, {summary['seconds'] / 60:.1f} min, "
        f"final train loss {summary['final_train_loss']:.4f}, held-out loss {summary['final_eval_loss']:.4f}")


if __name__ == "__main__":
    main()
