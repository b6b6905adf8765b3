#!/usr/bin/env python
"""Independent check of DeepSeek's V4 DSpark layout outside the suite: random draft shapes (1-3 stages,
blocks of 2-5 slots, 1-3 tapped layers among the tiny V4 golden target's 4, Markov rank 16-64, with and
without a confidence head) built and decoded by the reference of ``scripts/goldens/deepseek_v4_dspark.py``,
then jaxspec on the same checkpoints: greedy tokens and per-step accept lengths of the three golden prompts
(a ragged batch), pages 1 and 16, the whole block and (with a confidence head) a confidence-scheduled chain.

Runs in the torch venv of ``scripts/goldens/deepseek_v4.py``; the jaxspec side in the project's venv:

    VENV/bin/python scripts/check_v4_dspark.py --jaxspec-python .venv/bin/python --cases 6 [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from scripts.goldens import deepseek_v4_dspark as ref  # noqa: E402
from scripts.goldens.common import start  # noqa: E402

JAXSPEC_SIDE = r"""
import json, sys
import numpy as np
import jaxspec as js
results = {}
for case_dir in sys.argv[1:]:
    g = np.load(f"{case_dir}/golden.npz")
    meta = json.load(open(f"{case_dir}/manifest.json"))
    target = js.load_model(case_dir, dtype="float32", progress=False)
    draft = js.load_draft(case_dir, target)
    t = np.load(meta["target_golden"])
    prompts = [t[f"prompt_{i}"].tolist() for i in range(3)]
    runs = [(page, None) for page in (1, 16)] + ([(4, 0.5)] if meta["confidence_head"] else [])
    out_case = []
    for page, c in runs:
        spec = js.SpecConfig.chain(meta["block_size"], confidence_threshold=c)
        out = js.generate(target, prompts, draft=draft, spec=spec, sampling=js.SamplingParams(max_new_tokens=24),
                          progress=False, engine=js.EngineConfig(page_size=page, max_batch=4, max_seq_len=96))
        tokens = all(out.token_ids[i] == g[f"generate/p{i}/tokens"].tolist() for i in range(3))
        accepts = c is not None or all(
            list(s.accept_lens)[:-1] == g[f"generate/p{i}/accept"].tolist()[:len(s.accept_lens) - 1]
            for i, s in enumerate(out.stats))
        verified = float(np.mean(np.concatenate([s.verify_lens for s in out.stats])))
        out_case.append({"page": page, "confidence": c, "tokens_equal": tokens, "accepts_equal": accepts,
                         "verified": verified})
    results[case_dir] = out_case
print(json.dumps(results))
"""


def draw_shape(rng: random.Random) -> ref.Shape:
    n = rng.randint(1, 3)
    return ref.Shape(stages=rng.randint(1, 3), block=rng.randint(2, 5), taps=tuple(sorted(rng.sample(range(4), n))),
                     rank=rng.choice((16, 32, 64)), noise=rng.randrange(64), confidence=rng.random() >= 0.3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jaxspec-python", required=True)
    ap.add_argument("--cases", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    start()  # autograd off, as in the golden makers
    rng = random.Random(args.seed)
    model, golden = ref.load_target()
    with tempfile.TemporaryDirectory() as tmp:
        dirs, shapes = [], {}
        for c in range(args.cases):
            shape = draw_shape(rng)
            d = Path(tmp) / f"case{c}"
            m = ref.write_case(d, model, golden, shape, 70_000 + 1000 * args.seed + 100 * c, log=lambda s: None)
            m["target_golden"] = str(ref.TARGET / "golden.npz")
            (d / "manifest.json").write_text(json.dumps(m))
            dirs.append(str(d))
            shapes[str(d)] = (shape, m["acceptance_lengths"])
            print(f"case {c}: {shape}, reference accept lengths {m['acceptance_lengths']}", flush=True)
        env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
        out = subprocess.run([args.jaxspec_python, "-c", JAXSPEC_SIDE, *dirs], env=env, check=True,
                             capture_output=True, text=True)
        results = json.loads(out.stdout.strip().splitlines()[-1])
    runs = [r for rs in results.values() for r in rs]
    for d, rs in results.items():
        print(f"{Path(d).name}: " + ", ".join(
            f"page {r['page']}{'' if r['confidence'] is None else ' c=0.5'}: tokens {r['tokens_equal']}, "
            f"accepts {r['accepts_equal']}, verified {r['verified']:.2f}" for r in rs))
    print(f"{args.cases} cases, {len(runs)} runs: tokens equal {sum(r['tokens_equal'] for r in runs)}, "
          f"accept lengths equal {sum(r['accepts_equal'] for r in runs if r['confidence'] is None)} of "
          f"{sum(r['confidence'] is None for r in runs)}")
    if not all(r["tokens_equal"] and r["accepts_equal"] for r in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
