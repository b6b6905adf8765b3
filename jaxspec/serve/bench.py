"""``jaxspec bench-serve``: a bounded load of concurrent clients against ``jaxspec serve`` on
localhost, plain decoding and the speculative method in one run.

For each method a server is started (a subprocess on 127.0.0.1), warmed up with the same load (so
its programs are compiled), then ``--requests`` streamed completions of ``--max-tokens`` tokens
(eos ignored: equal work) go out from ``--clients`` concurrent clients, over token-id prompts from
held-out standard-library files. Reported per method: output tokens/s over the run, time to first
token and inter-token latency (each streamed chunk's gap shared by its tokens), p50 and p99, and the
mean accept length. The prefix cache is off (the timed load repeats the warm-up's prompts). Writes
OUT.json and OUT.png (the clients speak HTTP with the standard library).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

PROMPT_TOKENS = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def stream_completion(port: int, body: dict, timeout: float) -> dict:
    """One streamed completion: when each chunk came and how many tokens it held."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    chunks, spec = [], None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(event["error"]["message"])
        for choice in event["choices"]:
            n = len((choice.get("logprobs") or {}).get("tokens") or [])
            if n:
                chunks.append((time.perf_counter() - t0, n))
            spec = choice.get("spec_stats") or spec
    conn.close()
    return {"chunks": chunks, "spec": spec, "seconds": time.perf_counter() - t0}


def run_load(port: int, prompts: list[list[int]], *, clients: int, requests: int, max_tokens: int,
             temperature: float, timeout: float) -> dict:
    """``requests`` completions from ``clients`` concurrent clients; their latencies and throughput."""
    bodies = [{"model": "bench", "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "stream": True,
               "temperature": temperature, "seed": i, "ignore_eos": True, "logprobs": 0} for i in range(requests)]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda b: stream_completion(port, b, timeout), bodies))
    wall = time.perf_counter() - t0
    ttft, itl, accept = [], [], []
    tokens = 0
    for r in results:
        if not r["chunks"]:
            continue
        ttft.append(r["chunks"][0][0])
        for (a, _), (b, n) in zip(r["chunks"], r["chunks"][1:]):
            itl += [(b - a) / n] * n
        tokens += sum(n for _, n in r["chunks"])
        if r["spec"] and r["spec"]["verify_steps"]:
            accept.append(r["spec"]["mean_accept_length"])
    return {"requests": requests, "clients": clients, "tokens": tokens, "wall_seconds": wall,
            "tokens_per_s": tokens / wall, "ttft_p50": _percentile(ttft, 50), "ttft_p99": _percentile(ttft, 99),
            "itl_p50": _percentile(itl, 50), "itl_p99": _percentile(itl, 99),
            "mean_accept_len": statistics.mean(accept) if accept else 1.0}


def start_server(args, draft: str, port: int, log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jaxspec", "serve", "--draft", draft, "--port", str(port), "--served-model-name",
           "bench", "--max-batch", str(args.max_batch), "--max-seq-len", str(args.max_seq_len), "--steps-per-call",
           str(args.steps_per_call), "--dtype", args.dtype, "--max-queue", str(max(64, args.requests)),
           "--prefix-cache", "off"]  # the timed load repeats the warm-up's prompts: no cache hits, no new programs
    if args.target:
        cmd += ["--target", args.target]
    for flag in ("steps", "num_draft_tokens", "ngram_tokens"):
        value = getattr(args, flag)
        if value is not None and draft != "none":
            cmd += ["--" + flag.replace("_", "-"), str(value)]
    if draft != "none":
        cmd += ["--topk", str(args.topk), "--ngram-max", str(args.ngram_max), "--ngram-min", str(args.ngram_min)]
    env = {k: v for k, v in os.environ.items() if k != "JAXSPEC_API_KEY"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 300
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            with open(log_path) as f:
                raise RuntimeError(f"the server did not start:\n{f.read()[-3000:]}")
        time.sleep(0.3)


def format_table(rows: list[dict]) -> str:
    out = ["| method | clients | requests | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | accept |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['method']} | {r['clients']} | {r['requests']} | {r['tokens_per_s']:.1f} | "
                   f"{r['ttft_p50'] * 1e3:.0f} | {r['ttft_p99'] * 1e3:.0f} | {r['itl_p50'] * 1e3:.1f} | "
                   f"{r['itl_p99'] * 1e3:.1f} | {r['mean_accept_len']:.2f} |")
    return "\n".join(out)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["method"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].bar(names, [r["tokens_per_s"] for r in rows], color="tab:blue")
    axes[0].set_title("output tokens/s")
    for ax, key, label in ((axes[1], "ttft", "time to first token (ms)"), (axes[2], "itl", "inter-token latency (ms)")):
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r[f"{key}_p50"] * 1e3 for r in rows], 0.4, label="p50")
        ax.bar([i + 0.2 for i in x], [r[f"{key}_p99"] * 1e3 for r in rows], 0.4, label="p99")
        ax.set_xticks(list(x), names)
        ax.set_title(label)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_serve(args) -> int:
    from jaxspec.demo import DEMO_TARGET
    from jaxspec.model.checkpoints.tokenizer import load_tokenizer
    from jaxspec.serve.server import method
    from jaxspec.train.corpus import file_prompts, spread_by_package, stdlib_files

    tokenizer = load_tokenizer(args.target or DEMO_TARGET)
    prompts = file_prompts(tokenizer, spread_by_package(stdlib_files("heldout")), max(args.requests, 8), PROMPT_TOKENS)
    path, _, _ = method(args)
    spec_draft = path or "none"
    methods = [("plain", "none")] + ([("speculative", spec_draft)] if spec_draft != "none" else [])
    rows = []
    for name, draft in methods:
        port = args.port or _free_port()
        log = f"{args.out}.{name}.log"
        print(f"{name}: starting a server (draft {draft}) on port {port}...", file=sys.stderr, flush=True)
        proc = start_server(args, draft, port, log)
        try:
            kw = dict(clients=args.clients, max_tokens=args.max_tokens, temperature=args.temperature,
                      timeout=args.timeout)
            run_load(port, prompts, requests=args.requests, **kw)  # warm-up: compiles what the load needs
            row = run_load(port, prompts, requests=args.requests, **kw)
        finally:
            proc.terminate()
            proc.wait(30)
        row.update(method=name, draft=draft)
        rows.append(row)
        print(format_table([row]).splitlines()[-1], file=sys.stderr, flush=True)
    device = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    title = (f"jaxspec bench-serve: {args.clients} clients, {args.requests} requests of {args.max_tokens} tokens, "
             f"temperature {args.temperature}, max batch {args.max_batch} ({device})")
    print(title)
    print(format_table(rows))
    with open(args.out + ".json", "w") as f:
        json.dump({"title": title, "args": {k: v for k, v in vars(args).items() if k != "func"}, "rows": rows}, f,
                  indent=2)
    plot(rows, args.out + ".png", title)
    print(f"wrote {args.out}.json and {args.out}.png", file=sys.stderr)
    return 0
