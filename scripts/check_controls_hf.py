"""Generation controls on the demo pair against HF transformers (not run in CI).

    VENV/bin/python scripts/check_controls_hf.py --jaxspec-python .venv/bin/python

``VENV`` has torch, transformers and scipy (``pip install torch==2.13.0 transformers==5.23.0 scipy``);
``--jaxspec-python`` is the project's venv, which runs jaxspec in a subprocess. Three checks:

1. Greedy output with controls (logit bias, repetition / presence / frequency penalties, min-p) equals an
   oracle built from HF's own forward and torch processing in vLLM's order
   (``scripts/goldens/controls.py::process``), for plain decoding, the demo EAGLE-3 head as a chain and as
   a tree, and n-gram drafting; per prompt, with the smallest processed top-1 margin reported.
2. The raw log-probabilities of every emitted token, and the top 5, equal HF's log-softmax.
3. Sampled output: the joint distribution of the first two tokens (temperature 0.9, top-k 6, min-p, strong
   penalties: the second token's distribution depends on the first) drawn by jaxspec from many rows, plain,
   EAGLE-3 chain (rejection sampling) and tree, against the exact processed distribution computed with HF
   (chi-square p-value and total variation).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from scripts.goldens.controls import process  # noqa: E402  (the oracle's processing, one copy)

PROMPTS = [
    'import os\n\n\ndef read_config(path):\n    """Read a JSON config file."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def fibonacci(n):\n    if n < 2:\n",
]
CONTROLS = {
    "repetition": dict(repetition_penalty=1.3),
    "presence_frequency": dict(presence_penalty=0.8, frequency_penalty=0.6),
    "bias": dict(logit_bias={"13": 3.0, "262": -4.0, "198": -2.0}),
    "all": dict(repetition_penalty=1.15, presence_penalty=0.4, frequency_penalty=0.3,
                logit_bias={"13": 1.5, "198": -1.0}, min_p=0.05),
}
SAMPLED = dict(temperature=0.9, top_k=6, min_p=0.02, repetition_penalty=1.6, presence_penalty=1.5,
               frequency_penalty=1.0)
SAMPLE_ROWS, SAMPLE_CALLS = 512, 16

JAXSPEC_SIDE = r"""
import json, sys
import numpy as np
import jaxspec as js
target_dir, draft_dir, job = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
target = js.load_model(target_dir, dtype="float32", progress=False)
eagle = js.load_draft(draft_dir, target, dtype="float32")
runs = {"plain": {}, "eagle3 chain": dict(draft=eagle, spec=js.SpecConfig.chain(5)),
        "eagle3 tree": dict(draft=eagle, spec=js.SpecConfig(num_steps=4, topk=4, num_draft_tokens=10)),
        "ngram chain": dict(draft=js.NgramDraft(max_ngram=4), spec=js.SpecConfig.chain(4))}
out = {"ids": [target.tokenizer.encode(p) for p in job["prompts"]], "greedy": {}, "sampled": {}}
for name, controls in job["controls"].items():
    s = js.SamplingParams(max_new_tokens=job["new_tokens"], stop_token_ids=(), logprobs=5, **controls)
    for run, kw in runs.items():
        g = js.generate(target, out["ids"], sampling=s, engine=js.EngineConfig(max_batch=4), progress=False, **kw)
        out["greedy"][f"{name}/{run}"] = dict(tokens=g.token_ids, logprobs=g.logprobs,
                                              top=[[[[int(k), v] for k, v in d.items()] for d in row]
                                                   for row in g.top_logprobs],
                                              accept=float(np.mean([x.mean_accept_len for x in g.stats])))
s = js.SamplingParams(max_new_tokens=2, stop_token_ids=(), **job["sampled"])
ids = out["ids"][0]
for run in ("plain", "eagle3 chain", "eagle3 tree"):
    pairs = []
    for c in range(job["calls"]):
        g = js.generate(target, [ids] * job["rows"], sampling=s, seed=c, progress=False,
                        engine=js.EngineConfig(max_batch=job["rows"], max_seq_len=256), **runs[run])
        pairs += [t[:2] for t in g.token_ids]
    out["sampled"][run] = pairs
json.dump(out, sys.stdout)
"""


