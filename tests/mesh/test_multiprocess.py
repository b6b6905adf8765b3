"""Several hosts for real: two processes on this machine joined by ``jax.distributed`` (two
virtual CPU devices each, gloo collectives) run docs/support.md's multi-host script on one mesh
spanning both (``multiprocess.py``, started in the suite's background). Both get the whole
result, equal to HF's greedy tokens (which one-device greedy reproduces:
tests/model/targets/test_golden_targets.py); each reads only its shards' bytes of the checkpoint."""

from __future__ import annotations

import json
import os
import struct
import sys

import pytest

from tests.background import ROOT, Job
from tests.mesh.multiprocess import LAUNCHER_SECONDS, TARGET

pytestmark = pytest.mark.slow

BACKGROUND_JOB = Job([sys.executable, "-m", "tests.mesh.multiprocess"], timeout=LAUNCHER_SECONDS + 30,
                     env=dict(os.environ, PYTHONPATH=ROOT))


@pytest.fixture(scope="module")
def processes() -> list[dict]:
    proc = BACKGROUND_JOB.result()
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"process"')]
    failed = [r for r in out if "failed" in r]
    assert proc.returncode == 0 and len(out) == 2 and not failed, (
        f"exit {proc.returncode}: " + "\n".join(f"process {r['process']} (exit {r['failed']}):\n{r['log']}"
                                                 for r in failed) + proc.stderr[-3000:])
    return sorted(out, key=lambda r: r["process"])


def test_every_process_gets_the_whole_greedy_result(processes):
    """TP=2 x DP=2 (data across the processes) with an EAGLE-3 draft, chain and tree, and plain
    decoding on TP=4 (the model axis across them): every request's tokens on both processes, and
    the tree's log-probabilities (gathered from the rows each process holds) alike on both."""
    for r in processes:
        for run in ("chain", "tree", "plain_tp4"):
            assert r[run] == r["want"], (r["process"], run)
        assert r["top1"] == r["want"]  # greedy: each emitted token is the most likely
        assert all(lp <= 0 for row in r["logprobs"] for lp in row) and list(map(len, r["logprobs"])) == [16] * 3
    assert processes[0]["logprobs"] == processes[1]["logprobs"]


def _tensor_bytes(path: str) -> tuple[int, dict[str, int]]:
    """(header bytes, {tensor: bytes}) of a safetensors file, read here independently."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n, {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def test_each_process_reads_only_its_shards_bytes(processes):
    """On TP=4 a process holds model shards {0, 1} or {2, 3}: half of every split tensor (the
    norms are whole everywhere), so it reads about half the checkpoint; on TP=2 x DP=2 it holds
    every shard and reads each tensor once (not once per data replica). Counted by the loader and
    by the kernel (``rchar``: every read of the process, config files included)."""
    header, sizes = _tensor_bytes(os.path.join(TARGET, "model.safetensors"))
    whole = header + sum(sizes.values())
    half = header + sum(n if "norm" in k else n // 2 for k, n in sizes.items())
    for r in processes:
        assert r["bytes_dp"] == whole, r["bytes_dp"]
        assert r["bytes_tp4"] == half, (r["bytes_tp4"], half)
        assert half < 0.52 * whole
        for counted, kernel in ((r["bytes_dp"], r["rchar_dp"]), (r["bytes_tp4"], r["rchar_tp4"])):
            assert 0 <= kernel - counted < 16_384, (counted, kernel)  # config.json, generation_config.json


def test_bad_multi_process_setups_are_refused(processes):
    for r in processes:
        assert "leaves out every device of process(es) [1]" in r["left_out"]
        assert "differs between the processes of this jax.distributed job" in r["different"]
    assert "process 1 did not report its test value within 3 s" in processes[0]["silent"]


def test_docs_show_what_the_test_runs():
    """The multi-host example in docs/support.md is the processes' script, line for line."""
    with open(os.path.join(ROOT, "tests", "mesh", "multiprocess.py")) as f:
        src = f.read()
    body = src.split("# --- docs: multi-host")[1].split("# --- docs end")[0]
    lines = [line[4:] for line in body.splitlines()[1:] if line.strip()]  # the worker's indent off
    with open(os.path.join(ROOT, "docs", "support.md")) as f:
        doc = "\n".join(line for line in f.read().splitlines() if line.strip())
    assert "\n".join(lines) in doc
