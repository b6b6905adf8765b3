"""Checks that HF transformers loads the demo target and agrees with jaxspec (not run in CI).

    python3.11 scripts/check_demo_hf.py --jaxspec-python .venv/bin/python [--target demo/target]

Run it with a Python that has ``torch`` and ``transformers``; ``--jaxspec-python`` is an
interpreter with jaxspec's dependencies (this script calls it to compute jaxspec's logits).
It loads the target with ``AutoModelForCausalLM`` / ``AutoTokenizer``, checks the tokenizers
agree, compares float32 logits on a code prompt (max abs difference), and compares a short
greedy continuation from HF ``generate`` with ``jaxspec.generate``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

PROMPT = 'import os\n\n\ndef read_config(path):\n    """Read a JSON config file."""\n'
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JAXSPEC_SIDE = r"""
import json, sys
import numpy as np
import jaxspec as js
from jaxspec.model.targets import forward_sequence
target_dir, prompt, out, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
m = js.load_model(target_dir, dtype="float32", progress=False)
ids = m.tokenizer.encode(prompt)
logits, _, _ = forward_sequence(m, [ids])
gen = js.generate(m, [ids], sampling=js.SamplingParams(max_new_tokens=n, stop_token_ids=()), progress=False)
np.savez(out, ids=np.asarray(ids), logits=np.asarray(logits[0]), greedy=np.asarray(gen.token_ids[0]))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=os.path.join(REPO, "demo", "target"))
    ap.add_argument("--jaxspec-python", required=True)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "jaxspec.npz")
        env = dict(os.environ, PYTHONPATH=REPO)
        subprocess.run([args.jaxspec_python, "-c", JAXSPEC_SIDE, args.target, PROMPT, out, str(args.new_tokens)],
                       check=True, env=env)
        ref = dict(np.load(out))
    tok = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    same_ids = ids[0].tolist() == ref["ids"].tolist()
    with torch.no_grad():
        logits = model(ids).logits[0].numpy()
        gen = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, ids.shape[1]:].tolist()
    diff = float(np.abs(logits - ref["logits"]).max())
    report = dict(
        transformers=transformers.__version__, torch=torch.__version__, architecture=type(model).__name__,
        params=sum(p.numel() for p in model.parameters()), tokenizer_ids_equal=same_ids,
        logits_max_abs_diff=diff, logits_max_abs=float(np.abs(ref["logits"]).max()),
        argmax_equal=bool((logits.argmax(-1) == ref["logits"].argmax(-1)).all()),
        greedy_equal=gen == ref["greedy"].tolist(),
    )
    print(json.dumps(report, indent=1))
    print("HF continuation:\n" + tok.decode(gen))
    ok = same_ids and report["argmax_equal"] and report["greedy_equal"] and diff < 1e-3
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
