"""What the repository says about itself holds: every path, module and docs section it cites
exists, it cites nothing from outside itself, the README's ``jaxspec`` names import, and every
script and benchmark answers ``--help``.

Scanned for citations: every Markdown file (README.md, docs/, benchmarks/RESULTS.md, the goldens'
READMEs) and every Python and shell file of jaxspec/, tests/, benchmarks/ and scripts/ (docstrings,
comments and strings alike: a path in a help text is a citation too).
"""

from __future__ import annotations

import ast
import functools
import glob
import importlib
import importlib.util
import inspect
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Top-level homes of the repository; a path is a citation when it starts with one of them.
HOMES = ("jaxspec", "tests", "scripts", "benchmarks", "docs", "demo")
SKIP_DIRS = {"runs", "build", "dist", "node_modules", "__pycache__"}


def text_files() -> list[pathlib.Path]:
    """Markdown anywhere, pyproject.toml, and the Python / shell files of the code homes (no hidden
    folders, no build outputs)."""
    out = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(p.startswith(".") or p in SKIP_DIRS or p.endswith(".egg-info") for p in rel.parts[:-1]):
            continue
        if not path.is_file():
            continue
        if path.suffix == ".md" or (path.suffix in (".py", ".sh") and rel.parts[0] in HOMES):
            out.append(path)
    out.append(ROOT / "pyproject.toml")
    return out


