"""Where a compiled step spends its device time: the GPU kernels of a few calls, from JAX's profiler.

``trace_kernels(run, steps)`` runs ``run()`` (which does ``steps`` steps and blocks) under
``jax.profiler`` and reads the Chrome trace it writes (``*.trace.json.gz``, no TensorBoard plugin
needed): every complete event on a device process (``/device:GPU:0`` and its streams) is one kernel
or copy. Per step it reports the device's busy time (the union of its kernels' intervals), the span
from the first kernel's start to the last one's end, and the time per kernel class (``KINDS``: the
products, the Pallas kernels, XLA fusions, copies) and per kernel name, so a step's time splits into
the products' share (weights streamed), the other kernels', and idle gaps between launches.
``benchmarks/gpu_check.py`` (item ``profile``) runs it on the 8B decode program.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile

# Kernel classes by name, first match wins (cuBLAS on Hopper names its kernels nvjet_* / sm90_xmma_*).
KINDS = (
    ("product (cuBLAS / GEMM)", re.compile(r"gemm|gemv|cublas|cutlass|xmma|nvjet|matmul|splitk", re.I)),
    ("paged attention (Pallas)", re.compile(r"paged_attention", re.I)),
    ("other Pallas kernels", re.compile(r"kv_move|gather_extras|mla_|dsa_|exact_|fixed_matmul", re.I)),
    ("copy / memset", re.compile(r"memcpy|memset|copy", re.I)),
    ("XLA fusions and other", re.compile(r".")),
)


def kind_of(name: str) -> str:
    return next(kind for kind, pattern in KINDS if pattern.search(name))


def device_events(trace: dict) -> list[dict]:
    """Complete events (``ph == "X"``) on device processes (a name with ``/device:`` that is not a host)."""
    events = trace.get("traceEvents", [])
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, name in names.items() if "/device:" in name and "host" not in name.lower()}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in devices and "dur" in e]


def busy_us(events: list[dict]) -> float:
    """Length of the union of the events' intervals (kernels on several streams may overlap)."""
    total, end = 0.0, None
    for start, stop in sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def summarize(events: list[dict], steps: int, top: int = 25) -> dict:
    """Per-step device time: busy, span, per class and the ``top`` kernel names."""
    if not events:
        return dict(kernels=0, busy_us_per_step=None, span_us_per_step=None, kinds={}, top=[])
    by_name = collections.defaultdict(lambda: [0.0, 0])
    by_kind = collections.defaultdict(float)
    for e in events:
        name = str(e.get("name", "?"))
        by_name[name][0] += float(e["dur"])
        by_name[name][1] += 1
        by_kind[kind_of(name)] += float(e["dur"])
    start = min(float(e["ts"]) for e in events)
    stop = max(float(e["ts"]) + float(e["dur"]) for e in events)
    names = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(
        kernels=len(events), kernels_per_step=len(events) / steps,
        busy_us_per_step=busy_us(events) / steps, span_us_per_step=(stop - start) / steps,
        kinds={k: v / steps for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        top=[dict(name=n[:160], kind=kind_of(n), us_per_step=t / steps, calls_per_step=c / steps)
             for n, (t, c) in names],
    )


def read_trace(log_dir: str) -> dict:
    paths = sorted(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz")),
                   key=os.path.getmtime)
    if not paths:
        raise FileNotFoundError(f"the profiler wrote no *.trace.json.gz under {log_dir}")
    with gzip.open(paths[-1], "rt") as f:
        return json.load(f)


def trace_kernels(run, steps: int, keep: str | None = None) -> dict:
    """``summarize`` of the device kernels of ``run()`` (``steps`` steps, blocking). ``keep``: a
    path to copy the gzipped trace to (it opens in Perfetto or chrome://tracing)."""
    import jax

    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        trace = read_trace(log_dir)
    if keep:
        with gzip.open(keep, "wt") as f:
            json.dump(trace, f)
    return summarize(device_events(trace), steps)