def hf_greedy(model, torch, ids: list[int], controls: dict, new_tokens: int):
    """The oracle: HF forward (KV cache), torch processing, argmax; raw log-softmax per token."""
    seq, emitted, lps, tops, margin = list(ids), [], [], [], np.inf
    past = None
    with torch.no_grad():
        inp = torch.tensor([seq])
        for _ in range(new_tokens):
            res = model(inp, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[0, -1].float()
            x = process(logits, ids, emitted, controls)
            two = torch.topk(x, 2).values
            margin = min(margin, float(two[0] - two[1]))
            tok = int(torch.argmax(x))
            lp = torch.log_softmax(logits, -1)
            best = torch.topk(lp, 5)
            lps.append(float(lp[tok]))
            tops.append(list(zip(best.indices.tolist(), best.values.tolist())))
            emitted.append(tok)
            inp = torch.tensor([[tok]])
    return emitted, lps, tops, margin


def hf_joint(model, torch, ids: list[int], sampling: dict) -> dict[tuple[int, int], float]:
    """Exact P(t1, t2) under the processed distribution (temperature, min-p, top-k after the penalties)."""

    def probs(logits, output):
        x = process(logits, ids, output, sampling) / sampling["temperature"]
        p = torch.softmax(x, -1)
        p = torch.where(p < sampling["min_p"] * p.max(), 0.0, p)
        kth = torch.topk(p, sampling["top_k"]).values[-1]
        p = torch.where(p >= kth, p, 0.0)
        return p / p.sum()

    with torch.no_grad():
        p1 = probs(model(torch.tensor([ids])).logits[0, -1].float(), [])
        joint = {}
        for t1 in torch.nonzero(p1).flatten().tolist():
            p2 = probs(model(torch.tensor([ids + [t1]])).logits[0, -1].float(), [t1])
            for t2 in torch.nonzero(p2).flatten().tolist():
                joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jaxspec-python", required=True)
    ap.add_argument("--target", default=str(REPO / "demo" / "target"))
    ap.add_argument("--draft", default=str(REPO / "demo" / "eagle3"))
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--sample-calls", type=int, default=SAMPLE_CALLS, help=f"calls of {SAMPLE_ROWS} rows per sampled run")
    args = ap.parse_args()

    import torch
    import transformers
    from scipy import stats
    from transformers import AutoModelForCausalLM

    job = dict(prompts=PROMPTS, controls=CONTROLS, new_tokens=args.new_tokens, sampled=SAMPLED, rows=SAMPLE_ROWS,
               calls=args.sample_calls)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([args.jaxspec_python, "-c", JAXSPEC_SIDE, args.target, args.draft, json.dumps(job)],
                         check=True, env=env, stdout=subprocess.PIPE, text=True)
    js_out = json.loads(run.stdout)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; target {args.target}")
    ok = True

    print("\n1-2. greedy with controls, and raw logprobs, vs HF forward + torch processing")
    print("| controls | run | tokens equal (per prompt) | max abs logprob diff | top-5 ids equal | mean accept | min margin |")
    print("|---|---|---|---|---|---|---|")
    for name, controls in CONTROLS.items():
        oracle = [hf_greedy(model, torch, ids, controls, args.new_tokens) for ids in js_out["ids"]]
        margin = min(o[3] for o in oracle)
        for key, res in js_out["greedy"].items():
            if not key.startswith(name + "/"):
                continue
            equal = [t == o[0] for t, o in zip(res["tokens"], oracle)]
            diff = max(float(np.abs(np.asarray(lp) - np.asarray(o[1][:len(lp)])).max()) for lp, o in
                       zip(res["logprobs"], oracle))
            top_equal = all([k for k, _ in row] == [k for k, _ in o_row] for top, o in zip(res["top"], oracle)
                            for row, o_row in zip(top, o[2]))
            ok &= all(equal) and diff < 2e-4 and top_equal
            print(f"| {name} | {key.split('/', 1)[1]} | {equal} | {diff:.2e} | {top_equal} | {res['accept']:.2f} | "
                  f"{margin:.3f} |")

    print(f"\n3. sampled first two tokens ({SAMPLED}), {SAMPLE_ROWS * args.sample_calls} draws per run, vs exact")
    joint = hf_joint(model, torch, js_out["ids"][0], SAMPLED)
    outcomes = sorted(joint)
    probs = np.asarray([joint[o] for o in outcomes])
    print(f"support: {len(outcomes)} outcomes; P(second token repeats the first) = "
          f"{sum(p for (a, b), p in joint.items() if a == b):.4f}")
    print("| run | chi-square p | total variation | draws outside the support |")
    print("|---|---|---|---|")
    for run_name, pairs in js_out["sampled"].items():
        index = {o: i for i, o in enumerate(outcomes)}
        counts = np.zeros(len(outcomes))
        outside = 0
        for a, b in pairs:
            if (a, b) in index:
                counts[index[(a, b)]] += 1
            else:
                outside += 1
        expected = probs * counts.sum()
        small = expected < 5
        obs = np.append(counts[~small], counts[small].sum())
        exp = np.append(expected[~small], expected[small].sum())
        keep = exp > 0
        p = float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)
        tv = 0.5 * float(np.abs(counts / max(counts.sum(), 1) - probs).sum())
        ok &= p > 1e-3 and outside == 0
        print(f"| {run_name} | {p:.3f} | {tv:.4f} | {outside} |")
    print("\nOK" if ok else "\nMISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
