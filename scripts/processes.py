"""Runs one script as several processes of a ``jax.distributed`` job on this machine (the mesh
test, ``scripts/check_multihost.py``, ``benchmarks/load_multihost.py``): a free coordinator port,
each process's output in a file, a deadline, and every process killed as soon as one fails (the
others would wait for it in a collective) or time runs out. A process started here dies with its
launcher too (``die_with_parent``)."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Finished:
    returncode: int | None  # None: killed (another failed, or the deadline passed)
    output: str  # stdout and stderr


def run_processes(argv_of, n: int, *, env: dict[str, str], timeout: float, cwd: str | None = None) -> list[Finished]:
    """Starts ``argv_of(i, port)`` for i in 0..n-1 and waits at most ``timeout`` seconds."""
    port = free_port()
    logs = [tempfile.TemporaryFile("w+") for _ in range(n)]
    procs = [subprocess.Popen(argv_of(i, port), cwd=cwd, env=env, stdout=logs[i], stderr=subprocess.STDOUT, text=True)
             for i in range(n)]
    deadline = time.monotonic() + timeout
    killed = set()
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for i, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                killed.add(i)
            p.wait()
    out = []
    for i, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        out.append(Finished(None if i in killed else p.returncode, log.read()))
        log.close()
    return out


def die_with_parent(seconds: int | None = None) -> None:
    """In a started process: SIGKILL when the launcher dies (Linux), and SIGALRM (which ends the
    process) after ``seconds``."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if seconds:
        signal.alarm(seconds)


def cpu_env(devices_per_process: int, root: str) -> dict[str, str]:
    """The environment of a process with ``devices_per_process`` virtual CPU devices."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices_per_process}"
    return dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu", PYTHONPATH=root)
