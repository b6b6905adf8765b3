"""Command line: ``jaxspec generate | bench | serve | bench-serve | train-draft`` (also ``python -m jaxspec``)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from jaxspec.demo import DEMO_METHODS, DEMO_PROMPT, DEMO_TARGET, demo_default
from jaxspec.spec_options import (NGRAM, add_bucket_args, add_exact_arg, add_spec_args, bucket_kwargs, draft_from,
                                  spec_from)


def _json_schema(value: str | None):
    """--json-schema: a file's text when it names a file, else the text itself."""
    if value is not None and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def _methods(args, backend: str) -> list[tuple[str, str | None, int, int]]:
    """The runs of one ``jaxspec generate``, the shown one first: (name, draft: a directory, "ngram"
    or None, S, grafted n-gram tokens). Without --compare: the asked draft (no --target and no
    --draft: the demo's fastest method on ``backend``, ``demo_default``) and, unless --no-compare,
    plain decoding. With --compare: every method (the demo's ``DEMO_METHODS``; else the given draft,
    n-gram lookup, and their hybrid when the draft is a checkpoint)."""
    demo = args.target is None
    if demo and args.draft is None:
        default = demo_default(backend)
        main = (default, *DEMO_METHODS[default])
        if args.steps is not None or args.ngram_tokens is not None:  # the user's shape for the default draft
            main = (main[0], main[1], args.steps or main[2], args.ngram_tokens or 0)
    else:
        draft = None if args.draft in (None, "none") else args.draft
        main = ("draft", draft, args.steps or 5, args.ngram_tokens or 0)
    plain = ("plain", None, 0, 0)
    if not args.compare:
        return [main] if main[1] is None or args.no_compare else [main, plain]
    if demo and args.draft is None:
        others = [(name, *m) for name, m in DEMO_METHODS.items() if name != main[0]]
    else:
        S = args.steps or 5
        others = [plain, ("n-gram", NGRAM, S, 0)]
        if main[1] not in (None, NGRAM):
            others.append(("hybrid", main[1], max(1, S - 2), 8))
    return [main] + [m for m in others if m[1:] != main[1:]]


