"""Structured output against an independent oracle: HF transformers' greedy search with a logits
processor that allows exactly the tokens the ``regex`` module's partial matching allows (EOS only at a
full match), on the demo target, versus jaxspec's constrained output, plain and speculative (EAGLE-3
chain and tree, DFlash chain, n-gram). JSON-schema outputs are validated with ``jsonschema``. Not run
in CI:

    /path/to/torch-venv/bin/python scripts/check_structured_hf.py --jaxspec-python .venv/bin/python [--prompts 8]

The torch venv needs torch, transformers, regex and jsonschema; ``--jaxspec-python`` runs jaxspec in a
subprocess. The oracle decodes each token's bytes with the tokenizer's byte-level alphabet (so it
needs no jaxspec code) and checks text, so the regexes here are ASCII.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, kind, constraint, oracle regex: the same language written as a regex, for the HF side)
CASES = [
    ("signature", "regex", r"def [a-z_]{1,16}\((self|cls)?(, [a-z_]{1,10}){0,3}\):", None),
    ("numbers", "regex", r"[0-9]{1,3}(, [0-9]{1,3}){0,8}", None),
    ("assignment", "regex", r"[a-z_]{1,12} = (None|True|False|[0-9]{1,4}|'[a-z ]{0,12}')", None),
    ("record", "json_schema",
     {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                       "size": {"type": "integer", "minimum": 10, "maximum": 99},
                                       "ok": {"type": "boolean"}},
      "required": ["name", "size"], "additionalProperties": False},
     # The schema's language written by hand as a regex: outlines-core's string characters and escapes,
     # at most one space between tokens, the optional property after the required ones.
     r'\{ ?"name" ?: ?"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt]){0,8}" ?, ?"size" ?: ?[1-9][0-9]'
     r'( ?, ?"ok" ?: ?(true|false))? ?\}'),
]
RUNS = {
    "plain": None,
    "eagle3-chain": ("eagle3", dict(num_steps=4, topk=1, num_draft_tokens=5)),
    "eagle3-tree": ("eagle3", dict(num_steps=4, topk=4, num_draft_tokens=10)),
    "dflash-chain": ("dflash", dict(num_steps=7, topk=1, num_draft_tokens=8)),
    "ngram-chain": ("ngram", dict(num_steps=4, topk=1, num_draft_tokens=5)),
}

JAXSPEC_SIDE = r"""
import json, sys
import jaxspec as js
from jaxspec.train.corpus import file_prompts, spread_by_package, stdlib_files
repo, n_prompts, new_tokens, out_path, cases, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]), json.loads(sys.argv[6])
target = js.load_model(f"{repo}/demo/target", dtype="float32", progress=False)
drafts = {"eagle3": js.load_draft(f"{repo}/demo/eagle3", target), "dflash": js.load_draft(f"{repo}/demo/dflash", target),
          "ngram": js.NgramDraft(max_ngram=3)}
prompts = file_prompts(target.tokenizer, spread_by_package(stdlib_files("heldout")), n_prompts, 48)
result = {"prompts": prompts, "runs": {}}
for name, kind, constraint, _ in cases:
    sp = js.SamplingParams(max_new_tokens=new_tokens, **{kind: constraint})
    for run, how in runs.items():
        kw = {} if how is None else dict(draft=drafts[how[0]], spec=js.SpecConfig(**how[1]))
        out = js.generate(target, prompts, sampling=sp, engine=js.EngineConfig(max_batch=16, max_seq_len=256),
                          progress=False, **kw)
        result["runs"][f"{name}/{run}"] = dict(tokens=out.token_ids, texts=out.texts,
                                             finish=[s.finish_reason for s in out.stats], accept=out.mean_accept_len)
json.dump(result, open(out_path, "w"))
"""


def byte_texts(tok) -> list[str | None]:
    """Each token id's text from its byte-level form (None: special or not UTF-8 alone)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet, n = {}, 0
    for b in range(256):
        alphabet[chr(b) if b in keep else chr(256 + n)] = b
        n += b not in keep
    out = [None] * len(tok)
    special = set(tok.all_special_ids)
    for piece, i in tok.get_vocab().items():
        if i in special:
            continue
        try:
            out[i] = bytes(alphabet[c] for c in piece).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            out[i] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jaxspec-python", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()

    import jsonschema
    import regex
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "jaxspec.json")
        subprocess.run([args.jaxspec_python, "-c", JAXSPEC_SIDE, REPO, str(args.prompts), str(args.new_tokens), out,
                        json.dumps(CASES), json.dumps(RUNS)], check=True, env=dict(os.environ, PYTHONPATH=REPO))
        ref = json.load(open(out))
    target = os.path.join(REPO, "demo", "target")
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    texts = byte_texts(tok)
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, int) else eos[0]

    class PartialMatch(LogitsProcessor):
        def __init__(self, pattern: str, prompt_len: int):
            self.pattern, self.prompt_len = regex.compile(pattern), prompt_len

        def __call__(self, input_ids, scores):
            for b in range(input_ids.shape[0]):
                done = "".join(texts[t] for t in input_ids[b, self.prompt_len:].tolist())
                ok = torch.tensor([t is not None and t != "" and self.pattern.fullmatch(done + t, partial=True)
                                   is not None for t in texts] + [False] * (scores.shape[-1] - len(texts)))
                ok[eos] = self.pattern.fullmatch(done) is not None
                if not ok.any():  # a complete match nothing extends: end here
                    ok[eos] = True
                scores[b] = torch.where(ok, scores[b], torch.tensor(-float("inf")))
            return scores

    failures = 0
    for name, kind, constraint, oracle_regex in CASES:
        pattern = constraint if kind == "regex" else oracle_regex
        equal = {run: 0 for run in RUNS}
        valid = 0
        for i, prompt in enumerate(ref["prompts"]):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=eos,
                                     logits_processor=LogitsProcessorList([PartialMatch(pattern, len(prompt))]))
            hf = gen[0, len(prompt):].tolist()
            if hf and hf[-1] == eos:
                hf = hf[:-1]
            for run in RUNS:
                got = ref["runs"][f"{name}/{run}"]["tokens"][i]
                equal[run] += got == hf
                if got != hf:
                    print(f"  {name}/{run} prompt {i}: jaxspec {tok.decode(got)!r} vs HF {tok.decode(hf)!r}")
            if kind == "json_schema":
                text, finish = ref["runs"][f"{name}/plain"]["texts"][i], ref["runs"][f"{name}/plain"]["finish"][i]
                if finish == "stop":
                    jsonschema.validate(json.loads(text), constraint)
                    valid += 1
        n = len(ref["prompts"])
        accept = {run: round(ref["runs"][f"{name}/{run}"]["accept"], 2) for run in RUNS if run != "plain"}
        line = f"{name}: equal to HF + oracle: " + ", ".join(f"{run} {equal[run]}/{n}" for run in RUNS)
        line += f"; accept lengths {accept}" + (f"; complete and valid JSON {valid}/{n}" if kind == "json_schema" else "")
        print(line)
        failures += sum(n - v for v in equal.values())
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
