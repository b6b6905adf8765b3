"""jaxspec's tokenizers against HF transformers' ``AutoTokenizer`` (not run in CI).

    VENV/bin/python scripts/check_tokenizers_hf.py --jaxspec-python .venv/bin/python

``VENV`` has transformers (torch is not needed); ``--jaxspec-python`` is the project's venv (jaxspec
runs in a subprocess). jaxspec tokenizes with the checkpoint's ``tokenizer.json`` as written (the
``tokenizers`` library); transformers 5 rebuilds some classes' pipelines itself. This writes small
tokenizers of each style the target families ship, each with and without a BOS post-processor,
under each ``tokenizer_class`` and ``add_bos_token`` a checkpoint may give, and compares token ids
(with and without special tokens) and decoded texts on texts with leading and repeated spaces,
special tokens inside the text, newlines and non-ASCII. One row per style and class, the
``add_bos_token`` values and BOS variants folded into it.

Styles:
- ``byte-level``: byte-level BPE (Llama 3, Qwen, DeepSeek);
- ``sp-legacy``: SentencePiece pieces with Llama 2's original normalizer (a space marker prepended to
  every piece of text, spaces replaced), its decoder (Replace, ByteFallback, Fuse, Strip);
- ``sp-metaspace``: the same pieces through a ``Metaspace`` pre-tokenizer (the marker prepended to the
  first piece only) and the Llama decoder, as newer Llama-style ``tokenizer.json`` files are written;
- ``sp-gemma``: spaces replaced by the marker, nothing prepended (Gemma).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARK = "\u2581"
TEXTS = ["the cat sat.", " leading space", "a  b", "h\u00e9llo\nworld", "<s>the cat", "the</s><s> cat", "ab, cd.", ""]
WORDS = ["the", "cat", "sat", "ab", "cd", "llo", "world", "lead", "ing", "space"]
CLASSES = {
    "byte-level": ["PreTrainedTokenizerFast", "LlamaTokenizerFast", "Qwen2TokenizerFast"],
    "sp-legacy": ["PreTrainedTokenizerFast", "LlamaTokenizerFast", "LlamaTokenizer"],
    "sp-metaspace": ["PreTrainedTokenizerFast", "LlamaTokenizerFast", "LlamaTokenizer"],
    "sp-gemma": ["PreTrainedTokenizerFast", "GemmaTokenizerFast"],
}


def build(style: str, bos: bool):
    """A ``tokenizers.Tokenizer`` of ``style`` (ids 0-2: <unk> <s> </s>)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    if style == "byte-level":
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        for c in sorted(alphabet):
            vocab[c] = len(vocab)
        merges = []
        for w in WORDS:  # each word, and each word after a space, as one token
            for word in (w, "\u0120" + w):
                parts = list(word)
                while len(parts) > 1:
                    merges.append((parts[0], parts[1]))
                    parts = [parts[0] + parts[1]] + parts[2:]
                    vocab.setdefault(parts[0], len(vocab))
        tok = Tokenizer(models.BPE(vocab=vocab, merges=list(dict.fromkeys(merges)), unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        pieces = [f"<0x{b:02X}>" for b in range(256)] + [MARK, ".", ","]
        pieces += list("abcdefghijklmnopqrstuvwxyz") + [MARK + c for c in "abcdefghijklmnopqrstuvwxyz"]
        pieces += WORDS + [MARK + w for w in WORDS]
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        for p in pieces:
            vocab.setdefault(p, len(vocab))
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
        llama_decoder = decoders.Sequence([decoders.Replace(MARK, " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
        if style == "sp-legacy":
            tok.normalizer = normalizers.Sequence([normalizers.Prepend(MARK), normalizers.Replace(" ", MARK)])
            tok.decoder = llama_decoder
        elif style == "sp-metaspace":
            tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=MARK, prepend_scheme="first", split=False)
            tok.decoder = llama_decoder
        else:
            tok.normalizer = normalizers.Replace(" ", MARK)
            tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
            tok.decoder = decoders.Sequence([decoders.Replace(MARK, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    return tok


def write_cases(root: str) -> list[dict]:
    cases = []
    for style, classes in CLASSES.items():
        for bos, cls, add_bos in itertools.product([False, True], classes, [None, True, False]):
            d = os.path.join(root, f"{style}-{'bos' if bos else 'nobos'}-{cls}-{add_bos}")
            os.makedirs(d, exist_ok=True)
            build(style, bos).save(os.path.join(d, "tokenizer.json"))
            cfg = {"tokenizer_class": cls, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                   "pad_token": "<unk>"}
            if add_bos is not None:
                cfg["add_bos_token"] = add_bos
            with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
                json.dump(cfg, f)
            cases.append(dict(dir=d, style=style, bos=bos, cls=cls, add_bos=add_bos))
    return cases


def encode_all(cases: list[dict], side: str) -> dict:
    out = {}
    for c in cases:
        try:
            if side == "hf":
                from transformers import AutoTokenizer

                t = AutoTokenizer.from_pretrained(c["dir"])
                ids = [[t.encode(x, add_special_tokens=s) for x in TEXTS] for s in (True, False)]
                texts = [t.decode(i, skip_special_tokens=True) for i in ids[0]]
            else:
                sys.path.insert(0, str(REPO))
                from jaxspec.model.checkpoints.tokenizer import load_tokenizer

                t = load_tokenizer(c["dir"])
                ids = [[t.encode(x, add_special_tokens=s) for x in TEXTS] for s in (True, False)]
                texts = [t.decode(i) for i in ids[0]]
            out[c["dir"]] = dict(ids=ids, texts=texts)
        except Exception as e:  # noqa: BLE001 - a refusal is a result
            out[c["dir"]] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
    return out


def differences(hf: dict, js: dict) -> list[str]:
    if "error" in hf or "error" in js:
        return [f"hf: {hf.get('error', 'ok')}; jaxspec: {js.get('error', 'ok')}"]
    out = []
    for s, label in ((0, "with special tokens"), (1, "without")):
        for text, a, b in zip(TEXTS, hf["ids"][s], js["ids"][s]):
            if a != b:
                out.append(f"{text!r} {label}: hf {a}, jaxspec {b}")
    for text, a, b in zip(TEXTS, hf["texts"], js["texts"]):
        if a != b:
            out.append(f"decode of {text!r}: hf {a!r}, jaxspec {b!r}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--jaxspec-python", help="the project's venv python (runs the jaxspec side)")
    p.add_argument("--side", choices=["hf", "jaxspec"], help=argparse.SUPPRESS)
    p.add_argument("--cases", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--details", action="store_true", help="print every differing text under its row")
    args = p.parse_args(argv)
    if args.side:  # a side's subprocess
        with open(args.cases) as f:
            cases = json.load(f)
        with open(args.out, "w") as f:
            json.dump(encode_all(cases, args.side), f)
        return 0
    if not args.jaxspec_python:
        p.error("--jaxspec-python is required")
    import tokenizers
    import transformers

    with tempfile.TemporaryDirectory() as root:
        cases = write_cases(root)
        cases_file = os.path.join(root, "cases.json")
        with open(cases_file, "w") as f:
            json.dump(cases, f)
        results = {}
        for side, python in (("hf", sys.executable), ("jaxspec", args.jaxspec_python)):
            out = os.path.join(root, f"{side}.json")
            subprocess.run([python, __file__, "--side", side, "--cases", cases_file, "--out", out], check=True,
                           env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
            with open(out) as f:
                results[side] = json.load(f)
        print(f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__} "
              f"(the HF side); {len(TEXTS)} texts, ids with and without special tokens, decoded texts\n")
        print("| tokenizer.json | tokenizer_class | cases | same ids and texts | differ |")
        print("|---|---|---:|---:|---|")
        total = 0
        order = sorted(cases, key=lambda c: (list(CLASSES).index(c["style"]), CLASSES[c["style"]].index(c["cls"])))
        for (style, cls), group in itertools.groupby(order, key=lambda c: (c["style"], c["cls"])):
            group = sorted(group, key=lambda c: (c["bos"], str(c["add_bos"])))
            diffs = {c["dir"]: differences(results["hf"][c["dir"]], results["jaxspec"][c["dir"]]) for c in group}
            bad = [c for c in group if diffs[c["dir"]]]
            total += len(bad)
            kinds = sorted({d.split(":")[0] for c in bad for d in diffs[c["dir"]]})
            print(f"| {style} | {cls} | {len(group)} | {len(group) - len(bad)} | "
                  f"{'; '.join(kinds) if kinds else ''} |")
            if args.details:
                for c in bad:
                    print(f"    bos post-processor {c['bos']}, add_bos_token {c['add_bos']}:")
                    for d in diffs[c["dir"]]:
                        print(f"      {d}")
        print(f"\n{total} of {len(cases)} cases differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
