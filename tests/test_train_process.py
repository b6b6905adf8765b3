"""The training tests (``tests/train``), run by pytest in a fresh process: see the note on
``collect_ignore`` in ``tests/conftest.py``. Their own output is shown when one fails."""

from __future__ import annotations

import os
import sys

import pytest

from tests.background import Job

# Started when collection selects this module (tests/conftest.py): it runs beside the rest of the suite.
BACKGROUND_JOB = Job([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/train"], timeout=1800,
                     env=dict(os.environ, JAXSPEC_TRAIN_PROCESS="1"))


@pytest.mark.slow
def test_training_tests_pass_in_their_own_process():
    proc = BACKGROUND_JOB.result()
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"tests/train failed (exit {proc.returncode}):\n{tail}"
    assert " passed" in proc.stdout and "no tests ran" not in proc.stdout, tail