def rel(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


# ------------------------------------------------------------------------------------------------
# Citations

# A repository path: starts with a home, is not part of a longer path or dotted name
# (``speculators/models/x``, ``/tmp/tests/x``), stops at a placeholder (``<case>``, ``{name}``).
PATH = re.compile(r"(?<![\w./\-~$])((?:%s)/[\w./*\-]*(?:#[\w\-]+)?)(::\w+)?" % "|".join(HOMES))
# An argument a command writes to, not a file it reads (``--out benchmarks/results/x.json``).
OUTPUT_FLAG = re.compile(r"(?:--(?:out|json|png|out-dir|output)[ =]|>\s*)$")
DOTTED = re.compile(r"(?<![\w./\-])(jaxspec(?:\.[A-Za-z_]\w*)+)")
FILE_SUFFIXES = {"py", "md", "json", "npz", "txt", "png", "safetensors", "log", "csv"}  # jaxspec.json: a file name
# ``python -m tests.mesh.multiprocess`` and friends: a module of the repository run as a command.
RUN_MODULE = re.compile(r"-m\s+((?:tests|benchmarks|scripts)(?:\.\w+)+)")
MD_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")

def heading_anchors(md: pathlib.Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lowercased, punctuation dropped, spaces to
    hyphens, a repeat numbered ``-1``, ``-2``...)."""
    seen: dict[str, int] = {}
    out = set()
    fence = False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        if fence or not (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            continue
        text = re.sub(r"`([^`]*)`", r"\1", m.group(1))
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def path_problem(cited: str, test_name: str | None = None) -> str | None:
    """None when ``cited`` (a repository path, maybe a glob, maybe ``file.md#anchor``) exists."""
    cited, _, anchor = cited.partition("#")
    cited = cited.rstrip("./")
    matches = glob.glob(str(ROOT / cited)) if "*" in cited else ([str(ROOT / cited)] if (ROOT / cited).exists() else [])
    if not matches:
        return f"{cited} does not exist"
    target = pathlib.Path(matches[0])
    if anchor and target.suffix == ".md" and anchor not in heading_anchors(target):
        return f"{cited} has no section #{anchor}"
    if test_name and target.suffix == ".py" and not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{test_name[2:]}\b",
                                                               target.read_text(encoding="utf-8"), re.M):
        return f"{cited} defines no {test_name[2:]}"
    return None


def resolve(dotted: str):
    """The module or attribute ``dotted`` names (``jaxspec.a.b.Name.attr``); raises if none. A
    module named whole is found, not imported (``jaxspec.__main__`` would run the CLI)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            continue
        if i == len(parts):
            return spec
        obj = importlib.import_module(module)
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


@functools.cache
def dotted_problem(dotted: str) -> str | None:
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as e:
        return f"{dotted} does not resolve ({type(e).__name__}: {e})"
    return None


def prose_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, text) of what a file says in words: every line of Markdown and shell; the
    comments and string literals of Python (not its code, nor its f-strings, which build names)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return list(enumerate(text.splitlines(), 1))
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            out += [(tok.start[0] + i, line) for i, line in enumerate(tok.string.splitlines())]
    return out


def citation_problems(path: pathlib.Path) -> list[str]:
    here = rel(path)
    problems = []
    for lineno, line in prose_lines(path):
        where = f"{here}:{lineno}"
        for m in PATH.finditer(line):
            if OUTPUT_FLAG.search(line[: m.start()]):
                continue
            if (p := path_problem(m.group(1), m.group(2))) is not None:
                problems.append(f"{where}: {p}")
        for m in DOTTED.finditer(line):
            name = m.group(1)
            if name.rpartition(".")[2] in FILE_SUFFIXES:
                continue
            if (p := dotted_problem(name)) is not None:
                problems.append(f"{where}: {p}")
        for m in RUN_MODULE.finditer(line):
            if path_problem(m.group(1).replace(".", "/") + ".py") is not None:
                problems.append(f"{where}: python -m {m.group(1)}: no such file")
        if path.suffix == ".md":
            for m in MD_LINK.finditer(line):
                link = m.group(1)
                if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
                    continue
                if link.startswith("#"):
                    if link[1:] not in heading_anchors(path):
                        problems.append(f"{where}: no section {link} in {here}")
                    continue
                target = (path.parent / link.partition("#")[0]).resolve()
                try:
                    target_rel = target.relative_to(ROOT).as_posix()
                except ValueError:
                    problems.append(f"{where}: link {link} leaves the repository")
                    continue
                anchor = link.partition("#")[2]
                if (p := path_problem(target_rel + (f"#{anchor}" if anchor else ""))) is not None:
                    problems.append(f"{where}: link {link}: {p}")
    return problems


def test_every_citation_exists():
    """Every repository path (``jaxspec/x/y.py``, ``tests/...``, ``docs/x.md#section``, a
    ``file.py::test``), dotted name (``jaxspec.a.b``), ``python -m`` module and Markdown link the
    repository mentions is in it."""
    # This file is left out: its scanner checks cite missing paths on purpose.
    problems = [p for f in text_files() if f != pathlib.Path(__file__).resolve() for p in citation_problems(f)]
    assert not problems, "cited but not in the repository:\n" + "\n".join(problems)


# Labels of documents the repository does not contain (spelled in pieces, so this file passes).
OUTSIDE = [
    (re.compile(r"\bseeds? 0{2}\d", re.I), "a change-report label: explain the mechanism or point to docs/"),
    (re.compile("DESIGN" + r"\.md|" + "DESIGN" + " section"), "a design file outside the repository: cite docs/"),
    (re.compile(re.escape(".." + "/shared")), "a folder outside the repository"),
]


def test_no_outside_labels():
    problems = []
    for f in text_files():
        for lineno, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            problems += [f"{rel(f)}:{lineno}: {why}: {line.strip()[:120]}"
                         for pattern, why in OUTSIDE if pattern.search(line)]
    assert not problems, "\n".join(problems)


def test_the_scanner_sees_what_it_must():
    """The patterns above catch what they are for (so a pattern that matches nothing cannot pass
    the tests above vacuously)."""
    line = "see jaxspec/spec/nothing.py, docs/architecture.md#no-such-section and jaxspec.spec.nothing_here"
    cited = [m.group(1) for m in PATH.finditer(line)]
    assert cited == ["jaxspec/spec/nothing.py", "docs/architecture.md#no-such-section"]
    assert all(path_problem(c) for c in cited)
    assert path_problem("jaxspec/spec/step.py") is None and path_problem("tests/test_docs.py", "::test_no_outside_labels") is None
    assert path_problem("tests/test_docs.py", "::test_nothing")
    assert [m.group(1) for m in DOTTED.finditer(line)] == ["jaxspec.spec.nothing_here"]
    assert dotted_problem("jaxspec.spec.nothing_here") and dotted_problem("jaxspec.spec.step.spec_step") is None
    assert not [m for m in PATH.finditer("speculators/models/dflash.py /tmp/tests/x.py jax/experimental/x")]
    assert all(any(p.search(s) for p, _ in OUTSIDE) for s in ("(seed 0" "03)", "DESIGN" ".md", "../" "shared/x"))
    assert not any(p.search("seeds 0-23, --seed 100, seed 0") for p, _ in OUTSIDE)
    assert heading_anchors(ROOT / "README.md")


# ------------------------------------------------------------------------------------------------
# The README's public names

def python_blocks(md: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", md.read_text(encoding="utf-8"), re.S)


def test_readme_names_import():
    """Every ``js.X`` / ``jaxspec.X`` the README uses resolves from where it says, and every
    ``from jaxspec... import X`` in it imports."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    names = {"jaxspec" + m for m in re.findall(r"(?<![\w.])(?:js|jaxspec)((?:\.[A-Za-z_]\w*)+)", text)}
    assert len(names) > 10, names  # the README does use the package
    problems = [p for p in map(dotted_problem, sorted(names)) if p]
    for module, imported in re.findall(r"^\s*from (jaxspec[\w.]*) import ([\w, ]+)", text, re.M):
        problems += [p for n in imported.split(",") if (p := dotted_problem(f"{module}.{n.strip()}"))]
    assert not problems, "\n".join(problems)


def test_doc_examples_pass_known_arguments():
    """The keyword arguments that the README's and docs/' Python examples pass to ``js.*`` calls
    are parameters of those callables."""
    import jaxspec

    problems = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in python_blocks(md):
            for node in ast.walk(ast.parse(block)):
                if not isinstance(node, ast.Call) or not node.keywords:
                    continue
                chain, f = [], node.func
                while isinstance(f, ast.Attribute):
                    chain.append(f.attr)
                    f = f.value
                if not (isinstance(f, ast.Name) and f.id in ("js", "jaxspec") and chain):
                    continue
                obj = jaxspec
                for name in reversed(chain):
                    obj = getattr(obj, name)
                params = inspect.signature(obj).parameters
                if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                    continue
                problems += [f"{rel(md)}: js.{'.'.join(reversed(chain))}({k.arg}=...): no such parameter"
                             for k in node.keywords if k.arg is not None and k.arg not in params]
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------
# Every script and benchmark answers --help

# Packages some scripts need to run, not to be imported by the test suite's environment.
OPTIONAL = ("torch", "transformers", "speculators", "dflash")
# Scripts that run as __main__ but parse no arguments, so they have no --help to answer (run, such a
# golden maker would rewrite its goldens, so it is only imported). Every maker has a command line now;
# any script that runs without a parser fails the test below.
NO_ARGUMENTS: set[str] = set()

# Run in one subprocess: each file by runpy, as ``__main__`` with ``--help`` when it has a command
# line, else imported under another name. One JSON line per file on the real stdout.
DRIVER = r"""
import contextlib, io, json, os, runpy, sys, traceback
optional = tuple(sys.argv[1].split(","))
out = sys.stdout
for path, as_main in json.loads(sys.argv[2]):
    sys.argv[:] = [path, "--help"]
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    buf = io.StringIO()
    result = {"path": path}
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            runpy.run_path(path, run_name="__main__" if as_main else "__help_check__")
        result["status"] = "ran on" if as_main else "ok"
    except SystemExit as e:
        result["status"] = "ok" if e.code in (0, None) else f"exit {e.code}"
    except ModuleNotFoundError as e:
        root = (e.name or "").split(".")[0]
        result["status"] = f"needs {root}" if root in optional else "error"
        result["error"] = traceback.format_exc()
    except BaseException:
        result["status"] = "error"
        result["error"] = traceback.format_exc()
    result["output"] = buf.getvalue()[-2000:]
    sys.path[:] = saved_path
    here = os.path.dirname(os.path.abspath(path))
    for name in set(sys.modules) - saved_modules:  # a sibling module of one folder is not another's
        if os.path.dirname(os.path.abspath(getattr(sys.modules[name], "__file__", None) or "/")) == here:
            sys.modules.pop(name, None)
    print(json.dumps(result), file=out, flush=True)
"""


def script_files() -> list[str]:
    """Every Python file of scripts/ (any depth) and benchmarks/, repository-relative."""
    files = sorted(glob.glob("scripts/**/*.py", root_dir=ROOT, recursive=True))
    return files + sorted(glob.glob("benchmarks/**/*.py", root_dir=ROOT, recursive=True))


def has_main(path: str) -> bool:
    return "__main__" in (ROOT / path).read_text(encoding="utf-8")


def parses_arguments(path: str) -> bool:
    source = (ROOT / path).read_text(encoding="utf-8")
    return "parse_args" in source or "parse_known_args" in source


@functools.cache
def help_results() -> dict[str, dict]:
    # Only a file that parses arguments runs as __main__: one that does not would do its work.
    files = [(f, has_main(f) and parses_arguments(f)) for f in script_files()]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", DRIVER, ",".join(OPTIONAL), json.dumps(files)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["path"]] = r
    assert len(results) == len(files), f"the driver stopped early:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return results


@pytest.mark.parametrize("path", script_files())
def test_script_answers_help(path):
    """Imports the file and runs its ``--help`` (a module without ``__main__`` is only imported);
    a file whose imports need an optional package that is missing here is skipped, naming it."""
    if has_main(path) and not parses_arguments(path) and os.path.basename(path) not in NO_ARGUMENTS:
        pytest.fail(f"{path} runs as a script but has no command line: give it an argparse parser (so --help "
                    f"answers) or list it in NO_ARGUMENTS with the reason")
    r = help_results()[path]
    if r["status"].startswith("needs "):
        pytest.skip(f"{path} {r['status']} at import time (not installed here)")
    assert r["status"] == "ok", f"{path}: {r['status']}\n{r.get('error', '')}\n{r['output']}"


def test_known_argument_free_scripts_exist():
    """The list of scripts without a command line names only files that are there and still
    have none (so it cannot keep an entry after its script gained one)."""
    have = {os.path.basename(f): f for f in script_files()}
    stale = [n for n in sorted(NO_ARGUMENTS) if n in have and parses_arguments(have[n])]
    assert not stale, f"these parse arguments now; drop them from NO_ARGUMENTS: {stale}"
