"""The speculative options the commands share (``jaxspec generate``, ``jaxspec serve``):
``--draft`` / ``--steps`` / ``--topk`` / ``--num-draft-tokens`` / ``--ngram-*`` turned into a draft
and a ``SpecConfig``; ``--exact`` and the compile buckets (``--min-*``) for the ``EngineConfig``."""

from __future__ import annotations

import argparse


NGRAM = "ngram"  # --draft ngram: model-free n-gram drafting (a directory of that name is given as ./ngram)


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=None,
                   help="draft depth S (default 5; with no --draft on the demo pair, its default method's)")
    p.add_argument("--topk", type=int, default=1, help="branching factor (1 = chain, default)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="n verified per step, grafted n-gram tokens included (default: S+1 for chains, plus "
                        "--ngram-tokens; topk*S+1 for n-gram trees)")
    p.add_argument("--ngram-max", type=int, default=4, help="longest suffix an n-gram draft looks up (default 4)")
    p.add_argument("--ngram-min", type=int, default=1, help="shortest suffix an n-gram draft looks up (default 1)")
    p.add_argument("--ngram-tokens", type=int, default=None,
                   help="graft this many n-gram tokens onto the model draft's tree (a hybrid draft; default 0)")


def spec_from(args, S: int, G: int, ngram_only: bool = False):
    from jaxspec.config import SpecConfig

    K = args.topk
    if args.num_draft_tokens is not None:
        n = args.num_draft_tokens
    elif K == 1:
        n = S + 1 + G
    elif ngram_only:
        n = K * S + 1
    else:
        n = min(2 * S * K, K + (S - 1) * K**2) + 1 + G
    return SpecConfig(num_steps=S, topk=K, num_draft_tokens=n, ngram_tokens=G)


def draft_from(args, target, draft_path, ngram_tokens: int | None = None):
    """``--draft``: a checkpoint directory, ``ngram`` (model-free) or ``none``; ``--ngram-tokens``
    (or ``ngram_tokens``) grafts n-gram tokens onto a checkpoint's tree (``HybridDraft``)."""
    import jaxspec as js

    G = args.ngram_tokens if ngram_tokens is None else ngram_tokens
    ngram = js.NgramDraft(max_ngram=args.ngram_max, min_ngram=args.ngram_min)
    if draft_path == NGRAM:
        if G:
            raise ValueError("--ngram-tokens grafts n-gram tokens onto a model draft's tree; --draft ngram drafts "
                             "with n-grams alone (give a checkpoint as --draft for a hybrid)")
        return ngram
    if not draft_path or draft_path == "none":
        if G:
            raise ValueError("--ngram-tokens needs a model draft (--draft DIR) to graft onto")
        return None
    draft = js.load_draft(draft_path, target)
    return js.HybridDraft(draft, ngram) if G else draft


def add_exact_arg(parser) -> None:
    """``--exact`` (``EngineConfig(exact=True)``), for ``generate`` and ``serve``."""
    parser.add_argument("--exact", action="store_true",
                        help="the exact mode: every product, sum and attention in a fixed order, so speculative "
                             "output equals plain output bit for bit in bf16 (single device; slower; "
                             "docs/architecture.md, 'The exact mode')")


def add_bucket_args(parser, *, rows: bool = False) -> None:
    """The compile buckets, for ``generate`` and (with ``rows``) ``serve``: a larger bucket compiles
    fewer programs and computes more padding (``EngineConfig.min_prefill_bucket``,
    ``min_kv_bucket``, ``min_prefill_rows``)."""
    from jaxspec.config import EngineConfig

    parser.add_argument("--min-prefill-bucket", type=int, default=None, metavar="N",
                        help="shortest length a prefill is padded to; the lengths double from it (a program each; "
                             f"default {EngineConfig.min_prefill_bucket})")
    parser.add_argument("--min-kv-bucket", type=int, default=None, metavar="N",
                        help="fewest KV positions a step's attention reads: the context is rounded up to a power "
                             f"of two of pages, never below N (a program each; default {EngineConfig.min_kv_bucket})")
    if rows:
        parser.add_argument("--min-prefill-rows", type=int, default=None, metavar="N",
                            help="fewest rows a prefill runs: the requests admitted together, padded to a power of "
                                 f"two and never below N (a program each; default {EngineConfig.min_prefill_rows})")


def bucket_kwargs(args) -> dict:
    """The bucket options given, as ``EngineConfig`` keyword arguments (those not given keep its
    defaults)."""
    names = ("min_prefill_bucket", "min_kv_bucket", "min_prefill_rows")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
