"""Bytes each process reads and its peak host memory while ``load_model`` streams a checkpoint onto
a mesh, on one process and on two (``jax.distributed`` on this machine, CPU devices, gloo).

    PYTHONPATH=. python scripts/make_scale_checkpoint.py /tmp/llama1b          # 2.5 GB float16, 3 shards
    PYTHONPATH=. python benchmarks/load_multihost.py /tmp/llama1b --dtype bfloat16

Layouts (processes x devices each, mesh): 1 x 1 no mesh; 1 x 2 TP=2; 2 x 1 TP=2 (the model axis
across the processes); 2 x 2 TP=4; 2 x 2 TP=2 x DP=2 (data across the processes: each holds a whole
model). Each process reports the bytes it read during ``load_model`` (the kernel's ``rchar``: every
read, config files included), the bytes of the parameter shards its devices hold, the rise of its
peak resident set (VmHWM, which counts the CPU "device" memory too) over its value after JAX
initialized, and the load's seconds. Every load runs in fresh processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from processes import cpu_env, run_processes  # noqa: E402

LAYOUTS = [(1, 1, 1, 1), (1, 2, 2, 1), (2, 1, 2, 1), (2, 2, 4, 1), (2, 2, 2, 2)]  # processes, devices, tp, dp

CHILD = r"""
import json, sys, time
from processes import die_with_parent
die_with_parent(1800)
path, dtype, i, port, n, tp, dp = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:8])
import jax
if n > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n, process_id=i)
import jax.numpy as jnp
import jaxspec as js

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

def rchar():
    with open("/proc/self/io") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("rchar:"))

jnp.ones(8).block_until_ready()  # JAX initialized, a device allocated
mesh = js.make_mesh(tensor_parallel=tp, data_parallel=dp) if tp * dp > 1 else None
before, read0, t = status("VmHWM"), rchar(), time.perf_counter()
model = js.load_model(path, dtype=dtype, mesh=mesh, progress=False)
jax.block_until_ready(model.params)
seconds, read = time.perf_counter() - t, rchar() - read0
held = sum(s.data.nbytes for x in jax.tree.leaves(model.params) for s in x.addressable_shards)
print("RESULT " + json.dumps(dict(process=i, seconds=seconds, read=read, held=held, rise=status("VmHWM") - before)))
"""


def run(path: str, dtype: str, layout: tuple[int, int, int, int]) -> list[dict]:
    n, devices, tp, dp = layout
    done = run_processes(lambda i, port: [sys.executable, "-c", CHILD, path, dtype, str(i), str(port), str(n),
                                          str(tp), str(dp)],
                         n, env=cpu_env(devices, ROOT) | {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "scripts")])},
                         timeout=1800, cwd=ROOT)
    out = []
    for i, d in enumerate(done):
        lines = [line for line in d.output.splitlines() if line.startswith("RESULT ")]
        if d.returncode != 0 or not lines:
            raise RuntimeError(f"process {i} of {layout} failed (exit {d.returncode}):\n{d.output[-3000:]}")
        out.append(json.loads(lines[-1][len("RESULT "):]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    size = sum(os.path.getsize(os.path.join(args.checkpoint, f)) for f in os.listdir(args.checkpoint)
               if f.endswith(".safetensors"))
    print(f"checkpoint: {size / 1e9:.2f} GB of safetensors")
    print(f"{'processes x devices':>19} {'mesh':>10} {'process':>7} {'read GB':>8} {'read / ckpt':>11} "
          f"{'held GB':>8} {'peak rise GB':>12} {'seconds':>8}")
    rows = []
    for layout in LAYOUTS:
        n, devices, tp, dp = layout
        for r in run(args.checkpoint, args.dtype, layout):
            rows.append(dict(layout=layout, **r))
            mesh = "none" if tp * dp == 1 else f"TP={tp}" + (f" x DP={dp}" if dp > 1 else "")
            print(f"{f'{n} x {devices}':>19} {mesh:>10} {r['process']:>7} {r['read'] / 1e9:8.2f} "
                  f"{r['read'] / size:11.2f} {r['held'] / 1e9:8.2f} {r['rise'] / 1e9:12.2f} {r['seconds']:8.1f}",
                  flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
