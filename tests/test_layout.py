"""The package's layers (docs/architecture.md#layers): imports run one way, top to bottom, and no
two modules import each other (directly or around a circle). Every import counts, including
those inside functions."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxspec"

# Top to bottom; a module may import its own layer or any layer below it.
LAYERS = [
    ("jaxspec.cli", "jaxspec.__main__"),
    ("jaxspec.serve",),  # the HTTP server (the only importer of the web stack) and its load benchmark
    ("jaxspec.bench", "jaxspec.spec_options"),  # spec_options: the speculative options the commands share
    ("jaxspec.train",),
    ("jaxspec", "jaxspec.generate"),  # the package root re-exports the public names
    ("jaxspec.engine",),
    ("jaxspec.structured",),  # constraints compiled on the host into the automata the step follows
    ("jaxspec.spec",),
    ("jaxspec.model.checkpoints",),
    ("jaxspec.model.drafts",),  # draft architectures
    ("jaxspec.model.targets",),
    ("jaxspec.model",),  # the shared building blocks (layers, sampling, config)
    ("jaxspec.kvcache", "jaxspec.pallas", "jaxspec.sampling"),  # sampling: the per-token pipeline
    ("jaxspec.config", "jaxspec.demo", "jaxspec.mesh", "jaxspec.results"),  # results: what generate() returns
    ("jaxspec.xla_options",),  # the XLA options of every compiled program (config checks overrides with it)
]


def module_name(path: pathlib.Path) -> str:
    parts = ("jaxspec",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best, depth = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            exact = p == "jaxspec"
            if (module == p) or (not exact and module.startswith(p + ".")):
                if len(p) > depth:
                    best, depth = i, len(p)
    assert best is not None, f"{module} is in no layer of the map"
    return best


def imports_of(path: pathlib.Path, modules: set[str]) -> set[str]:
    """jaxspec modules imported by ``path`` (``from a.b import c`` counts ``a.b.c`` when that is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("jaxspec")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxspec"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = sorted(ROOT.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules) - {module_name(f)} for f in files}


def test_imports_run_one_way(graph):
    upward = [f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer_of(d) < layer_of(m)]
    assert not upward, "imports that run back up:\n" + "\n".join(sorted(upward))


def test_no_import_circle(graph):
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in graph.get(m, ()):
            if d not in graph:
                continue
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_step_asks_no_draft_kind():
    """The speculative step drives every draft through one interface: its code names no draft
    kind, kind-specific flag or type test (chain vs tree is decided in ``shape``)."""
    tree = ast.parse((ROOT / "spec" / "step.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 40:
            names.add(node.value)
    forbidden = {"kind", "frozen_kv", "isinstance", "topk", "pos_offset", "eagle1", "eagle3", "mtp",
                 "standalone", "hot_ids", "is_chain"}
    assert not names & forbidden, names & forbidden
    assert not [n for n in names if "frozen" in n.lower() or "eagle" in n.lower() or "assistant" in n.lower()]
