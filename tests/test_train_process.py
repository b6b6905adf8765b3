"""The training tests (``tests/train``), run by pytest in a fresh process: see the note on
``collect_ignore`` in ``tests/conftest.py``. Their own output is shown when one fails."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_training_tests_pass_in_their_own_process():
    env = dict(os.environ, JAXSPEC_TRAIN_PROCESS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/train"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"tests/train failed (exit {proc.returncode}):\n{tail}"
    assert " passed" in proc.stdout and "no tests ran" not in proc.stdout, tail
