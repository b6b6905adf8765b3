"""Compiles every Pallas kernel for an H100 at realistic shapes (no GPU needed) and prints a table.

    .venv/bin/python scripts/triton_report.py            # markdown table, for benchmarks/RESULTS.md
    .venv/bin/python scripts/triton_report.py --json out.json --only mla

Each row is one kernel launch: the Triton module is captured from the Pallas lowering,
verified, compiled by ``triton`` for sm_90a and read with ``ptxas -v`` (see
``tests/pallas/triton_compile.py``; the cases are ``tests/pallas/compile_cases.py``).
Columns: registers and spill bytes per thread, static shared memory, global loads by width
(16-byte vector loads, scalar 2-byte loads), 16-byte ``cp.async`` copies, wgmma / mma.sync
instructions, and what the CPU test would fail on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from tests.pallas import compile_cases, triton_compile  # noqa: E402


def run_case(case: compile_cases.CompileCase) -> list[dict]:
    fn, args = case.build()
    try:
        reports = triton_compile.compile_for_h100(fn, *args)
    except Exception as e:  # a lowering error is a row too
        reports = [triton_compile.KernelReport(name=case.op, num_warps=0, num_stages=0, grid=(),
                                               error=f"lowering: {str(e).splitlines()[0]}")]
    rows = []
    for r in reports:
        rows.append(dict(case=case.id, must_pass=case.must_pass, problems=compile_cases.problems(case, r),
                         **dataclasses.asdict(r)))
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| kernel, shape | grid | warps/stages | regs | spill B (st/ld) | smem KiB | 16B loads | "
           "2B scalar loads | 16B cp.async | wgmma/mma | verdict |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["error"]:
            out.append(f"| {r['case']} | {'x'.join(map(str, r['grid']))} | {r['num_warps']}/{r['num_stages']} | "
                       f"| | | | | | | FAILS: {r['error'].splitlines()[0][:160]} |")
            continue
        wide = sum(n for w, n in r["loads"].items() if int(w) >= 16)
        copies = sum(n for w, n in r["cp_async"].items() if int(w) >= 16)
        verdict = "ok" if not r["problems"] else ("; ".join(r["problems"]) + ("" if r["must_pass"] else " (report row)"))
        out.append(
            f"| {r['case']} | {'x'.join(map(str, r['grid']))} | {r['num_warps']}/{r['num_stages']} | {r['registers']} | "
            f"{r['spill_stores']}/{r['spill_loads']} | {r['shared'] / 1024:.1f} | {wide} | "
            f"{r['scalar_loads'].get(2, 0)} | {copies} | {r['wgmma']}/{r['mma']} | {verdict} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="only cases whose id contains this text")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    if not triton_compile.triton_available():
        print("needs the triton package (pip install -e '.[test]')", file=sys.stderr)
        return 2
    rows = []
    t0 = time.perf_counter()
    for case in compile_cases.CASES:
        if args.only and args.only not in case.id:
            continue
        rows.extend(run_case(case))
        print(f"  {case.id}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r["problems"] and r["must_pass"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
