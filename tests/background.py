"""Subprocess workloads of the suite (the mesh worker, the two-process run, the training tests,
the gpu_check dry run). A test module names its workload ``BACKGROUND_JOB = Job(...)`` and its
test waits for ``result()``.

The jobs start as soon as the run knows its tests, in the process that schedules them (the
xdist controller under ``pytest -n 2``, or the only process), and run beside the workers, which
run every other test first and the tests that wait for a job last (``tests/conftest.py``): no
worker sits idle while a job runs. A job writes its output, exit status and any files into its
own directory under the run's job directory (``JAXSPEC_TEST_JOBS``), so the worker that runs its
test reads it from there, whichever process started it. Run alone, the test starts the job itself.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS_ENV = "JAXSPEC_TEST_JOBS"
# Set by tests/conftest.py when pytest is given --exhaustive, before any test module is imported: a
# job's command can then name the exhaustive cases too (the command is fixed when its module loads).
EXHAUSTIVE_ENV = "JAXSPEC_TEST_EXHAUSTIVE"


def exhaustive_run() -> bool:
    """True when this run includes the exhaustive matrices (``pytest --exhaustive``)."""
    return os.environ.get(EXHAUSTIVE_ENV) == "1"


def jobs_dir() -> str:
    """The run's job directory, made (and named in the environment, for the workers) on first use."""
    if not os.environ.get(JOBS_ENV):
        os.environ[JOBS_ENV] = tempfile.mkdtemp(prefix="jaxspec-test-jobs-")
    return os.environ[JOBS_ENV]


class Job:
    """One command run once per pytest session. ``{tmp}`` in ``args`` becomes the job's own
    directory (``self.tmp``); its output goes to files there (a pipe nobody reads until the end
    could fill and stall the child)."""

    started: list[Job] = []  # started by this process (stopped at the end of the session)

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, timeout: float):
        self.args, self.env, self.timeout = list(args), env, timeout
        self.name = hashlib.sha1("\0".join(self.args).encode()).hexdigest()[:12]
        self._proc = self._result = None

    @property
    def tmp(self) -> str:
        return os.path.join(jobs_dir(), self.name)

    def _path(self, what: str) -> str:
        return os.path.join(self.tmp, "_job." + what)

    def start(self) -> None:
        """Starts the command unless this run already did (in this process or another)."""
        os.makedirs(self.tmp, exist_ok=True)
        try:
            os.close(os.open(self._path("started"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        args = [a.replace("{tmp}", self.tmp) for a in self.args]
        # The exit status lands in a file the moment the command ends, for whoever waits.
        script = f'"$@" >{shlex.quote(self._path("out"))} 2>{shlex.quote(self._path("err"))}; ' \
                 f'echo $? >{shlex.quote(self._path("rc.tmp"))} && mv {shlex.quote(self._path("rc.tmp"))} ' \
                 f'{shlex.quote(self._path("rc"))}'
        # A session of its own: stop() ends the command with every process it started.
        self._proc = subprocess.Popen(["bash", "-c", script, "job", *args], cwd=ROOT, env=self.env,
                                      start_new_session=True)
        Job.started.append(self)

    def result(self) -> subprocess.CompletedProcess:
        """Waits for the command (starting it if nobody did) and returns its exit status and
        output; raises ``subprocess.TimeoutExpired`` past ``timeout`` seconds of waiting."""
        if self._result is None:
            self.start()
            deadline = time.monotonic() + self.timeout
            while not os.path.exists(self._path("rc")):
                if time.monotonic() > deadline:
                    self.stop()
                    raise subprocess.TimeoutExpired(self.args, self.timeout)
                time.sleep(0.5)  # waiting for another process's command, not for time to pass
            if self._proc is not None:
                self._proc.wait()
            with open(self._path("rc")) as f:
                code = int(f.read().strip() or 1)
            outputs = []
            for what in ("out", "err"):
                with open(self._path(what)) as f:
                    outputs.append(f.read())
            self._result = subprocess.CompletedProcess(self.args, code, *outputs)
        return self._result

    def stop(self) -> None:
        """Kills the command (and what it started) if this process started it and it still runs."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait()


def remove_jobs_dir() -> None:
    if os.environ.get(JOBS_ENV):
        shutil.rmtree(os.environ[JOBS_ENV], ignore_errors=True)
