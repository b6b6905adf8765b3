"""Loading streams: the peak resident set of a fresh process rises during ``load_model`` by at
most 1.4x the loaded parameters' bytes (on CPU the loaded params themselves are resident, so
1.0 is the floor), measured on a generated ~400 MB float16 Llama checkpoint with 3 shards."""

from __future__ import annotations

import os

import pytest

from benchmarks.load_memory import measure
from scripts.make_scale_checkpoint import write_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.slow
def test_load_model_peak_memory_is_within_1_4x_of_the_params(tmp_path):
    write_checkpoint(str(tmp_path / "ckpt"), shape="medium", shards=3, dtype="float16")
    r = measure(str(tmp_path / "ckpt"), "bfloat16", ROOT, warm=True)
    assert r["param_bytes"] > 300e6
    assert r["rise_ratio"] <= 1.4, r
