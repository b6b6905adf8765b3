"""Everything a first GPU session should run, in at most three invocations of < 10 minutes each.

    PYTHONPATH=. python3 benchmarks/gpu_check.py --out OUT --stages env,pytest,check   # ~5 min
    PYTHONPATH=. python3 benchmarks/gpu_check.py --out OUT --stages kernels,sweep      # ~8 min
    PYTHONPATH=. python3 benchmarks/gpu_check.py --out OUT --stages steps              # ~8 min
    python benchmarks/gpu_check.py --dry-run --out /tmp/x   # the same code, tiny shapes, interpret mode

Stages (each one's exceptions are caught and recorded; the run goes on):

* ``env``: Python, jax / jaxlib / triton versions, devices, ``nvidia-smi``.
* ``pytest``: ``pytest -m gpu`` (the native twins of the kernel tests), JUnit XML kept.
* ``check``: every kernel natively against its f32 reference at engine-like shapes
  (``benchmarks/kernels.py --check``), every failure reported.
* ``kernels``: kernel timings against the XLA path and the HBM floor (``kernels.py``).
* ``sweep``: block sizes per shape class (Llama-3-8B decode / verify / draft / prefill, page
  16 and 64; DeepSeek-V3 MLA; Gemma-like wide heads): times candidate tiles natively, keeps
  the fastest that matches the reference, and writes ``OUT/block_table.json`` (the repo's
  table with this GPU's entries merged: copy it to ``jaxspec/pallas/block_table.json``). A
  class where every candidate fails, or the best loses clearly to XLA, gets an ``"xla"``
  entry with the reason, so ``implementation=None`` runs XLA there.
* ``steps``: per-step time at Llama-3-8B shapes (plain, chain S=5, tree S=5 / topk=4 / n=8;
  batch 1 and 16) against the roofline ``weight bytes / HBM bandwidth``
  (``benchmarks/step_timing.py``, in a subprocess).

Every invocation merges its results into ``OUT/gpu_check.json`` and rewrites
``OUT/gpu_check.md``. ``--deadline-minutes`` (default 9.5) stops starting new work in time
to write them. ``--dry-run`` runs every stage at tiny shapes with Pallas in interpret mode
(``pytest`` only collects), so the script is known to work before a GPU sees it (the test
suite runs it: ``tests/pallas/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout
sys.path.insert(0, str(REPO / "benchmarks"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kernels as kbench  # noqa: E402  (benchmarks/kernels.py)
from jaxspec.pallas import block_table, dispatch  # noqa: E402
from jaxspec.pallas.block_sizes import AttentionBlocks, next_pow2, split_kv  # noqa: E402
from jaxspec.pallas.mla_attention import mla_attention_pallas, mla_attention_reference  # noqa: E402
from jaxspec.pallas.paged_attention import paged_attention_pallas, paged_attention_reference  # noqa: E402

STAGES = ("env", "pytest", "check", "kernels", "sweep", "steps")
# Best Pallas time over the XLA path's beyond which a swept class is sent to XLA.
XLA_FALLBACK_RATIO = 1.25


class Deadline:
    def __init__(self, minutes: float):
        self.end = time.monotonic() + 60 * minutes

    def left(self) -> float:
        return self.end - time.monotonic()

    def passed(self, reserve_s: float = 0.0) -> bool:
        return self.left() < reserve_s


# --------------------------------------------------------------------------- stages


def stage_env(args, deadline) -> dict:
    import importlib.metadata as md

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    devices = jax.devices()
    out = dict(
        python=platform.python_version(), platform=platform.platform(),
        packages={p: version(p) for p in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "triton",
                                          "torch", "numpy")},
        backend=jax.default_backend(), devices=[f"{d.platform}:{d.device_kind}" for d in devices],
        gpu_key=dispatch.gpu_kind(), pallas_mode="native" if dispatch.on_gpu() else "interpret",
    )
    try:
        out["memory"] = {k: v for k, v in (devices[0].memory_stats() or {}).items() if "bytes" in k}
    except Exception as e:  # noqa: BLE001 - CPU devices have no memory stats
        out["memory"] = f"n/a ({type(e).__name__})"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        out["nvidia_smi"] = f"n/a ({type(e).__name__})"
    for k in ("devices", "packages", "nvidia_smi"):
        print(f"  {k}: {out[k]}", flush=True)
    return out


def stage_pytest(args, deadline) -> dict:
    junit = args.out / "pytest_gpu.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={junit}",
           str(REPO / "tests")]
    if args.dry_run:
        cmd.insert(3, "--collect-only")  # collects the GPU tests; running them needs a GPU
    timeout = max(30.0, deadline.left() - 60)
    try:
        run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(command=" ".join(cmd[1:]), returncode=None, summary=f"timed out after {timeout:.0f} s")
    lines = (run.stdout + run.stderr).strip().splitlines()
    out = dict(command=" ".join(["python"] + cmd[1:-1] + ["tests"]), returncode=run.returncode,
               summary=lines[-1] if lines else "", failures=[])
    if junit.exists():
        for case in ElementTree.parse(junit).getroot().iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                out["failures"].append(dict(test=f"{case.get('classname')}::{case.get('name')}",
                                            message=(bad.get("message") or "")[:400]))
    print(f"  {out['summary']}", flush=True)
    return out


def stage_check(args, deadline) -> dict:
    rows = kbench.check(args)
    return dict(results=rows, failed=sum(not r["ok"] for r in rows))


def stage_kernels(args, deadline) -> dict:
    rows = kbench.bench(args)
    bw = kbench.bandwidth_bytes_per_s(None)
    return dict(results=rows, bandwidth_tb_s=None if bw is None else bw / 1e12)


# --------------------------------------------------------------------------- sweep


@dataclasses.dataclass(frozen=True)
class SweepShape:
    """One shape class to tune, at one representative launch."""

    op: str  # paged_attention | mla_attention
    shape: object  # kernels.AttnShape | kernels.MLAShape

    def problem(self):
        if self.op == "paged_attention":
            args, _ = kbench.attention_problem(self.shape)
            return args[:6] + ((None,) if self.shape.nodes == 1 or "prefill" in self.shape.name else (args[6],))
        args, _ = kbench.mla_problem(self.shape)
        return args

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim if self.op == "paged_attention" else self.shape.latent

    @property
    def rows(self) -> int:  # folded rows per (request, KV head)
        s = self.shape
        return s.nodes * (s.q_heads // s.kv_heads if self.op == "paged_attention" else s.heads)

    @property
    def kv_heads(self) -> int:
        return self.shape.kv_heads if self.op == "paged_attention" else 1

    def shape_class(self, args) -> str:
        return block_table.attention_class_of(self.op, rows=self.shape.nodes, block_mask=args[6],
                                              head_dim=self.head_dim, page_size=self.shape.page_size)

    def run(self, blocks, interpret):
        fn = paged_attention_pallas if self.op == "paged_attention" else mla_attention_pallas
        return jax.jit(functools.partial(fn, page_size=self.shape.page_size, sm_scale=0.088, interpret=interpret,
                                         blocks=blocks))

    def reference(self):
        fn = paged_attention_reference if self.op == "paged_attention" else mla_attention_reference
        return jax.jit(functools.partial(fn, page_size=self.shape.page_size, sm_scale=0.088))

    def xla(self):
        if self.op == "paged_attention":
            return kbench.attention_fn(self.shape, "xla")
        return kbench.mla_fn(self.shape, "xla")


def sweep_shapes(dry_run: bool) -> list[SweepShape]:
    A, M = kbench.AttnShape, kbench.MLAShape
    if dry_run:
        return [SweepShape("paged_attention", A("sweep-smoke verify", 2, 40, 4, q_heads=4, kv_heads=2, head_dim=16,
                                                 dtype="float32")),
                SweepShape("mla_attention", M("sweep-smoke mla decode", 2, 40, 1, heads=4, latent=32, rope=8,
                                              dtype="float32"))]
    ctx = 4096
    return [
        SweepShape("paged_attention", A("llama3-8b decode B=32", 32, ctx, 1)),
        SweepShape("paged_attention", A("llama3-8b decode B=32 p64", 32, ctx, 1, page_size=64)),
        SweepShape("paged_attention", A("llama3-8b verify n=8 B=16", 16, ctx, 8)),
        SweepShape("paged_attention", A("llama3-8b verify n=8 B=16 p64", 16, ctx, 8, page_size=64)),
        SweepShape("paged_attention", A("llama3-8b prefill T=2048", 1, 0, 2048)),
        SweepShape("mla_attention", M("deepseek-v3 mla decode B=32", 32, ctx, 1)),
        SweepShape("mla_attention", M("deepseek-v3 mla verify n=8 B=16", 16, ctx, 8)),
        SweepShape("paged_attention", A("gemma4 sliding D=256 verify n=8 B=16", 16, ctx, 8, q_heads=32, kv_heads=16,
                                        head_dim=256)),
        SweepShape("paged_attention", A("gemma4 full D=512 verify n=8 B=16", 16, ctx, 8, q_heads=32, kv_heads=4,
                                        head_dim=512)),
    ]


def candidates(s: SweepShape, max_kv_len: int, block_width: int, dry_run: bool) -> list[AttentionBlocks]:
    """Tiles around the heuristic (block_m x block_k x warps at 2 stages; more stages for the
    best of those are tried separately), each with the KV splits its launch size implies and
    block_w as the heuristic sets it (the block's width, 16 to block_k)."""
    wide = s.head_dim > 128
    block_ms = [16, 32] if wide else [16, 32, 64, 128]
    block_ks = [16, 32] if wide else [32, 64]
    warps = [4, 8]
    if dry_run:
        block_ms, block_ks, warps = [16], [16, 32], [4]
    rows = s.rows
    out = []
    for bm in block_ms:
        if bm > max(16, 2 * rows):  # more than half the tile would be padding rows
            continue
        for bk in block_ks:
            for w in warps:
                splits = split_kv(programs=s.shape.batch * s.kv_heads * -(-rows // bm), max_kv_len=max_kv_len,
                                  block_k=bk, interpret=dry_run)
                block_w = min(bk, max(16, next_pow2(block_width)))
                out.append(AttentionBlocks(block_m=bm, block_k=bk, block_w=block_w, kv_splits=splits,
                                           num_warps=w, num_stages=2, reload_q=wide))
    return out


def stage_sweep(args, deadline) -> dict:
    interpret = not dispatch.on_gpu()
    gpu = dispatch.gpu_kind() or "cpu-dry-run"
    timing = dict(warmup=args.warmup, repeats=args.repeats)
    blocks_entries, xla_entries, rows = {}, {}, []
    for s in sweep_shapes(args.dry_run):
        if deadline.passed(reserve_s=90):
            rows.append(dict(shape=s.shape.name, skipped="deadline"))
            continue
        row = dict(shape=s.shape.name, tried=[])
        try:
            a = s.problem()
            cls = s.shape_class(a)
            row["class"] = cls
            want = np.asarray(s.reference()(*a), np.float32)
            t_xla = kbench.median_seconds(s.xla(), a, **timing)
            row["xla_us"] = t_xla * 1e6
            max_kv_len = a[4].shape[1] * s.shape.page_size

            def attempt(blocks):
                try:
                    fn = s.run(blocks, interpret)
                    got = np.asarray(fn(*a), np.float32)
                    np.testing.assert_allclose(got, want, atol=kbench.TOL[s.shape.dtype], rtol=kbench.TOL[s.shape.dtype])
                    t = kbench.median_seconds(fn, a, **timing)
                    row["tried"].append(dict(blocks=dataclasses.asdict(blocks), us=t * 1e6))
                    return t
                except Exception as e:  # noqa: BLE001 - a failing candidate is a result
                    row["tried"].append(dict(blocks=dataclasses.asdict(blocks), error=f"{type(e).__name__}: "
                                             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]))
                    return None

            best, best_t = None, None
            width = s.shape.nodes if a[6] is None else a[6].shape[2]
            for blocks in candidates(s, max_kv_len, width, args.dry_run):
                if deadline.passed(reserve_s=60):
                    break
                t = attempt(blocks)
                if t is not None and (best_t is None or t < best_t):
                    best, best_t = blocks, t
            if best is not None and not args.dry_run:  # deeper pipelines for the winner
                for stages in (3, 4):
                    t = attempt(dataclasses.replace(best, num_stages=stages))
                    if t is not None and t < best_t:
                        best, best_t = dataclasses.replace(best, num_stages=stages), t
            if best is None:
                errors = {t.get("error") for t in row["tried"]} - {None}
                xla_entries[cls] = f"no tile configuration ran natively ({'; '.join(sorted(errors))[:300]})"
            else:
                row["best"] = dict(blocks=dataclasses.asdict(best), us=best_t * 1e6, xla_over_pallas=t_xla / best_t)
                blocks_entries[cls] = {k: getattr(best, k) for k in block_table.ATTENTION_FIELDS}
                if best_t > XLA_FALLBACK_RATIO * t_xla:
                    xla_entries[cls] = (f"Pallas {best_t * 1e6:.0f} us vs XLA {t_xla * 1e6:.0f} us at "
                                        f"{s.shape.name} (gpu_check sweep)")
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        rows.append(row)
        best = row.get("best")
        print(f"  {s.shape.name}: " + (f"best {best['blocks']} {best['us']:.1f} us (XLA {row['xla_us']:.1f} us)"
                                       if best else row.get("error", row.get("skipped", "no candidate ran"))),
              flush=True)
    table_path = args.out / "block_table.json"
    table_path.write_text(block_table.TABLE_PATH.read_text())  # start from the repo's table
    block_table.write_entries(gpu, "blocks", blocks_entries, table_path)
    block_table.write_entries(gpu, "xla", xla_entries, table_path)
    if args.write_table:
        block_table.write_entries(gpu, "blocks", blocks_entries)
        block_table.write_entries(gpu, "xla", xla_entries)
    return dict(gpu=gpu, results=rows, table=str(table_path), blocks=blocks_entries, xla=xla_entries)


# --------------------------------------------------------------------------- steps


def stage_steps(args, deadline) -> dict:
    """``benchmarks/step_timing.py`` in a subprocess (its own memory; a timeout keeps the rows
    printed so far): plain, chain S=5 and tree S=5 / topk=4 / n=8 at batch 1 and 16, each also with
    every generation control on (its cost per step)."""
    out_json = args.out / "step_timing.json"
    out_json.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "benchmarks" / "step_timing.py"), "--out", str(out_json), "--controls"]
    cmd += (["--tiny", "--batches", "1", "--context", "16", "--steps", "2", "--repeats", "1"] if args.dry_run else
            ["--batches", "1,16", "--context", "1024", "--steps", "16", "--repeats", "5"])
    timeout = max(30.0, deadline.left() - 30)
    try:
        run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        stdout, returncode = run.stdout, run.returncode
        stderr = run.stderr
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr, returncode = f"timed out after {timeout:.0f} s", None
    result = dict(command=" ".join(["python"] + cmd[1:]), returncode=returncode)
    if out_json.exists():
        result.update(json.loads(out_json.read_text()))
    else:  # the table rows printed before a timeout or a crash
        result["rows"] = [dict(zip(("device", "batch", "config", "ms_per_step"), (c.strip() for c in line.strip("|").split("|"))))
                          for line in stdout.splitlines() if line.startswith("| ") and "ms/step" not in line]
    if returncode != 0:
        result["error"] = stderr.strip()[-2000:]
    for line in stdout.splitlines():
        print(f"  {line}", flush=True)
    if returncode != 0:
        raise RuntimeError(f"step_timing.py failed (rc={returncode}): {result['error'][-800:]}")
    return result


