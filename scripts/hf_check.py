"""What the random-checkpoint checks against HF share (``check_targets_hf.py``, ``check_dsa_hf.py``):
the jaxspec side, run in the project's own venv on the saved cases, and the per-prompt comparison.

Each case directory holds an HF checkpoint and a ``check.json`` with ``prompts``, ``new_tokens`` and
optionally ``drafts`` ({name: checkpoint folder relative to the case, "." for the target's own MTP
layer}); each draft runs a chain and a tree beside the plain and n-gram runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Run by the jaxspec venv's python with the case directories as arguments; prints {case_dir: {"tokens":
# {run name: [token ids per prompt]}, "accept": {run name: mean accept length}}}. All prompts of a case
# go in one batch (ragged).
JAXSPEC_SIDE = r"""
import json, os, sys
import jax
import jaxspec as js
results = {}
for case_dir in sys.argv[1:]:
    meta = json.load(open(f"{case_dir}/check.json"))
    target = js.load_model(case_dir, dtype="float32", progress=False)
    ngram = js.NgramDraft(max_ngram=3)
    runs = {
        "plain/p16": (16, {}),
        "ngram chain/p1": (1, dict(draft=ngram, spec=js.SpecConfig.chain(4))),
        "ngram tree/p16": (16, dict(draft=ngram, spec=js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6))),
    }
    for i, (name, where) in enumerate(meta.get("drafts", {}).items()):  # "." is the target's own dir (MTP)
        draft = js.load_draft(os.path.join(case_dir, where), target, dtype="float32")
        chain_page = (4, 1)[i % 2]
        runs[f"{name} chain/p{chain_page}"] = (chain_page, dict(draft=draft, spec=js.SpecConfig.chain(3)))
        runs[f"{name} tree/p16"] = (16, dict(draft=draft, spec=js.SpecConfig(num_steps=3, topk=3, num_draft_tokens=8)))
    sampling = js.SamplingParams(max_new_tokens=meta["new_tokens"], stop_token_ids=())
    results[case_dir] = {"tokens": {}, "accept": {}}
    for name, (page, kw) in runs.items():
        out = js.generate(target, meta["prompts"], sampling=sampling, engine=js.EngineConfig(page_size=page),
                          progress=False, **kw)
        results[case_dir]["tokens"][name] = [list(map(int, t)) for t in out.token_ids]
        results[case_dir]["accept"][name] = sum(s.mean_accept_len for s in out.stats) / len(out.stats)
    del target
    jax.clear_caches()  # each case compiles new programs; XLA:CPU's code mappings go with the cache
json.dump(results, sys.stdout)
"""


def run_jaxspec(python: str, case_dirs: list[str]) -> dict[str, dict]:
    """Greedy tokens and mean accept lengths of every jaxspec run of every case (plain first), from
    ``python`` (the jaxspec venv)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([python, "-c", JAXSPEC_SIDE, *case_dirs], check=True, env=env, stdout=subprocess.PIPE,
                         text=True)
    return json.loads(run.stdout)


def prompts_differing(tokens: dict[str, list[list[int]]], want: list[list[int]]) -> str:
    """'equal', or which runs differ from ``want`` on which prompts."""
    bad = {name: [i for i, (a, b) in enumerate(zip(toks, want)) if a != b] for name, toks in tokens.items()}
    bad = {k: v for k, v in bad.items() if v}
    return "equal" if not bad else "differ (" + ", ".join(f"{k} prompts {v}" for k, v in bad.items()) + ")"


def speculative_equals_plain(tokens: dict[str, list[list[int]]]) -> bool:
    return all(toks == tokens["plain/p16"] for toks in tokens.values())


def arguments(doc: str, default_cases: int) -> argparse.ArgumentParser:
    """The options every check takes; a check adds its own before parsing."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jaxspec-python", required=True, help="the python of the jaxspec venv (.venv/bin/python)")
    ap.add_argument("--cases", type=int, default=default_cases)
    ap.add_argument("--seed", type=int, default=0, help="case i uses seed + i")
    ap.add_argument("--keep", type=Path, help="keep the checkpoints in this folder")
    return ap


def make_and_run(args: argparse.Namespace, make_case: Callable[[Path, int, int], dict]):
    """``make_case(case_dir, seed, i)`` for each case (HF side, this process), then every jaxspec run
    of every case (one subprocess). Returns the case dirs, their check.json contents and the tokens."""
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        dirs, metas = [], []
        for i in range(args.cases):
            d = root / f"case{args.seed + i}"
            metas.append(make_case(d, args.seed + i, i))
            dirs.append(str(d))
            print(f"case {args.seed + i} saved", file=sys.stderr)
        return dirs, metas, run_jaxspec(args.jaxspec_python, dirs)
