"""Structured output: the host cost of building an automaton and the device memory of its table,
for a Llama-3-sized vocabulary, and acceptance with and without a constraint on the demo pair.

    PYTHONPATH=. .venv/bin/python benchmarks/structured_cost.py [--vocab 128256] [--tokenizer PATH]

No Llama-3 tokenizer can be downloaded here, so a byte-level BPE of the same vocabulary size is
trained on the Python sources at hand, the standard library and the venv's site-packages
(tokenizers' trainer, a few minutes; cached under the system's temp directory), unless
``--tokenizer`` names a ``tokenizer.json``. For each example
constraint it prints the automaton's states and token classes, its table's bytes (the call's
padded ``[states, classes]`` int32 table plus the ``[vocab]`` class map) against a dense
``[states, vocab]`` int32 table, and the host seconds of a cold build and of a cached one. Then, on
the demo pair (its real tokenizer, EAGLE-3 head and DFlash draft), the mean accept length and the
time per verify step with and without a constraint (one ``Engine`` per configuration, the second
call of each measured).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

import jaxspec as js
from jaxspec.demo import DEMO_DRAFT, DEMO_TARGET
from jaxspec.model.checkpoints.tokenizer import Tokenizer, load_tokenizer
from jaxspec.structured import compile_constraint, compile_constraints

RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "pattern": r"^[a-z0-9.]+@[a-z0-9]+\.(com|org)$"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 5},
    "score": {"type": "number", "minimum": -1, "maximum": 1},
    "active": {"type": "boolean"},
}, "required": ["name", "age"], "additionalProperties": False}
EXAMPLES = [
    ("regex", "numbers", r"[0-9]{1,3}(, [0-9]{1,3})*"),
    ("regex", "signature", r"def [a-z_]{1,16}\((self|cls)?(, [a-z_]{1,10}){0,3}\):"),
    ("json_schema", "record (README)", json.dumps(RECORD)),
    ("json_schema", "list of records", json.dumps({"type": "array", "items": RECORD, "maxItems": 4})),
    ("json_schema", "nested + anyOf", json.dumps({"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1},
        "owner": RECORD,
        "status": {"enum": ["open", "closed", "merged"]},
        "parent": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]}},
        "required": ["id", "owner", "status"], "additionalProperties": False})),
]


def proxy_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` ids trained on the standard library (cached)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    import sysconfig

    from jaxspec.train.corpus import list_files, read_text, stdlib_files

    path = os.path.join(tempfile.gettempdir(), f"jaxspec-bpe-{vocab_size}.json")
    if not os.path.exists(path):
        print(f"training a {vocab_size}-token byte-level BPE on Python sources...", file=sys.stderr)
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=["<|eos|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        files = stdlib_files("all") + list_files(sysconfig.get_paths()["purelib"], (".py", ".pyi", ".md", ".txt"), ())
        tok.train_from_iterator((read_text(root, rel) for root, rel in files), trainer, length=len(files))
        tok.save(path)
    return load_tokenizer(path)


def table_sizes(tokenizer: Tokenizer, vocab: int) -> list[dict]:
    rows = []
    for kind, name, text in EXAMPLES:
        t0 = time.perf_counter()
        auto = compile_constraint(tokenizer, vocab, kind, text)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        compile_constraint(tokenizer, vocab, kind, text)
        cached = time.perf_counter() - t0
        joined, _ = compile_constraints(tokenizer, vocab, [(kind, text)])
        rows.append(dict(name=name, states=auto.num_states, classes=auto.next_state.shape[1],
                         table_bytes=joined.nbytes, dense_bytes=auto.num_states * vocab * 4,
                         padded=list(joined.next_state.shape), cold_s=cold, cached_s=cached))
    return rows


def demo_runs(new_tokens: int) -> list[dict]:
    from jaxspec.train.corpus import file_prompts, spread_by_package, stdlib_files

    target = js.load_model(DEMO_TARGET, dtype="float32", progress=False)
    drafts = {"EAGLE-3 chain 4": (js.load_draft(DEMO_DRAFT, target), js.SpecConfig.chain(4)),
              "EAGLE-3 tree 4x10": (js.load_draft(DEMO_DRAFT, target), js.SpecConfig(num_steps=4, topk=4,
                                                                                    num_draft_tokens=10)),
              "DFlash chain 7": (js.load_draft(DEMO_DRAFT.replace("eagle3", "dflash"), target), js.SpecConfig.chain(7))}
    prompts = file_prompts(target.tokenizer, spread_by_package(stdlib_files("heldout")), 8, 48)
    constraints = {"none": {}, "signature regex": dict(regex=EXAMPLES[1][2]),
                   "record schema": dict(json_schema=RECORD)}
    rows = []
    for dname, (draft, spec) in drafts.items():
        for cname, kw in constraints.items():
            eng = js.Engine(target, draft=draft, spec=spec, engine=js.EngineConfig(max_batch=8, max_seq_len=256))
            sp = js.SamplingParams(max_new_tokens=new_tokens, **kw)
            eng.generate(prompts, sampling=sp)  # compiles
            out = eng.generate(prompts, sampling=sp)
            steps = sum(len(s.accept_lens) for s in out.stats) / len(prompts)
            rows.append(dict(draft=dname, constraint=cname, accept=out.mean_accept_len,
                             ms_per_step=out.wall_seconds / max(steps, 1) * 1e3,
                             tokens=sum(s.num_tokens for s in out.stats)))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json instead of the trained proxy")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--skip-demo", action="store_true")
    args = ap.parse_args(argv)
    tok = load_tokenizer(args.tokenizer) if args.tokenizer else proxy_tokenizer(args.vocab)
    vocab = max(args.vocab, tok.vocab_size)
    print(f"vocabulary: {tok.vocab_size} tokens ({vocab} ids)")
    print("| constraint | states | classes | padded table | table + class map | dense [states, V] | cold build s | cached |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for r in table_sizes(tok, vocab):
        print(f"| {r['name']} | {r['states']} | {r['classes']} | {r['padded'][0]} x {r['padded'][1]} | "
              f"{r['table_bytes'] / 2**20:.2f} MiB | {r['dense_bytes'] / 2**20:.0f} MiB | {r['cold_s']:.2f} | "
              f"{r['cached_s'] * 1e3:.1f} ms |", flush=True)
    if not args.skip_demo:
        print("\n| draft | constraint | mean accept length | ms per verify step (wall, incl. host) | tokens |")
        print("|---|---|---:|---:|---:|")
        for r in demo_runs(args.new_tokens):
            print(f"| {r['draft']} | {r['constraint']} | {r['accept']:.2f} | {r['ms_per_step']:.1f} | {r['tokens']} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
