"""The options of ``jaxspec serve`` and ``jaxspec bench-serve`` (docs/cli.md). Importing this
module imports nothing of the web stack: the commands import it when they run."""

from __future__ import annotations

import argparse

from jaxspec.spec_options import add_bucket_args, add_exact_arg, add_spec_args

def add_parsers(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (defaults to the shipped demo pair)",
                       description="Serves /v1/completions, /v1/chat/completions and /v1/models (OpenAI's "
                                   "protocol), /health and /metrics, with requests joining a running engine.")
    s.add_argument("--target", default=None, help="HF checkpoint directory (default: the demo target)")
    s.add_argument("--draft", default=None,
                   help="draft checkpoint directory, 'ngram' or 'none' (default on the demo pair: its default method)")
    add_spec_args(s)
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--page-size", type=int, default=16)
    add_exact_arg(s)
    s.add_argument("--max-seq-len", type=int, default=2048, help="most tokens of one request, prompt included")
    s.add_argument("--max-batch", type=int, default=8, help="most requests decoded together")
    s.add_argument("--num-pages", type=int, default=None,
                   help="KV pages per pool (default: --max-batch requests of --max-seq-len tokens)")
    s.add_argument("--prefix-cache", default="auto", choices=["auto", "on", "off"],
                   help="keep prompt KV pages for later prompts that start the same way (auto: where the model "
                        "allows it)")
    s.add_argument("--admission", default="optimistic", choices=["optimistic", "reserve"])
    s.add_argument("--steps-per-call", type=int, default=8,
                   help="decode steps per device call (requests join between calls)")
    add_bucket_args(s, rows=True)
    s.add_argument("--served-model-name", default=None,
                   help="the model id /v1/models lists and requests name (default: jaxspec-demo on the demo pair, "
                        "else the target directory's name)")
    s.add_argument("--chat-template", default=None,
                   help="a chat template (a file or the template text) for checkpoints without one (the demo target "
                        "has none)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $JAXSPEC_API_KEY if set)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="most requests waiting to run; more are refused with 503 and Retry-After")
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench-serve", help="concurrent clients against a jaxspec server on localhost, plain vs "
                                           "speculative: throughput, time to first token, inter-token latency")
    b.add_argument("--target", default=None, help="HF checkpoint directory (default: the demo target)")
    b.add_argument("--draft", default=None, help="the speculative server's draft (default on the demo pair: its "
                                                 "default method)")
    add_spec_args(b)
    b.add_argument("--clients", type=int, default=4, help="concurrent clients")
    b.add_argument("--requests", type=int, default=16, help="requests per server (spread over the clients)")
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--max-batch", type=int, default=4)
    b.add_argument("--max-seq-len", type=int, default=512)
    b.add_argument("--steps-per-call", type=int, default=8)
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    b.add_argument("--port", type=int, default=0, help="first port to try (0: free ones)")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds per request at most")
    b.add_argument("--out", default="serve_bench", help="writes OUT.json and OUT.png")
    b.set_defaults(func=cmd_bench_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from jaxspec.serve.server import serve

    return serve(args)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from jaxspec.serve.bench import bench_serve

    return bench_serve(args)
