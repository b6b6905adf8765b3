"""Command line: ``jaxspec generate | bench | train-draft`` (also ``python -m jaxspec``)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from jaxspec.demo import DEMO_DRAFT, DEMO_PROMPT, DEMO_TARGET


NGRAM = "ngram"  # --draft ngram: model-free n-gram drafting (a directory of that name is given as ./ngram)


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=5, help="draft depth S (default 5)")
    p.add_argument("--topk", type=int, default=1, help="branching factor (1 = chain, default)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="n verified per step, grafted n-gram tokens included (default: S+1 for chains, plus "
                        "--ngram-tokens; topk*S+1 for n-gram trees)")
    p.add_argument("--ngram-max", type=int, default=4, help="longest suffix an n-gram draft looks up (default 4)")
    p.add_argument("--ngram-min", type=int, default=1, help="shortest suffix an n-gram draft looks up (default 1)")
    p.add_argument("--ngram-tokens", type=int, default=0,
                   help="graft this many n-gram tokens onto the model draft's tree (a hybrid draft; default 0)")


def _spec_from(args, ngram_only: bool = False):
    from jaxspec.config import SpecConfig

    S, K, G = args.steps, args.topk, args.ngram_tokens
    if args.num_draft_tokens is not None:
        n = args.num_draft_tokens
    elif K == 1:
        n = S + 1 + G
    elif ngram_only:
        n = K * S + 1
    else:
        n = min(2 * S * K, K + (S - 1) * K**2) + 1 + G
    return SpecConfig(num_steps=S, topk=K, num_draft_tokens=n, ngram_tokens=G)


def _draft_from(args, target, draft_path):
    """``--draft``: a checkpoint directory, ``ngram`` (model-free) or ``none``; ``--ngram-tokens``
    grafts n-gram tokens onto a checkpoint's tree (``HybridDraft``)."""
    import jaxspec as js

    ngram = js.NgramDraft(max_ngram=args.ngram_max, min_ngram=args.ngram_min)
    if draft_path == NGRAM:
        if args.ngram_tokens:
            raise ValueError("--ngram-tokens grafts n-gram tokens onto a model draft's tree; --draft ngram drafts "
                             "with n-grams alone (give a checkpoint as --draft for a hybrid)")
        return ngram
    if not draft_path or draft_path == "none":
        if args.ngram_tokens:
            raise ValueError("--ngram-tokens needs a model draft (--draft DIR) to graft onto")
        return None
    draft = js.load_draft(draft_path, target)
    return js.HybridDraft(draft, ngram) if args.ngram_tokens else draft


def _json_schema(value: str | None):
    """--json-schema: a file's text when it names a file, else the text itself."""
    if value is not None and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def cmd_generate(args) -> int:
    import jaxspec as js

    target_path = args.target or DEMO_TARGET
    draft_path = args.draft if args.draft is not None else (DEMO_DRAFT if args.target is None else None)
    if not os.path.isdir(target_path):
        print(f"error: target checkpoint not found: {target_path}", file=sys.stderr)
        return 2
    target = js.load_model(target_path, dtype=args.dtype)
    draft = _draft_from(args, target, draft_path)
    spec = _spec_from(args, ngram_only=draft_path == NGRAM) if draft is not None else None
    prompt = args.prompt if args.prompt is not None else DEMO_PROMPT
    sampling = js.SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, logit_bias=_logit_bias(args.logit_bias), logprobs=args.logprobs,
        max_new_tokens=args.max_new_tokens, stop_token_ids=() if args.ignore_eos else None, stop=args.stop or None,
        regex=args.regex, json_schema=_json_schema(args.json_schema),
    )
    engine = js.EngineConfig(page_size=args.page_size, max_batch=1, max_seq_len=args.max_seq_len)
    if args.chat is not None:  # rendered with the checkpoint's own template
        chat = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.chat}]
        prompt = js.apply_chat_template(target, chat)
        prompts = [chat]
    elif args.system:
        raise ValueError("--system goes with --chat")
    else:
        prompts = [prompt] if target.tokenizer is not None else [[int(t) for t in prompt.split()]]

    def run(d, s):
        return js.generate(target, prompts, draft=d, spec=s, sampling=sampling, engine=engine, seed=args.seed,
                           progress=False)

    shown = draft_path if draft is None or type(draft) is js.DraftModel else repr(draft)
    print(f"target: {target_path}\ndraft:  {shown or 'none'}  {spec or ''}", file=sys.stderr)
    compare = draft is not None and not args.no_compare
    t = time.perf_counter()
    out = run(draft, spec)  # warm-up: compiles
    if compare:
        run(None, None)  # compile plain decoding outside the timing too
    print(f"(compiled and warmed up in {time.perf_counter() - t:.1f}s)", file=sys.stderr)
    spec_tps, plain_tps = [], []
    for _ in range(max(1, args.repeats)):  # alternate, so both see the same machine load
        out = run(draft, spec)
        spec_tps.append(out.tokens_per_s)
        if compare:
            plain_tps.append(run(None, None).tokens_per_s)
    text = out.texts[0] if out.texts else " ".join(map(str, out.token_ids[0]))
    print("=" * 72)
    print((prompt if args.chat is not None or isinstance(prompts[0], str) else "") + text)
    print("=" * 72)
    st = out.stats[0]
    if args.logprobs is not None:
        _print_logprobs(target, out)
    reason = st.finish_reason + (f" ({st.stop_reason!r})" if st.stop_reason is not None else "")
    per_position = ""
    if st.accepted_per_position:
        per_position = "   accepted at draft position 1, 2, ...: " + " ".join(
            f"{a / len(st.accept_lens):.2f}" for a in st.accepted_per_position)
    print(f"finished: {reason}{per_position}")
    if st.num_tokens == 0:
        print("no tokens: the model's first token was a stop token (pass --ignore-eos to generate past it)")
        return 0
    tps = statistics.median(spec_tps)
    print(f"tokens: {st.num_tokens}   tokens/s: {tps:.1f}", end="")
    if draft is not None:
        print(f"   mean accept length: {st.mean_accept_len:.2f}", end="")
        if compare:
            plain = statistics.median(plain_tps)
            print(f"   plain tokens/s: {plain:.1f}   speedup: {tps / max(plain, 1e-9):.2f}x", end="")
    print(f"   (median of {len(spec_tps)})" if len(spec_tps) > 1 else "")
    return 0


