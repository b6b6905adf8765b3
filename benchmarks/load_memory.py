"""Load time and peak host memory of ``jaxspec.load_model``, each load in a fresh process.

    PYTHONPATH=. python scripts/make_scale_checkpoint.py /tmp/llama1b          # 2.5 GB float16, 3 shards
    PYTHONPATH=. python benchmarks/load_memory.py /tmp/llama1b --dtype bfloat16 [--baseline-tree DIR]

For each run it reports the seconds ``load_model`` took (until the params are on the device) and
how much the process's peak resident set (VmHWM, which counts touched memory-mapped file pages)
rose over its value after JAX initialized, as a ratio to the loaded parameters' bytes. On a CPU
the device memory is host memory, so the loaded params themselves count once (ratio >= 1).
``--baseline-tree`` runs the same measurement with another checkout's jaxspec (e.g. a worktree
of an older commit), alternating with this one, so both are measured side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp

def hwm():  # peak resident set, bytes
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

import gc
import jaxspec as js
jnp.ones(8).block_until_ready()  # JAX initialized, a device allocated
if sys.argv[3] == "warm":  # load once first: compiled programs and allocator pools are not the loader's data
    jax.block_until_ready(js.load_model(sys.argv[1], dtype=sys.argv[2], progress=False).params)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
before = hwm()
t = time.perf_counter()
model = js.load_model(sys.argv[1], dtype=sys.argv[2], progress=False)
jax.block_until_ready(model.params)
seconds = time.perf_counter() - t
param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
print(json.dumps(dict(seconds=seconds, param_bytes=param_bytes, rss_before=before, rss_peak=hwm(),
                      jaxspec=js.__file__)))
"""


def measure(path: str, dtype: str, tree: str, warm: bool = False) -> dict:
    """One load in a fresh process. ``warm``: a first load compiles the loader's programs and is
    thrown away, and the peak is reset before the measured one (for small checkpoints, whose
    data would otherwise be dwarfed by compiler memory)."""
    env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    # -P: without it, `-c` puts the working directory first on sys.path, and a jaxspec there
    # would shadow the tree asked for.
    out = subprocess.run([sys.executable, "-P", "-c", CHILD, path, dtype, "warm" if warm else "cold"], env=env,
                         capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not os.path.samefile(os.path.dirname(os.path.dirname(r["jaxspec"])), tree):
        raise RuntimeError(f"measured {r['jaxspec']}, not the jaxspec of {tree}")
    r["rise_ratio"] = (r["rss_peak"] - r["rss_before"]) / r["param_bytes"]
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--baseline-tree", default=None, help="another checkout to compare with (its jaxspec)")
    args = ap.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [("this tree", here)] + ([("baseline", os.path.abspath(args.baseline_tree))] if args.baseline_tree else [])
    runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for _ in range(args.repeats):  # alternate, so both see the same machine load and page cache
        for name, tree in trees:
            runs[name].append(measure(args.checkpoint, args.dtype, tree))
    print(f"{'loader':<10} {'seconds':>8} {'peak rise GB':>13} {'params GB':>10} {'rise / params':>14}")
    for name, rs in runs.items():
        sec = statistics.median(r["seconds"] for r in rs)
        rise = statistics.median(r["rss_peak"] - r["rss_before"] for r in rs)
        pb = rs[0]["param_bytes"]
        print(f"{name:<10} {sec:8.1f} {rise / 1e9:13.2f} {pb / 1e9:10.2f} {rise / pb:14.2f}")
    print(json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
