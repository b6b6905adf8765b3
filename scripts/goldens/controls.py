#!/usr/bin/env python
"""Records the generation-controls golden: greedy continuations of a tiny HF checkpoint under logit
bias, repetition / presence / frequency penalties and min-p, with the raw log-probabilities of every
emitted token and the top 5, computed by HF ``transformers`` (the model) and torch (the processing).

Not run in CI; it needs torch + transformers (the venv of ``scripts/goldens/targets.py``):

    VENV/bin/python scripts/goldens/controls.py     # writes tests/data/golden/controls/golden.json

The model is the ``llama3`` golden checkpoint (``tests/data/golden/llama3``). Each step runs HF's full
forward over the whole sequence (no cache) and applies the controls as vLLM v1 documents them, in its
order: logit bias, then the repetition penalty over prompt and output tokens (a positive logit divided,
any other multiplied), then ``frequency * count + presence * (count > 0)`` subtracted over output tokens;
greedy takes the argmax (temperature, min-p, top-k and top-p do not move it). Log-probabilities are
``log_softmax`` of the raw logits (before any control). The smallest top-1 minus top-2 gap of the
processed logits over every step is written down per case, so a reader knows how robust the argmax is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from scripts.goldens.common import GOLDEN, arguments, head, write_json  # noqa: E402

NEW_TOKENS = 24
TOP = 5

# name -> SamplingParams fields (JSON-friendly: logit_bias keys are strings in the file).
CASES = {
    "repetition": dict(repetition_penalty=1.5),
    "repetition_below_one": dict(repetition_penalty=0.7, frequency_penalty=-0.5),
    "presence_frequency": dict(presence_penalty=1.5, frequency_penalty=0.8),
    "logit_bias": dict(logit_bias={"7": 4.0, "31": 2.5, "200": -3.0}),
    "all": dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5,
                logit_bias={"7": 1.5, "96": -2.0}, min_p=0.1),
}


def process(logits, prompt: list[int], output: list[int], c: dict):
    """vLLM v1's logit processing for one row: bias, repetition, frequency, presence."""
    import torch

    x = logits.clone()
    for t, b in c.get("logit_bias", {}).items():
        x[int(t)] += b
    V = x.shape[0]
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V).to(x.dtype) if output \
        else torch.zeros(V, dtype=x.dtype)
    in_prompt = torch.zeros(V, dtype=torch.bool)
    in_prompt[torch.tensor(prompt)] = True
    rep = c.get("repetition_penalty", 1.0)
    seen = in_prompt | (counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - c.get("frequency_penalty", 0.0) * counts - c.get("presence_penalty", 0.0) * (counts > 0).to(x.dtype)
    return x


def main() -> None:
    arguments(__doc__).parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    case = next(c for c in manifest["cases"] if c["name"] == "llama3")
    model = AutoModelForCausalLM.from_pretrained(GOLDEN / case["dir"], dtype=torch.float32).eval()
    prompts = case["prompts"]
    out = dict(**head(__file__, "transformers", "torch"), model=case["dir"], prompts=prompts, new_tokens=NEW_TOKENS,
               top=TOP, cases=[])
    for name, controls in CASES.items():
        rows, margin = [], np.inf
        for prompt in prompts:
            seq, emitted, chosen_lp, top_ids, top_lp = list(prompt), [], [], [], []
            with torch.no_grad():
                for _ in range(NEW_TOKENS):
                    logits = model(torch.tensor([seq])).logits[0, -1].float()
                    processed = process(logits, prompt, emitted, controls)
                    two = torch.topk(processed, 2).values
                    margin = min(margin, float(two[0] - two[1]))
                    tok = int(torch.argmax(processed))
                    lp = torch.log_softmax(logits, dim=-1)
                    best = torch.topk(lp, TOP)
                    chosen_lp.append(float(lp[tok]))
                    top_ids.append(best.indices.tolist())
                    top_lp.append(best.values.tolist())
                    emitted.append(tok)
                    seq.append(tok)
            plain = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            rows.append(dict(tokens=emitted, logprobs=chosen_lp, top_ids=top_ids, top_logprobs=top_lp,
                             differs_from_plain=emitted != plain))
        out["cases"].append(dict(name=name, controls=controls, min_margin=margin, rows=rows))
        print(f"{name:22s} min margin {margin:.4f}, differs from plain greedy on "
              f"{sum(r['differs_from_plain'] for r in rows)}/{len(rows)} prompts")
    dest = GOLDEN / "controls"
    dest.mkdir(exist_ok=True)
    write_json(dest / "golden.json", out, indent=1)
    print(f"wrote {dest / 'golden.json'}")


if __name__ == "__main__":
    main()
