"""``benchmarks/gpu_check.py --dry-run``: every stage of the first-GPU-session script runs at
tiny shapes with Pallas in interpret mode (pytest only collects), and writes its JSON and
markdown summaries and a block table, so the script is known to work before a GPU sees it."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from tests.background import ROOT, Job

REPO = Path(ROOT)

# The dry run in a process of its own, started when collection selects this module (tests/conftest.py),
# so that it runs beside the rest of the suite.
BACKGROUND_JOB = Job([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", "{tmp}"],
                     timeout=1200, env=dict(os.environ, PYTHONPATH=ROOT))


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_dry_run_runs_every_stage():
    gpu_check = _gpu_check()
    proc = BACKGROUND_JOB.result()
    rc, tmp_path = proc.returncode, Path(BACKGROUND_JOB.tmp)
    assert (tmp_path / "gpu_check.json").exists(), f"gpu_check.py wrote no summary (exit {rc}):\n{proc.stderr[-4000:]}"
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    stages = summary["stages"]
    assert list(stages) == list(gpu_check.STAGES)
    for name, entry in stages.items():
        assert not entry.get("error"), f"{name}: {entry.get('error')}"
    assert rc == 0
    assert stages["pytest"]["result"]["returncode"] == 0
    assert "tests collected" in stages["pytest"]["result"]["summary"]
    check = stages["check"]["result"]
    assert check["failed"] == 0 and {r["kind"] for r in check["results"]} == {"attention", "mla", "indexer", "kv_move", "gather"}
    assert {r["kind"] for r in stages["kernels"]["result"]["results"]} == {"attention", "mla", "indexer", "kv_move", "gather"}
    sweep = stages["sweep"]["result"]
    table = json.loads((tmp_path / "block_table.json").read_text())
    assert set(table[sweep["gpu"]]["blocks"]) == {r["class"] for r in sweep["results"]} == {
        "paged_attention/verify/d16/p16", "mla_attention/decode/d32/p16"}
    steps = stages["steps"]["result"]
    assert steps["returncode"] == 0 and "step_timing.py --out" in steps["command"]
    configs = ["plain", "chain S=5", "tree S=5 k=4 n=8", "dflash chain S=15 (block 16)"]
    assert [r["config"] for r in steps["rows"]] == [c + extra for c in configs for extra in ("", " + controls")]
    assert all(r["controls_on_vs_off"] > 0 for r in steps["rows"][1::2])
    assert all(r["ms_per_step"] > 0 for r in steps["rows"])
    md = (tmp_path / "gpu_check.md").read_text()
    for name in gpu_check.STAGES:
        assert f"## {name}" in md

    # A later invocation adds its stages to the same summary.
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--stages", "env"]) == 0
    assert list(json.loads((tmp_path / "gpu_check.json").read_text())["stages"]) == list(gpu_check.STAGES)
