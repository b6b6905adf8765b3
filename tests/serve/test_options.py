"""``jaxspec serve``'s options reach the engine it builds (no server started, nothing compiled)."""

from __future__ import annotations

import argparse
import os

import pytest

from jaxspec.serve import command
from jaxspec.serve.server import build_core
from tests.model.golden import GOLDEN


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    command.add_parsers(parser.add_subparsers(dest="cmd", required=True))
    return parser.parse_args(["serve", *argv])


def test_exact_reaches_the_engine_and_what_it_cannot_compute_is_refused_at_start():
    args = parse("--target", os.path.join(GOLDEN, "llama3"), "--draft", "ngram", "--dtype", "bfloat16", "--exact",
                 "--max-batch", "2", "--max-seq-len", "64")
    _, _, core = build_core(args)
    try:
        assert core.eng.config.exact and core.eng.config.prefix_cache is not False
    finally:
        core.close()
    _, _, core = build_core(parse("--target", os.path.join(GOLDEN, "llama3"), "--draft", "ngram", "--max-batch", "2",
                                  "--max-seq-len", "64"))
    try:
        assert not core.eng.config.exact  # off unless asked
    finally:
        core.close()
    with pytest.raises(ValueError, match="exact=True.*sliding-window layers"):
        build_core(parse("--target", os.path.join(GOLDEN, "sliding_window", "mistral_swa"), "--draft", "ngram",
                         "--exact", "--max-batch", "2", "--max-seq-len", "64"))
