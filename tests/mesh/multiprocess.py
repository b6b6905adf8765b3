"""Two processes, one mesh: ``jax.distributed`` on this machine (two virtual CPU devices per
process, gloo collectives), run by ``tests/mesh/test_multiprocess.py`` in the suite's background.

    python -m tests.mesh.multiprocess                 # starts both processes, prints their JSON results
    python -m tests.mesh.multiprocess WORKER I PORT   # one of them (process I), what the launcher runs

Each process runs the same script (docs/support.md's multi-host example, between the ``docs``
markers below) and prints one JSON line: its greedy outputs on a TP=2 x DP=2 mesh (data parallel
across the processes, tensor parallel within each) with an EAGLE-3 draft, chain and tree, and
plain on a TP=4 mesh (tensor parallel across them); the bytes it read loading each (its own
count and the kernel's ``rchar``); and the errors of a mesh leaving a process out and of
processes loading different checkpoints. The launcher bounds the run in time and kills both
processes on any failure; each process also dies with the launcher and on its own deadline.
"""

from __future__ import annotations

import json
import os
import sys

from scripts.processes import cpu_env, die_with_parent, run_processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(ROOT, "tests", "data", "golden")
TARGET, DRAFT, OTHER = (os.path.join(GOLDEN, d) for d in ("llama3", "eagle3_midlayer", "llama2"))
# A hang guard, not a speed bound: the job starts with the suite and shares its two cores with
# the workers and the other jobs. Alone it takes about 35 s; in a CI run at 2796 s both processes
# were still running at 240 s and died of their own deadline.
WORKER_SECONDS = 1200  # a process's own deadline
LAUNCHER_SECONDS = 1230


def rchar() -> int:
    """Bytes this process has read through read() / pread() so far (the kernel's count)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def counted_load(load, *args, **kw):
    """``load(*args, **kw)`` and the bytes it read: the checkpoints' own counts, and the kernel's."""
    from jaxspec.model.checkpoints import checkpoint

    made, init = [], checkpoint.CheckpointTensors.__init__

    def recording(self, path):
        init(self, path)
        made.append(self)

    checkpoint.CheckpointTensors.__init__ = recording
    before = rchar()
    try:
        out = load(*args, **kw)
    finally:
        checkpoint.CheckpointTensors.__init__ = init
    return out, sum(c.bytes_read for c in made), rchar() - before


def worker(i: int, port: int) -> dict:
    import numpy as np

    golden = np.load(os.path.join(TARGET, "golden.npz"))
    prompts = [golden[f"prompt_{j}"].tolist() for j in range(3)]
    target_dir, draft_dir = TARGET, DRAFT
    result: dict = {"process": i, "want": [golden[f"greedy_{j}"].tolist() for j in range(3)]}

    # --- docs: multi-host (tests/mesh/multiprocess.py runs exactly this on each of 2 processes)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes talk over gloo
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=i)

    import jaxspec as js

    mesh = js.make_mesh(tensor_parallel=2, data_parallel=2)  # 4 devices, 2 per process
    target = js.load_model(target_dir, dtype="float32", mesh=mesh)  # each process reads its shards
    draft = js.load_draft(draft_dir, target)
    out = js.generate(target, prompts, draft=draft, spec=js.SpecConfig.chain(3),
                      sampling=js.SamplingParams(max_new_tokens=16, stop_token_ids=()))
    # out.token_ids: every request's tokens, the same on every process
    # --- docs end

    sampling = js.SamplingParams(max_new_tokens=16, stop_token_ids=())
    result["chain"] = out.token_ids
    tree = js.generate(target, prompts, draft=draft, spec=js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5),
                       sampling=js.SamplingParams(max_new_tokens=16, stop_token_ids=(), logprobs=1))
    result["tree"], result["logprobs"] = tree.token_ids, tree.logprobs
    result["top1"] = [[max(d, key=d.get) for d in row] for row in tree.top_logprobs]
    _, result["bytes_dp"], result["rchar_dp"] = counted_load(js.load_model, target_dir, dtype="float32", mesh=mesh,
                                                             progress=False)
    tp4 = js.make_mesh(tensor_parallel=4)  # the model axis across the processes
    wide, result["bytes_tp4"], result["rchar_tp4"] = counted_load(js.load_model, target_dir, dtype="float32",
                                                                  mesh=tp4, progress=False)
    result["plain_tp4"] = js.generate(wide, prompts, sampling=sampling).token_ids
    from jaxspec.mesh import same_on_every_process

    for name, fn in {
        "left_out": lambda: js.make_mesh(tensor_parallel=2),  # process 0's two devices only
        "different": lambda: js.load_model(target_dir if i == 0 else OTHER, dtype="float32", mesh=mesh),
        # process 1 never reports (as if it had failed earlier): process 0 names it instead of hanging
        "silent": lambda: same_on_every_process("test value", "x", timeout_s=3) if i == 0 else None,
    }.items():
        try:
            fn()
            result[name] = None
        except ValueError as e:
            result[name] = str(e)
    return result


def launch() -> int:
    """Starts both processes, waits for them (``LAUNCHER_SECONDS`` at most), prints their results
    (both killed when one fails or time runs out)."""
    done = run_processes(lambda i, port: [sys.executable, "-m", "tests.mesh.multiprocess", "WORKER", str(i), str(port)],
                         2, env=cpu_env(2, ROOT), timeout=LAUNCHER_SECONDS, cwd=ROOT)
    ok = True
    for i, d in enumerate(done):
        lines = [line for line in d.output.splitlines() if line.startswith('{"process"')]
        if d.returncode != 0 or not lines:
            ok = False
            print(json.dumps({"process": i, "failed": d.returncode, "log": d.output[-6000:]}), flush=True)
        else:
            print(lines[-1], flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["WORKER"]:
        die_with_parent(WORKER_SECONDS)
        print(json.dumps(worker(int(sys.argv[2]), int(sys.argv[3]))), flush=True)
    else:
        sys.exit(launch())
