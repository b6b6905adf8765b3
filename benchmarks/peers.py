"""Peer benchmark on the demo pair: HF transformers (plain greedy, prompt lookup) against jaxspec
(plain, EAGLE-3, n-gram, hybrid), batch 1, on the held-out prompts ``jaxspec bench`` uses, in one run
on one machine. Not run in CI.

    scripts/env.sh
    PYTHONPATH=. .venv/bin/python benchmarks/peers.py --hf-python /path/to/python [--repeats 5]

``--hf-python`` is an interpreter with ``torch`` and ``transformers`` (the optional ``peers`` extra:
``pip install -e ".[peers]"`` puts them into this venv, and then the default, this interpreter,
works). The HF side runs in that interpreter as a subprocess that loads the model once and
answers requests, so its runs alternate with jaxspec's in this process: every round times each
method once, in the same order, after a warm-up round (compiles, caches). A method's speedup is
the median over rounds of its tokens/s over its own plain decoding's in the same round (HF
methods over HF plain, jaxspec methods over jaxspec plain), so a change in machine load hits
both sides of each ratio alike.

Each method decodes every prompt at batch 1 (HF: one ``generate`` call per prompt; jaxspec: one
``generate`` call with ``max_batch=1``, which runs the prompts one after another), greedy,
``--max-new-tokens`` tokens each with stop tokens off, and is timed around those calls. HF prompt
lookup is ``generate(prompt_lookup_num_tokens=10)`` (HF's documented example setting; its
``max_matching_ngram_size`` default is 2). torch runs one thread (``--hf-threads``): on a busy
two-core machine its default of a thread per core spins and decodes several times slower (HF
plain 9 against 48 tokens/s in one such check), while XLA keeps its default thread pool, its
better setting there. Tokens per target forward are counted for HF by
wrapping ``model.forward`` (the prefill counts as one) and are the mean accept length for
jaxspec (where the prefill also emits one token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import jaxspec as js
from jaxspec.bench import device_name, parse_config
from jaxspec.demo import DEMO_DRAFT, DEMO_TARGET
from jaxspec.train.corpus import file_prompts, spread_by_package, stdlib_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIGS = "chain3,ngram8,chain3+ng8"

HF_WORKER = r"""
import json, sys, time
import torch, transformers
from transformers import AutoModelForCausalLM, GenerationConfig

path, threads = sys.argv[1], int(sys.argv[2])
if threads:
    torch.set_num_threads(threads)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
calls = [0]
forward = model.forward


def counted(*args, **kwargs):
    calls[0] += 1
    return forward(*args, **kwargs)