# --------------------------------------------------------------------------- summary


def markdown(summary: dict) -> str:
    out = ["# gpu_check", "", f"Device: {summary.get('device')}; Pallas {summary.get('pallas_mode')}", ""]
    st = summary.get("stages", {})
    for name in STAGES:
        if name not in st:
            continue
        s = st[name]
        out.append(f"## {name} ({s.get('seconds', 0):.0f} s{', ERROR' if s.get('error') else ''})")
        out.append("")
        if s.get("error"):
            out += ["```", s["error"], "```", ""]
            continue
        r = s.get("result", {})
        if name == "env":
            out += [f"- {k}: {r.get(k)}" for k in ("devices", "packages", "nvidia_smi", "memory")]
        elif name == "pytest":
            out += [f"`{r.get('command')}`: {r.get('summary')}"] + [f"- FAIL {f['test']}: {f['message']}"
                                                                   for f in r.get("failures", [])]
        elif name == "check":
            out += ["| kernel | case | result | s |", "|---|---|---|---:|"]
            out += [f"| {x['kind']} | {x['name']} | {'ok' if x['ok'] else 'FAIL: ' + x['error']} | {x['seconds']:.1f} |"
                    for x in r.get("results", [])]
        elif name == "kernels":
            out.append(kbench.markdown(r.get("results", []), summary.get("device"),
                                       (r.get("bandwidth_tb_s") or 0) * 1e12 or None))
        elif name == "sweep":
            out += [f"Table written to `{r.get('table')}` (GPU key `{r.get('gpu')}`); XLA entries: {r.get('xla')}", "",
                    "| shape | class | best tiles | Pallas (us) | XLA (us) | XLA / Pallas |", "|---|---|---|---:|---:|---:|"]
            for x in r.get("results", []):
                b = x.get("best")
                if b:
                    tiles = ", ".join(f"{k}={v}" for k, v in b["blocks"].items())
                    out.append(f"| {x['shape']} | {x['class']} | {tiles} | {b['us']:.1f} | {x['xla_us']:.1f} | "
                               f"{b['xla_over_pallas']:.2f} |")
                else:
                    why = x.get("error") or x.get("skipped") or "no candidate ran"
                    out.append(f"| {x['shape']} | {x.get('class', '')} | {why} | | | |")
        elif name == "steps":
            out += [f"`{r.get('command')}`", "", f"device {r.get('device')}, weights {r.get('weight_bytes', 0) / 1e9:.2f} GB, "
                    f"bandwidth {r.get('bandwidth')} B/s, context {r.get('context')}", "",
                    "| batch | config | ms/step | vs plain | roofline ms |", "|---|---|---:|---:|---:|"]
            for x in r.get("rows", []):
                out.append(f"| {x.get('batch')} | {x.get('config')} | {x.get('ms_per_step')} | "
                           f"{x.get('ratio_to_plain', '')} | {x.get('roofline_ms', '')} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json / .md and the block table")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, interpret mode, pytest only collects")
    ap.add_argument("--deadline-minutes", type=float, default=9.5)
    ap.add_argument("--write-table", action="store_true", help="also merge the sweep into jaxspec/pallas/block_table.json")
    args = ap.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if unknown := set(stages) - set(STAGES):
        ap.error(f"unknown stages {sorted(unknown)}; choose from {STAGES}")
    args.out.mkdir(parents=True, exist_ok=True)
    # kernels.py's knobs: tiny shapes and few repeats in a dry run
    args.smoke, args.bandwidth = args.dry_run, None
    args.warmup, args.repeats = (1, 2) if args.dry_run else (3, 20)
    deadline = Deadline(args.deadline_minutes)

    summary_path = args.out / "gpu_check.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"stages": {}}
    summary.update(device=kbench.device_name(), pallas_mode="native" if dispatch.on_gpu() else "interpret",
                   dry_run=args.dry_run)
    runners = dict(env=stage_env, pytest=stage_pytest, check=stage_check, kernels=stage_kernels, sweep=stage_sweep,
                   steps=stage_steps)
    for name in stages:
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        entry = {}
        if deadline.passed(reserve_s=30):
            entry["error"] = "not started: deadline"
        else:
            try:
                entry["result"] = runners[name](args, deadline)
            except Exception:  # noqa: BLE001 - one stage failing must not lose the others
                entry["error"] = traceback.format_exc(limit=8)[-3000:]
                print(entry["error"], flush=True)
        entry["seconds"] = time.perf_counter() - t0
        summary["stages"][name] = entry
        summary_path.write_text(json.dumps(summary, indent=1, default=str))  # after every stage
        (args.out / "gpu_check.md").write_text(markdown(summary))
    print(f"wrote {summary_path} and {args.out / 'gpu_check.md'}", flush=True)
    return 1 if any(e.get("error") for e in summary["stages"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
