"""Checks the exported demo DFlash draft in the reference ``dflash`` package (not run in CI).

    python3.11 scripts/check_demo_dflash_hf.py --jaxspec-python .venv/bin/python [--prompts 4]

Run it with a Python that has ``torch``, ``transformers`` and ``dflash`` (``pip install --no-deps
dflash``); ``--jaxspec-python`` is an interpreter with jaxspec's dependencies (called for jaxspec's
side). The reference loads ``demo/dflash`` (``DFlashDraftModel.from_pretrained``: the published
layout jaxspec exported) and the demo target, and runs its ``dflash_generate`` greedy on held-out
stdlib prompts; jaxspec runs ``SpecConfig.chain(block_size - 1)`` on the same prompts. Both in float32.
Reports whether the tokens are equal and how many per-step acceptance lengths agree (the reference
shrinks its block near the end, so only the steps it ran with a whole block are compared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JAXSPEC_SIDE = r"""
import json, sys
import jaxspec as js
from jaxspec.train.corpus import file_prompts, spread_by_package, stdlib_files
target_dir, draft_dir, out, n, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
t = js.load_model(target_dir, dtype="float32", progress=False)
d = js.load_draft(draft_dir, t)
prompts = file_prompts(t.tokenizer, spread_by_package(stdlib_files("heldout")), count, 64)
res = js.generate(t, prompts, draft=d, spec=js.SpecConfig.chain(d.block_size - 1),
                  sampling=js.SamplingParams(max_new_tokens=n, stop_token_ids=()),
                  engine=js.EngineConfig(max_batch=len(prompts), max_seq_len=64 + n + 32), progress=False)
json.dump(dict(prompts=prompts, tokens=res.token_ids, accept=[s.accept_lens for s in res.stats],
               block_size=d.block_size), open(out, "w"))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=os.path.join(REPO, "demo", "target"))
    ap.add_argument("--draft", default=os.path.join(REPO, "demo", "dflash"))
    ap.add_argument("--jaxspec-python", required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=96)
    args = ap.parse_args()

    import dflash
    import dflash.model as ref
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "jaxspec.json")
        subprocess.run([args.jaxspec_python, "-c", JAXSPEC_SIDE, args.target, args.draft, out, str(args.new_tokens),
                        str(args.prompts)], check=True, env=dict(os.environ, PYTHONPATH=REPO))
        mine = json.load(open(out))
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    draft = ref.DFlashDraftModel.from_pretrained(args.draft, dtype=torch.float32).eval()
    ref._cuda_time = time.perf_counter  # its stats path synchronizes CUDA
    bs = draft.block_size
    tokens_equal, compared, agreed, accepts = True, 0, 0, []
    for p, toks, acc in zip(mine["prompts"], mine["tokens"], mine["accept"]):
        res = ref.dflash_generate(draft, target, torch.tensor([p]), args.new_tokens, None, temperature=0.0,
                                  return_stats=True)
        theirs = res.output_ids[0, len(p):].tolist()
        tokens_equal &= theirs == toks
        start, limit = len(p), len(p) + args.new_tokens
        for i, a in enumerate(res.acceptance_lengths):
            if start + bs >= limit:
                break
            compared += 1
            agreed += int(i < len(acc) and acc[i] == a)
            start += a
        accepts.append(float(np.mean(res.acceptance_lengths)))
    report = dict(transformers=transformers.__version__, torch=torch.__version__,
                  dflash=getattr(dflash, "__version__", "?"), block_size=bs, prompts=len(mine["prompts"]),
                  tokens_equal=tokens_equal, accept_steps_compared=compared, accept_steps_equal=agreed,
                  reference_mean_accept=[round(a, 3) for a in accepts],
                  jaxspec_mean_accept=[round(float(np.mean(a)), 3) for a in mine["accept"]])
    print(json.dumps(report, indent=1))
    ok = tokens_equal and agreed == compared
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