def cmd_generate(args) -> int:
    import jaxspec as js

    target_path = args.target or DEMO_TARGET
    if not os.path.isdir(target_path):
        print(f"error: target checkpoint not found: {target_path}", file=sys.stderr)
        return 2
    target = js.load_model(target_path, dtype=args.dtype)
    prompt = args.prompt if args.prompt is not None else DEMO_PROMPT
    sampling = js.SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, logit_bias=_logit_bias(args.logit_bias), logprobs=args.logprobs,
        max_new_tokens=args.max_new_tokens, stop_token_ids=() if args.ignore_eos else None, stop=args.stop or None,
        regex=args.regex, json_schema=_json_schema(args.json_schema),
    )
    engine = js.EngineConfig(page_size=args.page_size, max_batch=1, max_seq_len=args.max_seq_len, exact=args.exact,
                             **bucket_kwargs(args))
    if args.chat is not None:  # rendered with the checkpoint's own template
        chat = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.chat}]
        prompt = js.apply_chat_template(target, chat)
        prompts = [chat]
    elif args.system:
        raise ValueError("--system goes with --chat")
    else:
        prompts = [prompt] if target.tokenizer is not None else [[int(t) for t in prompt.split()]]

    import jax

    runs = []  # (name, draft, spec, draft path)
    for name, path, S, G in _methods(args, jax.default_backend()):
        draft = draft_from(args, target, path, G)
        spec = None if draft is None else spec_from(args, S, G, ngram_only=path == NGRAM)
        runs.append((name, draft, spec, path))

    def run(d, s):
        return js.generate(target, prompts, draft=d, spec=s, sampling=sampling, engine=engine, seed=args.seed,
                           progress=False)

    name, draft, spec, draft_path = runs[0]
    shown = draft_path if draft is None or type(draft) is js.DraftModel else repr(draft)
    print(f"target: {target_path}\ndraft:  {shown or 'none'}  {spec or ''}", file=sys.stderr)
    t = time.perf_counter()
    outs = [run(d, s) for _, d, s, _ in runs]  # warm-up: compiles every configuration
    print(f"(compiled and warmed up in {time.perf_counter() - t:.1f}s)", file=sys.stderr)
    tps = [[] for _ in runs]
    for _ in range(max(1, args.repeats)):  # rounds over the runs, so all see the same machine load
        for i, (_, d, s, _) in enumerate(runs):
            outs[i] = run(d, s)
            tps[i].append(outs[i].tokens_per_s)
    out = outs[0]
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
    median = [statistics.median(x) for x in tps]
    plain = next((median[i] for i, r in enumerate(runs) if r[1] is None), None)
    if args.compare:
        _print_comparison(runs, outs, median, plain)
    if args.exact and plain is not None and draft is not None:
        ref = outs[next(i for i, r in enumerate(runs) if r[1] is None)]
        same = out.token_ids == ref.token_ids and out.logprobs == ref.logprobs
        print("exact mode: speculative output " + ("equals plain output bit for bit" if same else
              "DIFFERS from plain output (please report it)") + (" (tokens and log-probabilities)"
                                                                  if out.logprobs is not None else " (tokens)"))
    print(f"tokens: {st.num_tokens}   tokens/s: {median[0]:.1f}", end="")
    if draft is not None:
        print(f"   mean accept length: {st.mean_accept_len:.2f}", end="")
        if plain is not None:
            print(f"   plain tokens/s: {plain:.1f}   speedup: {median[0] / max(plain, 1e-9):.2f}x", end="")
    print(f"   (median of {len(tps[0])})" if len(tps[0]) > 1 else "")
    return 0


def _print_comparison(runs, outs, median, plain) -> None:
    """One line per method of ``--compare``: its draft and shape, accept length, tokens/s, speedup
    over plain decoding (all from the same rounds)."""
    print(f"{'method':<10}{'draft':<18}{'shape':<16}{'accept':>8}{'tokens/s':>10}{'speedup':>9}")
    for (name, _, spec, path), out, tps in zip(runs, outs, median):
        where = "-" if path is None else (path if path == NGRAM else os.path.basename(os.path.normpath(path)))
        if spec is None:
            shape = "-"
        elif spec.ngram_tokens:
            shape = f"chain {spec.num_steps} + {spec.ngram_tokens} ng"
        else:
            shape = f"chain {spec.num_steps}" if spec.topk == 1 else f"tree {spec.topk}x{spec.num_draft_tokens}"
        speedup = f"{tps / plain:.2f}x" if plain else "-"
        print(f"{name:<10}{where:<18}{shape:<16}{out.mean_accept_len:>8.2f}{tps:>10.1f}{speedup:>9}")


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
                        "./ngram) or 'none' (default on the demo pair: its fastest method on this backend, n-gram on a CPU, "
                        "the DSpark block drafter on a GPU)")
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
    add_exact_arg(g)
    add_bucket_args(g)
    g.add_argument("--max-seq-len", type=int, default=2048)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's eos tokens")
    g.add_argument("--no-compare", action="store_true", help="skip the plain-decoding baseline")
    g.add_argument("--compare", action="store_true",
                   help="also run every other method (demo: plain, EAGLE-3, n-gram, hybrid, block drafter; else plain, "
                        "n-gram and the draft's hybrid) and print one line each, from the same rounds")
    g.add_argument("--repeats", type=int, default=3, help="timed runs of each (the median is printed)")
    add_spec_args(g)
    g.set_defaults(func=cmd_generate)

    from jaxspec import bench
    from jaxspec.serve import command as serve_command
    from jaxspec.train import cli as train_cli

    bench.add_parser(sub)
    serve_command.add_parsers(sub)
    train_cli.add_parser(sub)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
