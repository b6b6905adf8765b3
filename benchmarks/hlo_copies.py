"""Hidden copies in a compiled program: which buffers the optimized HLO materializes that are only a
slice (or a whole copy) of a weight or a KV-pool array.

A decode program scans its layers over stacked weights (``[L, ...]`` arrays). Each product reads
layer ``i``'s slice; if the backend cannot hand that slice to its matrix product where it lies, the
optimized HLO shows a loop fusion (or a ``copy`` / ``dynamic-slice``) whose output has the shape of
one layer's weight: a copy written and read again every iteration. The same reading finds a whole
stacked weight or a KV-pool array copied (an aliasing failure). Only instructions of scheduled
computations count (the entry, loop bodies, conditional branches): an instruction inside a fusion
does not materialize its output.

    python benchmarks/hlo_copies.py [--dtype float32] [--page-size 16]

prints what a tiny Llama's decode program copies on this backend (the GPU check runs the same
reading on the 8B shape: ``gpu_check.py --items copies``).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import jax

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+?)\[([\d,]*)\][^ ]*\s+([\w\-]+)\(")
_FUSED_CALL = re.compile(r"\bcalls=%?([\w.\-]+)")
_FUSION_KIND = re.compile(r"\bkind=(\w+)")
# Ops whose output is a fresh buffer holding values read from another array.
_COPYING = {"fusion", "copy", "dynamic-slice", "slice"}
# Fusion roots that update their first operand where it lies (the KV pools' writes); XLA inserts a
# separate ``copy`` when it cannot, and that copy counts.
_IN_PLACE = {"scatter", "dynamic-update-slice"}


def computations(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines (the optimized module's text)."""
    out, name = {}, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line[0].isspace():  # a header; instructions are indented
            name = m.group(2)
            out[name] = []
        elif line.strip() == "}":
            name = None
        elif name is not None and line.strip():
            out[name].append(line)
    return out


def root_op(lines: list[str]) -> str | None:
    """The op of a computation's ROOT instruction."""
    for line in lines:
        m = _INSTRUCTION.match(line)
        if m and m.group(1):
            return m.group(5)
    return None


def scheduled(comps: dict[str, list[str]]) -> set[str]:
    """The computations whose instructions materialize buffers: all but fusion bodies and the small
    ``to_apply`` reducers (a fusion's ``calls=`` target does not run on its own)."""
    fused, applied = set(), set()
    for lines in comps.values():
        for line in lines:
            if " fusion(" in line:
                fused.update(_FUSED_CALL.findall(line))
            applied.update(re.findall(r"\bto_apply=%?([\w.\-]+)", line))
    return set(comps) - fused - applied


def _shape(dims: str) -> tuple[int, ...]:
    return tuple(int(d) for d in dims.split(",") if d)


def _squeeze(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def find_copies(hlo: str, weights: dict[str, tuple[int, ...]], pools: dict[str, tuple[int, ...]],
                min_elements: int = 1024) -> list[dict]:
    """Instructions of scheduled computations that copy a layer's slice of a stacked weight, a whole
    stacked weight or a whole pool array.

    ``weights``: name -> stacked shape ``[L, ...]``; ``pools``: name -> shape. A per-layer weight
    matches by its shape without the layer axis (unit axes ignored, so ``[1, D, F]`` and ``[D, F]``
    both count); arrays under ``min_elements`` per layer are skipped (norm scales). Returns one dict
    per copying instruction: ``kind`` ("layer slice", "whole weight", "whole pool"), ``array``, ``op``,
    ``fusion_kind``, ``computation``, ``shape``.
    """
    wanted = {}
    for name, shape in weights.items():
        layer = shape[1:]
        if math.prod(layer) >= min_elements:
            wanted.setdefault(_squeeze(layer), ("layer slice", name))
            wanted.setdefault(_squeeze(shape), ("whole weight", name))
    for name, shape in pools.items():
        if math.prod(shape) >= min_elements:
            wanted.setdefault(_squeeze(shape), ("whole pool", name))
    comps = computations(hlo)
    roots = {name: root_op(lines) for name, lines in comps.items()}
    found = []
    for comp in sorted(scheduled(comps)):
        for line in comps[comp]:
            m = _INSTRUCTION.match(line)
            if not m or m.group(5) not in _COPYING:
                continue
            called = _FUSED_CALL.search(line)
            if m.group(5) == "fusion" and called and roots.get(called.group(1)) in _IN_PLACE:
                continue  # a scatter or update-slice fusion writes into its operand's buffer
            hit = wanted.get(_squeeze(_shape(m.group(4))))
            if hit is None:
                continue
            kind = _FUSION_KIND.search(line)
            found.append(dict(kind=hit[0], array=hit[1], op=m.group(5), instruction=m.group(2),
                              fusion_kind=kind.group(1) if kind else None, computation=comp,
                              shape=f"{m.group(3)}[{m.group(4)}]"))
    return found


def stacked_weights(params) -> dict[str, tuple[int, ...]]:
    """name -> shape of every stacked per-layer weight matrix: the leaves under ``params["layers"]``
    (named by their path there), and a hybrid's period-stacked ``params["p0"]``, ``["p1"]``, ...
    (named ``p0['in_qkv']``; positions of one shape share the first's name)."""
    groups = {"": params["layers"]} if "layers" in params else {
        k: v for k, v in params.items() if re.fullmatch(r"p\d+", k)}
    out = {}
    for prefix, tree in groups.items():
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            # Matrices only: a norm's [L, D] slice has the shape of an activation row, which would be
            # a false match at batch 1.
            if x.ndim >= 3:
                out[prefix + jax.tree_util.keystr(path)] = tuple(x.shape)
    return out


def pool_arrays(pool) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_flatten_with_path(pool)[0]
    return {jax.tree_util.keystr(path): tuple(x.shape) for path, x in leaves if hasattr(x, "shape")}


def decode_copies(stepper, target) -> tuple[str, list[dict]]:
    """The optimized HLO of a ``step_timing.Stepper``'s decode program and the copies it shows."""
    hlo = stepper.fn.lower(stepper.plan, target.params, stepper.dparams, stepper.state, stepper.tpool,
                           stepper.dpool, stepper.table).compile().as_text()
    return hlo, find_copies(hlo, stacked_weights(target.params), pool_arrays(stepper.tpool))


def summarize(copies: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in copies:
        key = f"{c['kind']}: {c['array']}"
        out[key] = out.get(key, 0) + 1
    return out


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import step_timing as st

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--hlo", default=None, help="also write the optimized HLO text here")
    args = p.parse_args(argv)
    target = st.random_target(st.TINY, jax.numpy.dtype(args.dtype))
    stepper = st.Stepper(target, None, None, batch=2, context=40, steps=2, repeats=1, page_size=args.page_size)
    hlo, copies = decode_copies(stepper, target)
    if args.hlo:
        Path(args.hlo).write_text(hlo)
    print(f"{jax.default_backend()} decode program, tiny Llama in {args.dtype}: {len(copies)} copying instruction(s)")
    for key, n in sorted(summarize(copies).items()):
        print(f"  {n} x {key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
