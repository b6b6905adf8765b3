"""Trains the demo's byte-level BPE tokenizer on the training split of the Python stdlib.

    PYTHONPATH=. python scripts/train_demo_tokenizer.py [--vocab-size 4096] [--out demo/target]

Writes ``tokenizer.json`` and ``tokenizer_config.json`` (HF ``PreTrainedTokenizerFast``) into
``--out``. Held-out files (``jaxspec.train.corpus.is_held_out``) are never read. Id 0 is
``<|endoftext|>``, the document separator and eos token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxspec.train.corpus import read_text, stdlib_files  # noqa: E402

EOS = "<|endoftext|>"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--out", default="demo/target")
    args = ap.parse_args()
    files = stdlib_files("train")
    print(f"training a {args.vocab_size}-token byte-level BPE on {len(files)} stdlib files")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size, min_frequency=2, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True,
    )
    tok.train_from_iterator((read_text(root, rel) for root, rel in files), trainer, length=len(files))
    os.makedirs(args.out, exist_ok=True)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": EOS, "eos_token": EOS, "unk_token": None, "pad_token": None,
            "add_prefix_space": False, "clean_up_tokenization_spaces": False, "model_max_length": 2048,
        }, f, indent=2)
        f.write("\n")
    print(f"vocab {tok.get_vocab_size()} -> {args.out}/tokenizer.json")


if __name__ == "__main__":
    main()