model.forward = counted
print(json.dumps(dict(ready=True, torch=torch.__version__, transformers=transformers.__version__,
                      threads=torch.get_num_threads())), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    cfg = GenerationConfig(max_new_tokens=req["max_new_tokens"], do_sample=False, eos_token_id=None,
                           pad_token_id=0, **req["options"])
    tokens, calls[0] = [], 0
    t0 = time.perf_counter()
    with torch.no_grad():
        for prompt in req["prompts"]:
            ids = torch.tensor([prompt], dtype=torch.long)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
            tokens.append(out[0, len(prompt):].tolist())
    seconds = time.perf_counter() - t0
    print(json.dumps(dict(seconds=seconds, tokens=tokens, forwards=calls[0])), flush=True)
"""

HF_METHODS = {"HF plain greedy": {}, "HF prompt lookup": {"prompt_lookup_num_tokens": 10}}


class HFWorker:
    """The HF side: a subprocess that loads the target once and times ``generate`` on request."""

    def __init__(self, python: str, target: str, threads: int):
        self.proc = subprocess.Popen([python, "-c", HF_WORKER, target, str(threads)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the HF worker exited (does --hf-python have torch and transformers?)")
        return json.loads(line)

    def run(self, prompts, max_new_tokens: int, options: dict) -> dict:
        self.proc.stdin.write(json.dumps(dict(prompts=prompts, max_new_tokens=max_new_tokens, options=options)) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-python", default=sys.executable, help="interpreter with torch + transformers")
    ap.add_argument("--target", default=DEMO_TARGET)
    ap.add_argument("--draft", default=DEMO_DRAFT)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help=f"jaxspec configurations, as `jaxspec bench` names them (default {DEFAULT_CONFIGS})")
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up round)")
    ap.add_argument("--hf-threads", type=int, default=1,
                    help="torch threads (default 1; 0: torch's default, one per core)")
    ap.add_argument("--out", default=None, help="JSON with every measurement")
    args = ap.parse_args()

    target = js.load_model(args.target, dtype="float32", progress=False)
    draft = js.load_draft(args.draft, target)
    ngram = js.NgramDraft(max_ngram=args.ngram_max, min_ngram=args.ngram_min)
    prompts = file_prompts(target.tokenizer, spread_by_package(stdlib_files("heldout")), args.num_prompts,
                           args.prompt_tokens)
    sampling = js.SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=())
    engine = js.EngineConfig(page_size=16, max_batch=1, max_seq_len=args.prompt_tokens + args.max_new_tokens + 64)
    configs = [parse_config("plain")] + [parse_config(c) for c in args.configs.split(",") if c.strip()]
    js_methods = {("jaxspec plain" if c.is_plain else f"jaxspec {c.name}"): c for c in configs}

    hf = HFWorker(args.hf_python, args.target, args.hf_threads)
    results: dict[str, list[dict]] = {name: [] for name in list(HF_METHODS) + list(js_methods)}

    def run_round(record: bool):
        for name, options in HF_METHODS.items():
            r = hf.run(prompts, args.max_new_tokens, options)
            if record:
                results[name].append(dict(seconds=r["seconds"], tokens=r["tokens"], forwards=r["forwards"]))
        for name, cfg in js_methods.items():
            t0 = time.perf_counter()
            out = js.generate(target, prompts, draft=cfg.draft(draft, ngram), spec=cfg.spec(), sampling=sampling,
                              engine=engine, progress=False)
            seconds = time.perf_counter() - t0
            if record:
                results[name].append(dict(seconds=seconds, tokens=out.token_ids, accept=out.mean_accept_len))

    t_start = time.perf_counter()
    run_round(record=False)  # warm-up: compiles, fills caches
    for _ in range(args.repeats):
        run_round(record=True)
    hf.close()

    def tps(r):
        return sum(len(t) for t in r["tokens"]) / r["seconds"]

    js_plain_tokens = results["jaxspec plain"][0]["tokens"]
    rows = []
    for name, runs in results.items():
        base = "HF plain greedy" if name.startswith("HF") else "jaxspec plain"
        ratio = statistics.median(tps(r) / tps(b) for r, b in zip(runs, results[base]))
        if name.startswith("HF"):
            per_forward = sum(len(t) for t in runs[0]["tokens"]) / runs[0]["forwards"]
        else:
            per_forward = runs[0]["accept"]
        rows.append(dict(method=name, tokens_per_s=statistics.median(tps(r) for r in runs), speedup=ratio,
                         tokens_per_forward=per_forward, tokens_per_s_runs=[tps(r) for r in runs],
                         same_tokens_as_jaxspec_plain=runs[0]["tokens"] == js_plain_tokens))
    head = f"{'method':<28}{'tokens/s':>10}{'speedup vs own plain':>22}{'tokens/forward':>16}{'same tokens':>13}"
    print(f"device: {device_name()}; demo pair; {len(prompts)} held-out prompts of {args.prompt_tokens} tokens, "
          f"{args.max_new_tokens} new tokens each, batch 1, greedy; {args.repeats} rounds after a warm-up; "
          f"HF: torch {hf.info['torch']}, transformers {hf.info['transformers']}, {hf.info['threads']} threads")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['method']:<28}{r['tokens_per_s']:>10.1f}{r['speedup']:>21.2f}x{r['tokens_per_forward']:>16.2f}"
              f"{'yes' if r['same_tokens_as_jaxspec_plain'] else 'no':>13}")
    print(f"({time.perf_counter() - t_start:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device_name(), hf=hf.info, command=" ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
                           max_new_tokens=args.max_new_tokens, prompt_tokens=args.prompt_tokens,
                           num_prompts=len(prompts), repeats=args.repeats, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
