"""``jaxspec train-draft``: train a draft for a target on a text corpus: an EAGLE-3 head
(``--method eagle3``, the default), a DFlash block draft (``--method dflash``) or a DSpark block
draft (``--method dspark``: DFlash plus a Markov head and a confidence head).

    jaxspec train-draft --target DIR --corpus PATH [PATH ...] --out DIR [--minutes M | --steps N]
    jaxspec train-draft --method dflash --block-size 8 --draft-layers 3 --target DIR --corpus ... --out DIR

The corpus is files and/or directories (``--ext`` filters directory listings), or ``stdlib``
for the running Python's standard library. Files whose relative path hashes into the
held-out bucket (``--heldout-percent``) are never trained on; they give the held-out
windows and prompts of the periodic reports. Checkpoints go to ``--run-dir`` and a rerun
with the same ``--run-dir`` resumes; the draft is exported to ``--out`` at every checkpoint
(config.json + model.safetensors in its published layout, loadable by ``jaxspec.load_draft``).

DFlash training (the paper's recipe; the reference package has none): every window carries
``--num-anchors`` random anchors; each anchor's block [anchor, mask x (Q-1)] is predicted in
parallel from the target's features before it, and block position j's loss weighs
exp(-(j-1) / gamma) (``--position-decay``). DSpark training adds, teacher-forced, the Markov
head's bias from the true token before each slot (``--markov-rank``, ``--markov-head``) and the
confidence head's binary cross-entropy to each slot's analytic acceptance rate
(``--confidence-alpha``), as the ``speculators`` library defines them, and exports its layout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train-draft", help="train an EAGLE-3 head or a DFlash block draft for a target on a text corpus",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--method", default="eagle3", choices=["eagle3", "dflash", "dspark"],
                   help="what to train (default eagle3)")
    p.add_argument("--target", required=True, help="HF checkpoint directory of the target (with tokenizer.json)")
    p.add_argument("--corpus", nargs="+", required=True, help="files / directories, or 'stdlib'")
    p.add_argument("--out", required=True, help="directory for the exported head")
    p.add_argument("--run-dir", default=None, help="checkpoints and logs (default: runs/train_draft/<basename of --out>)")
    p.add_argument("--ext", default=".py,.txt,.md,.rst", help="file suffixes taken from directories ('' = all)")
    p.add_argument("--heldout-percent", type=int, default=5, help="percent of files held out (by path hash)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, default=None, help="optimizer steps (default 1000)")
    budget.add_argument("--minutes", type=float, default=None, help="train for this wall time instead")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--ttt-steps", type=int, default=5, help="simulated draft steps per window (training-time test)")
    p.add_argument("--step-weight", type=float, default=0.8, help="loss weight decay per simulated step")
    p.add_argument("--label", default="soft", choices=["soft", "greedy"],
                   help="soft: the target's distribution; greedy: its argmax token")
    p.add_argument("--self-distill", type=int, default=0, metavar="N",
                   help="also train on N windows of the target's own greedy continuations of corpus prefixes")
    p.add_argument("--self-distill-frac", type=float, default=0.5, help="share of each batch from those windows")
    p.add_argument("--draft-vocab-size", type=int, default=None, help="draft vocabulary (d2t/t2d by frequency)")
    p.add_argument("--intermediate-size", type=int, default=None, help="head MLP width (default: the target's)")
    dflash = p.add_argument_group("dflash")
    dflash.add_argument("--block-size", type=int, default=16, help="DFlash block size Q (anchor included)")
    dflash.add_argument("--draft-layers", type=int, default=2, help="DFlash draft layers")
    dflash.add_argument("--target-layer-ids", default=None,
                        help="comma-separated target layers whose outputs feed the draft (default: spread)")
    dflash.add_argument("--num-anchors", type=int, default=16, help="DFlash blocks per training window")
    dflash.add_argument("--position-decay", type=float, default=None,
                        help="gamma of the exp(-(j-1)/gamma) loss weight per block position (default (Q-2)/2)")
    dflash.add_argument("--mask-token-id", type=int, default=None,
                        help="the block's mask token (default: the corpus's rarest token)")
    dspark = p.add_argument_group("dspark (with the dflash options)")
    dspark.add_argument("--markov-rank", type=int, default=64, help="rank of the Markov head (0: none)")
    dspark.add_argument("--markov-head", default="vanilla", choices=["vanilla", "gated", "rnn"])
    dspark.add_argument("--no-confidence-head", action="store_true", help="train no confidence head")
    dspark.add_argument("--confidence-alpha", type=float, default=1.0, help="weight of the confidence loss")
    dspark.add_argument("--no-sample-from-anchor", action="store_true",
                        help="the anchor's slot drafts nothing (block_size - 1 draft tokens, DFlash's layout)")
    p.add_argument("--init-from", default=None,
                   help="start from a draft checkpoint's arrays of the same names and shapes (e.g. a DFlash draft's "
                        "backbone for --method dspark); ignored when --run-dir resumes")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-prompts", type=int, default=4, help="held-out prompts for the generate report (0: off)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--eval-max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="exported weight dtype")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)
    return p


def _split_corpus(args) -> tuple[list, list]:
    """(training files, held-out files) as (root, relative path) pairs."""
    from jaxspec.train.corpus import is_held_out, list_files, stdlib_files

    if args.corpus == ["stdlib"]:
        train_files, held = stdlib_files("train"), stdlib_files("heldout")
    else:
        exts = tuple(e for e in args.ext.split(",") if e)
        files = list_files(args.corpus, exts)
        held = [f for f in files if is_held_out(f[1], args.heldout_percent)]
        train_files = [f for f in files if not is_held_out(f[1], args.heldout_percent)]
        if not train_files:
            train_files, held = files, []
    return train_files, held


def run(args) -> int:
    import jaxspec as js
    from jaxspec.train.corpus import file_prompts, spread_by_package, tokenize_files
    from jaxspec.train.draft_train import DraftTrainConfig, DraftTrainer
    from jaxspec.train.forward import num_params
    from jaxspec.train.optim import OptimConfig

    _check_args(args)
    if args.steps is None and args.minutes is None:
        args.steps = 1000
    cfg = DraftTrainConfig(
        batch=args.batch, seq_len=args.seq_len, steps=args.steps, minutes=args.minutes, ttt_steps=args.ttt_steps,
        step_weight=args.step_weight, label=args.label, draft_vocab_size=args.draft_vocab_size,
        intermediate_size=args.intermediate_size, eval_every=args.eval_every, eval_prompts=args.eval_prompts,
        eval_max_new_tokens=args.eval_max_new_tokens, self_distill_windows=args.self_distill,
        self_distill_frac=args.self_distill_frac,
        checkpoint_every=args.eval_every, seed=args.seed,
        optim=OptimConfig(lr=args.lr, warmup_steps=args.warmup, weight_decay=0.0),
    )
    target = js.load_model(args.target, dtype="float32")
    if target.tokenizer is None:
        raise ValueError(f"{args.target} has no tokenizer.json: train-draft tokenizes the corpus with it")
    run_dir = args.run_dir or os.path.join("runs", "train_draft", os.path.basename(os.path.normpath(args.out)))
    os.makedirs(run_dir, exist_ok=True)

    def log(msg):
        print(msg, flush=True)
        with open(os.path.join(run_dir, "log.txt"), "a") as f:
            f.write(msg + "\n")

    t = time.perf_counter()
    train_files, held = _split_corpus(args)
    eos = target.eos_token_ids[0] if target.eos_token_ids else None
    train = tokenize_files(target.tokenizer, train_files, eos)
    heldout = tokenize_files(target.tokenizer, held, eos) if held else None
    prompts = file_prompts(target.tokenizer, spread_by_package(held), args.eval_prompts, args.prompt_tokens)
    log(f"corpus: {len(train_files)} training files ({len(train)} tokens), {len(held)} held out "
        f"({0 if heldout is None else len(heldout)} tokens), {len(prompts)} eval prompts "
        f"[{time.perf_counter() - t:.0f}s]")
    trainer = DraftTrainer(target, train, heldout, prompts, cfg, args.out, run_dir, log=log,
                           method=_method(args, cfg, target, train), init_from=args.init_from)
    log(trainer.method.describe(num_params(trainer.trainable)))
    summary = trainer.run(export_dtype=args.dtype)
    summary["args"] = {k: v for k, v in vars(args).items() if k != "func"}
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    log(f"exported {args.out} after {summary['steps']} steps, {summary['seconds'] / 60:.1f} min")
    return 0


def _check_args(args) -> None:
    """Argument errors, before the target and the corpus are loaded."""
    if args.method in ("dflash", "dspark"):
        if args.block_size < 2 or args.draft_layers < 1 or args.num_anchors < 1:
            raise ValueError("--block-size must be >= 2, --draft-layers and --num-anchors >= 1")
        if args.seq_len < args.block_size:
            raise ValueError(f"--seq-len {args.seq_len} must be >= --block-size {args.block_size}")
        if args.position_decay is not None and not args.position_decay > 0:
            raise ValueError(f"--position-decay must be > 0, got {args.position_decay}")
    if args.method == "dspark":
        if args.markov_rank < 0 or not args.confidence_alpha >= 0:
            raise ValueError("--markov-rank and --confidence-alpha must be >= 0")
        if args.draft_vocab_size is not None:
            raise ValueError("--draft-vocab-size: DSpark training keeps the target's vocabulary")
        if not args.no_sample_from_anchor and args.seq_len < args.block_size + 1:
            raise ValueError(f"--seq-len {args.seq_len} must be >= --block-size + 1 ({args.block_size + 1}) when "
                             f"every slot drafts")


def _method(args, cfg, target, train_stream):
    """The DFlash / DSpark method for ``--method dflash`` / ``dspark`` (None: the trainer's EAGLE-3 default)."""
    if args.method not in ("dflash", "dspark"):
        return None
    from jaxspec.model.drafts.dflash import DFlashDraft, dflash_config_for
    from jaxspec.train.dflash_method import DFlashMethod, least_frequent_token

    mask = args.mask_token_id
    if mask is None:
        mask = least_frequent_token(train_stream, target.config.vocab_size, avoid=target.eos_token_ids)
    ids = [int(x) for x in args.target_layer_ids.split(",")] if args.target_layer_ids else None
    dcfg = dflash_config_for(target.config, num_layers=args.draft_layers, block_size=args.block_size,
                             mask_token_id=mask, intermediate_size=args.intermediate_size, target_layer_ids=ids)
    DFlashDraft(model=dcfg).check_fits(target.config)
    gamma = args.position_decay if args.position_decay is not None else max(1.0, (args.block_size - 2) / 2)
    if args.method == "dspark":
        from jaxspec.train.dspark_method import DSparkMethod, dspark_config_for

        dcfg = dspark_config_for(dcfg, markov_rank=args.markov_rank, markov_head_type=args.markov_head,
                                 confidence_head=not args.no_confidence_head,
                                 sample_from_anchor=not args.no_sample_from_anchor)
        return DSparkMethod(dcfg, num_anchors=args.num_anchors, gamma=gamma, label=args.label,
                            confidence_alpha=args.confidence_alpha)
    return DFlashMethod(dcfg, num_anchors=args.num_anchors, gamma=gamma, label=args.label)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxspec")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
