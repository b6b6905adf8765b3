"""``jaxspec serve``'s options reach the engine it builds (no server started, nothing compiled)."""

from __future__ import annotations

import argparse
import os

import pytest

import jaxspec as js

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


def test_the_compile_buckets_reach_the_engine():
    base = ("--target", os.path.join(GOLDEN, "llama3"), "--draft", "ngram", "--max-batch", "4", "--max-seq-len", "64")
    _, _, core = build_core(parse(*base, "--min-prefill-bucket", "32", "--min-kv-bucket", "48",
                                  "--min-prefill-rows", "2"))
    try:
        config = core.eng.config
        assert (config.min_prefill_bucket, config.min_kv_bucket, config.min_prefill_rows) == (32, 48, 2)
    finally:
        core.close()
    _, _, core = build_core(parse(*base))
    try:  # not given: EngineConfig's defaults
        config, default = core.eng.config, js.EngineConfig()
        assert (config.min_prefill_bucket, config.min_kv_bucket, config.min_prefill_rows) == (
            default.min_prefill_bucket, default.min_kv_bucket, default.min_prefill_rows)
    finally:
        core.close()
    with pytest.raises(ValueError, match="EngineConfig.min_prefill_rows must be a positive int, got 0"):
        build_core(parse(*base, "--min-prefill-rows", "0"))
