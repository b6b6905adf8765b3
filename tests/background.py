"""Subprocess workloads of the suite (the mesh worker, the training tests, the gpu_check dry
run), started as soon as collection has selected their test (``tests/conftest.py``) so that they
run beside this process, which compiles one XLA:CPU program at a time and leaves part of a 2-core
machine idle. A test module names its workload ``BACKGROUND_JOB = Job(...)`` and its test waits
for ``result()``; run alone, the test starts the job itself."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Job:
    """One command run once per pytest session, its output kept in temporary files (a pipe
    nobody reads until the end could fill and stall the child). ``{tmp}`` in ``args`` becomes a
    fresh directory (``self.tmp``), removed when the session ends."""

    started: list[Job] = []

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, timeout: float):
        self.args, self.env, self.timeout = args, env, timeout
        self._proc = self._result = self.tmp = None

    def start(self) -> None:
        if self._proc is not None:
            return
        if any("{tmp}" in a for a in self.args):
            self.tmp = tempfile.mkdtemp(prefix="jaxspec-test-")
            self.args = [a.replace("{tmp}", self.tmp) for a in self.args]
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self._deadline = time.monotonic() + self.timeout
        # A session of its own: stop() ends the command with every process it started.
        self._proc = subprocess.Popen(self.args, cwd=ROOT, env=self.env, stdout=self._out, stderr=self._err,
                                      text=True, start_new_session=True)
        Job.started.append(self)

    def result(self) -> subprocess.CompletedProcess:
        """Waits for the command (starting it if collection did not) and returns its exit status
        and output; raises ``subprocess.TimeoutExpired`` past ``timeout`` seconds from its start."""
        if self._result is None:
            self.start()
            try:
                code = self._proc.wait(timeout=max(0.0, self._deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop()
                raise
            outputs = []
            for f in (self._out, self._err):
                f.seek(0)
                outputs.append(f.read())
                f.close()
            self._result = subprocess.CompletedProcess(self.args, code, *outputs)
        return self._result

    def stop(self) -> None:
        """Kills the command (and what it started) if it still runs and removes its directory."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
