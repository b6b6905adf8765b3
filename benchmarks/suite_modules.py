"""Where the test suite's time goes, per module, from pytest's JUnit XML (``--junitxml=FILE``): the
seconds of every module's tests summed (setup, call and teardown as pytest records them; under
``-n 2`` two modules run at once, so the sums add up to about twice the wall time), largest first,
as a markdown table. Given two files (before, after), both columns, with modules matched by their
path after ``--rename OLD=NEW`` prefixes (for files that moved between the runs):

    python benchmarks/suite_modules.py after.xml
    python benchmarks/suite_modules.py before.xml after.xml --rename tests.draft.=tests.spec. --top 25
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def module_seconds(path: str, renames: list[tuple[str, str]] = ()) -> tuple[dict[str, float], float]:
    """({test module: summed seconds}, the run's wall seconds as pytest reported them)."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    out: collections.Counter = collections.Counter()
    for case in root.iter("testcase"):
        parts = case.get("classname", "").split(".")
        first = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        name = ".".join(parts[: first + 1])
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] += float(case.get("time") or 0)
    return dict(out), float(suite.get("time") or 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="one JUnit XML file, or two: before and after")
    p.add_argument("--rename", action="append", default=[], help="OLD=NEW module prefix applied to the first file")
    p.add_argument("--top", type=int, default=30, help="rows shown (the rest summed in one row)")
    args = p.parse_args(argv)
    if len(args.files) > 2:
        p.error("give one or two files")
    renames = [tuple(r.split("=", 1)) for r in args.rename]
    runs = [module_seconds(f, renames if i == 0 and len(args.files) == 2 else ()) for i, f in enumerate(args.files)]
    last = runs[-1][0]
    names = sorted(set().union(*(r[0] for r in runs)), key=lambda n: -last.get(n, 0))
    heads = ["before s", "after s"] if len(runs) == 2 else ["s"]
    print("| module | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(heads))
    for n in names[: args.top]:
        print(f"| {n} | " + " | ".join(f"{r[0][n]:.0f}" if n in r[0] else "-" for r in runs) + " |")
    rest = names[args.top:]
    if rest:
        print(f"| {len(rest)} more modules | " + " | ".join(f"{sum(r[0].get(n, 0) for n in rest):.0f}" for r in runs) + " |")
    print("| all modules (summed) | " + " | ".join(f"{sum(r[0].values()):.0f}" for r in runs) + " |")
    print("| wall (pytest) | " + " | ".join(f"{r[1]:.0f}" for r in runs) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
