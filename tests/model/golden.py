"""Access to the HF golden fixtures in tests/data/golden (see its README)."""

import json
import os

import numpy as np

from tests.conftest import DATA

GOLDEN = os.path.join(DATA, "golden")


def manifest() -> dict:
    with open(os.path.join(GOLDEN, "manifest.json")) as f:
        return json.load(f)


def cases(kind: str | None = None, arch_prefix: str | None = None) -> list[dict]:
    out = []
    for c in manifest()["cases"]:
        if kind and c["kind"] != kind:
            continue
        if arch_prefix is not None and not c["model_type"].startswith(arch_prefix):
            continue
        out.append(c)
    return out


def case_dir(case: dict) -> str:
    return os.path.join(GOLDEN, case["dir"])


def arrays(case: dict) -> dict:
    return dict(np.load(os.path.join(case_dir(case), "golden.npz")))
