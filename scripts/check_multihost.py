"""Several hosts, checked outside the suite: random HF checkpoints with odd vocabularies, and two
jaxspec processes joined by ``jax.distributed`` (two CPU devices each, gloo), each loading its own
copy of every checkpoint (another directory, as on another host), against HF's greedy tokens.

    python3.11 scripts/check_multihost.py --jaxspec-python .venv/bin/python [--cases 4] [--seed 0]
                                          [--families llama,qwen3,deepseek_v3,qwen3_5]

Case i draws a target of family i (in turn) as ``check_targets_hf.py`` does, with heads that split over
4 model shards and a vocabulary of 251, 509 or 1001 tokens (no mesh splits it without padding), its
perturbed copy as a standalone draft and,
for DeepSeek-V3 / Qwen3.5, a random MTP layer. Every process runs each case on a TP=2 x DP=2 mesh
(data across the processes) and on TP=4 (the model axis across them), where the model splits:
plain decoding, and each draft as a chain of 3 and a tree of 6 tokens, one ragged batch of three
prompts. Both processes must return the same tokens, equal to HF's (a case with a top-1 / top-2 logit
margin below 1e-4 is a near-tie, reported but not failed). Also printed: the bytes each process read
loading each target (the loader's count, headers included), and as a ratio to TP=2 x DP=2 (where
each process holds every model shard): about half on TP=4, plus what every shard holds whole (norms;
DeepSeek's latent projections, router and MTP-free remainder; a Gated DeltaNet's per-head norm).
Exit status 1 on any difference.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_targets_hf import FAMILIES, make_case  # noqa: E402
from hf_check import REPO, arguments, prompts_differing  # noqa: E402
from processes import cpu_env, run_processes  # noqa: E402

VOCABS = (251, 509, 1001)
MIN_LOGIT_MARGIN = 1e-4

# One process of the job: argv = process id, coordinator port, then its own copies of the case dirs.
JAXSPEC_SIDE = r"""
import json, os, sys
sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "scripts"))
from processes import die_with_parent
die_with_parent(3000)
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{sys.argv[2]}", num_processes=2, process_id=int(sys.argv[1]))
import jaxspec as js
from jaxspec.model.checkpoints import checkpoint

opened, init = [], checkpoint.CheckpointTensors.__init__
def recording(self, path):  # the loader's own count of the bytes it reads (headers included)
    init(self, path)
    opened.append(self)
checkpoint.CheckpointTensors.__init__ = recording

out = {}
for case_dir in sys.argv[3:]:
    meta = json.load(open(os.path.join(case_dir, "check.json")))
    sampling = js.SamplingParams(max_new_tokens=meta["new_tokens"], stop_token_ids=())
    res = out[os.path.basename(case_dir)] = {}
    for tp, dp in ((2, 2), (4, 1)):
        mesh = js.make_mesh(tensor_parallel=tp, data_parallel=dp)
        name = f"tp{tp}xdp{dp}"
        opened.clear()
        try:
            target = js.load_model(case_dir, dtype="float32", mesh=mesh, progress=False)
        except ValueError as e:
            res[name] = {"refused": str(e)[-160:]}
            continue
        read = sum(c.bytes_read for c in opened)
        runs = {"plain": {}}
        for d, where in meta["drafts"].items():
            draft = js.load_draft(os.path.join(case_dir, where), target, dtype="float32")
            runs[d + " chain"] = dict(draft=draft, spec=js.SpecConfig.chain(3))
            runs[d + " tree"] = dict(draft=draft, spec=js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6))
        res[name] = {"read": read, "vocab": [target.config.vocab_size, int(target.params["embed"].shape[0])],
                     "tokens": {k: js.generate(target, meta["prompts"], sampling=sampling, progress=False, **kw).token_ids
                                for k, kw in runs.items()}}
        del target, runs
        jax.clear_caches()
print("RESULT " + json.dumps(out), flush=True)
"""


def main() -> None:
    ap = arguments(__doc__, default_cases=4)
    ap.add_argument("--families", default="llama,qwen3,deepseek_v3,qwen3_5", help="comma-separated, in turn")
    args = ap.parse_args()
    families = args.families.split(",")
    if unknown := set(families) - set(FAMILIES):
        ap.error(f"unknown families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        metas, copies = {}, [[], []]
        for i in range(args.cases):
            seed, name = args.seed + i, f"case{args.seed + i}"
            d = root / "made" / name
            metas[name] = make_case(d, families[i % len(families)], seed, vocab=VOCABS[i % len(VOCABS)], shards=4)
            for p in range(2):  # each process its own copy ("host" p's disk)
                shutil.copytree(d, root / f"process{p}" / name)
                copies[p].append(str(root / f"process{p}" / name))
            print(f"{name} saved", file=sys.stderr)
        done = run_processes(lambda i, port: [args.jaxspec_python, "-c", JAXSPEC_SIDE, str(i), str(port), *copies[i]],
                             2, env=cpu_env(2, str(REPO)), timeout=3000, cwd=str(REPO))
    results = []
    for i, d in enumerate(done):
        lines = [line for line in d.output.splitlines() if line.startswith("RESULT ")]
        if d.returncode != 0 or not lines:
            print(f"process {i} failed (exit {d.returncode}):\n{d.output[-4000:]}")
            sys.exit(1)
        results.append(json.loads(lines[-1][len("RESULT "):]))
    bad = 0
    print(f"{'case':>7} {'family':>12} {'vocab (padded)':>15} {'mesh':>9} {'KB read (p0, p1)':>18} "
          f"{'/ TP=2xDP=2':>11} {'processes agree':>15}  vs HF")
    for name, meta in metas.items():
        clean = meta["min_logit_margin"] > MIN_LOGIT_MARGIN
        for mesh, r0 in results[0][name].items():
            r1 = results[1][name][mesh]
            if "refused" in r0:
                print(f"{name:>7} {meta['family']:>12} {'':>15} {mesh:>9} refused: {r0['refused']}")
                continue
            agree = r0["tokens"] == r1["tokens"]
            vs_hf = prompts_differing(r0["tokens"], meta["greedy"])
            bad += not agree or (clean and vs_hf != "equal")
            read = f"{r0['read'] / 1e3:.0f}, {r1['read'] / 1e3:.0f}"
            every = results[0][name].get("tp2xdp2", {}).get("read")  # this process holds every model shard there
            ratio = f"{r0['read'] / every:.2f}" if every else "-"
            print(f"{name:>7} {meta['family']:>12} {'%d (%d)' % tuple(r0['vocab']):>15} {mesh:>9} {read:>18} "
                  f"{ratio:>11} {'yes' if agree else 'NO':>15}  {vs_hf}{'' if clean else ' (near-tie)'}")
    print(f"{bad} mesh runs differ (between the processes, or from HF outside near-ties).")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