def _logit_bias(text: str | None) -> dict | None:
    """``--logit-bias '{"13": -5, "42": 2.5}'`` (a JSON object: token id -> bias)."""
    import json

    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--logit-bias must be a JSON object of token id -> bias, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--logit-bias must be a JSON object of token id -> bias, got {text!r}")
    return value


def _print_logprobs(target, out) -> None:
    """One line per emitted token: its log-probability and the top alternatives'."""
    tok = target.tokenizer
    show = (lambda t: repr(tok.decode([t], skip_special_tokens=False))) if tok is not None else str
    print("logprobs (raw target distribution):")
    for i, (t, lp) in enumerate(zip(out.token_ids[0], out.logprobs[0])):
        top = "  ".join(f"{show(k)} {v:.3f}" for k, v in out.top_logprobs[0][i].items())
        print(f"  {i:4d} {show(t):>16s} {lp:8.3f}" + (f"   | {top}" if top else ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxspec", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text, speculatively (defaults to the shipped demo pair)")
    g.add_argument("--target", default=None, help="HF checkpoint directory (default: the demo target)")
    g.add_argument("--draft", default=None,
                   help="draft checkpoint directory, 'ngram' (model-free n-gram lookup; a directory named ngram is "
                        "./ngram) or 'none' (default: the demo EAGLE-3 head)")
    g.add_argument("--prompt", default=None, help="prompt text (token ids separated by spaces if there is no tokenizer)")
    g.add_argument("--chat", default=None,
                   help="a user message, rendered with the checkpoint's chat template (instead of --prompt)")
    g.add_argument("--system", default=None, help="a system message before --chat")
    g.add_argument("--stop", action="append", default=None,
                   help="stop at this string (repeat for several); the text ends before it")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--logit-bias", default=None, help='JSON object of token id -> bias, e.g. \'{"13": -5}\'')
    g.add_argument("--logprobs", type=int, default=None,
                   help="print each token's log-probability and the top N alternatives (0: the token's only)")
    g.add_argument("--regex", default=None, help="structured output: the output must match this regex (Python syntax)")
    g.add_argument("--json-schema", default=None,
                   help="structured output: a JSON schema (its text, or a path to a .json file) the output must follow")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--max-seq-len", type=int, default=2048)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's eos tokens")
    g.add_argument("--no-compare", action="store_true", help="skip the plain-decoding baseline")
    g.add_argument("--repeats", type=int, default=3, help="timed runs of each (the median is printed)")
    _add_spec_args(g)
    g.set_defaults(func=cmd_generate)

    from jaxspec import bench
    from jaxspec.train import cli as train_cli

    bench.add_parser(sub)
    train_cli.add_parser(sub)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
