"""Shared tiny models and helpers. Compiled programs are cached per (plan, shapes) by jax.jit
for the whole session, so tests that share a model, engine config and prompt set share
their compiles."""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import shutil
import sys
import tempfile
import time

# The suite compiles thousands of small programs and runs each a few times: XLA:CPU's LLVM
# optimization costs more than it saves there (a V4 + DSpark module: 184 -> 130 s of compiling on 2
# cores at level 0; LLVM's expensive passes off as well: a fifth less again, with the same run times,
# docs/testing.md). Set before JAX starts its backend; the subprocess workloads inherit it.
# JAXSPEC_TEST_XLA_FLAGS replaces it (empty: XLA's defaults). (Not Eigen's single thread as well,
# --xla_cpu_multi_thread_eigen=false: it changes the HLO of bf16 products, which
# tests/engine/test_hidden_copies.py reads, and the suite was not shown faster by it.)
TEST_XLA_FLAGS = os.environ.get("JAXSPEC_TEST_XLA_FLAGS",
                                "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
if TEST_XLA_FLAGS and TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + TEST_XLA_FLAGS).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jaxspec as js
from jaxspec.model.targets.llama_config import LlamaConfig
from jaxspec.model.checkpoints.llama import init_llama_params
from jaxspec.model.targets import Model
from tests.background import EXHAUSTIVE_ENV, JOBS_ENV, ROOT, Job, jobs_dir, remove_jobs_dir

# A worker's heap is large (JAX, its jit caches, the tests' models), so each full collection is
# costly, and the default thresholds run one every ~10 younger ones: 2.7 s of collecting in a 90 s
# module (tests/spec/test_lossless.py, 10 full collections). These thresholds: 1.4 s (2 full).
# Cycles are freed later, not kept; the memory-map guard below still collects when it clears.
gc.set_threshold(2000, 10, 100)

DATA = os.path.join(os.path.dirname(__file__), "data")

# Compiling is most of the suite's time. One persistent compilation cache per run, shared by this
# process, the xdist workers and the subprocess workloads (they inherit the environment), so a
# program compiled by one process is loaded, not compiled, by the others, and a program compiled
# again after the jit caches were dropped (below) is loaded too. A directory the user set is used
# as it is; the run's own directory is removed when the process that made it exits.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxspec-test-xla-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
for _flag in ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
    if _flag in os.environ:
        jax.config.update(_flag.lower(), type(getattr(jax.config, _flag.lower()))(os.environ[_flag]))

# tests/train runs in a process of its own (tests/test_train_process.py), which also keeps its
# training programs out of this process's memory maps (below).
collect_ignore = [] if os.environ.get("JAXSPEC_TRAIN_PROCESS") else ["train"]


# Every program XLA:CPU compiles keeps about five memory mappings (its JIT code and data) for as
# long as a jit cache holds it. The suite compiles over ten thousand programs in one process, which
# passes the kernel's per-process limit (vm.max_map_count, 65530 by default): mmap then fails inside
# the compiler, which crashes (SIGSEGV in backend_compile_and_load, at the same instruction every
# time). Between test modules, once the count passes this share of the limit, the jit caches are
# dropped (the next module recompiles what it needs); inside a module (the largest adds ~16k
# mappings) only past the second share.
MAP_SHARE_BEFORE_CLEARING = float(os.environ.get("JAXSPEC_TEST_MAP_SHARE", "0.6"))
MAP_SHARE_INSIDE_A_MODULE = float(os.environ.get("JAXSPEC_TEST_MAP_SHARE_IN_MODULE", "0.85"))


def memory_map_count() -> tuple[int, int]:
    """(mappings of this process, the kernel's limit); (0, 0) where /proc does not say."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f), limit
    except (OSError, ValueError):
        return 0, 0


def pytest_runtest_teardown(item, nextitem):
    count, limit = memory_map_count()
    module_ends = nextitem is None or nextitem.module is not item.module
    share = MAP_SHARE_BEFORE_CLEARING if module_ends else MAP_SHARE_INSIDE_A_MODULE
    if limit and count > share * limit:
        jax.clear_caches()
        gc.collect()


# JAXSPEC_TEST_COMPILE_LOG=FILE: one JSON line per test with the programs it compiled and the seconds
# spent tracing, lowering and compiling them (what a cold run's time goes to; docs/testing.md).
_COMPILE_LOG = os.environ.get("JAXSPEC_TEST_COMPILE_LOG")
_compiles = {"programs": 0, "seconds": 0.0, "backend_seconds": 0.0, "cache_hits": 0}
_slow_programs: list[tuple[str, float]] = []  # (jitted function, backend seconds) of programs over 0.5 s
if _COMPILE_LOG:
    def _count_compile(name, secs, fun_name="?", **_):
        if name.startswith("/jax/core/compile/"):
            _compiles["seconds"] += secs
            if name.endswith("backend_compile_duration"):
                _compiles["programs"] += 1
                _compiles["backend_seconds"] += secs
                if secs > 0.5:
                    _slow_programs.append((fun_name, round(secs, 2)))
    jax.monitoring.register_event_duration_secs_listener(_count_compile)

    def _count_cache_hit(name, **_):
        if name == "/jax/compilation_cache/cache_hits":
            _compiles["cache_hits"] += 1
    jax.monitoring.register_event_listener(_count_cache_hit)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = dict(_compiles)
    _slow_programs.clear()
    t0 = time.perf_counter()
    yield
    if _COMPILE_LOG:
        with open(_COMPILE_LOG, "a") as f:
            f.write(json.dumps(dict(test=item.nodeid, worker=os.environ.get("PYTEST_XDIST_WORKER", ""),
                                    seconds=round(time.perf_counter() - t0, 3),
                                    programs=_compiles["programs"] - before["programs"],
                                    compile_seconds=round(_compiles["seconds"] - before["seconds"], 3),
                                    backend_seconds=round(_compiles["backend_seconds"] - before["backend_seconds"], 3),
                                    cache_hits=_compiles["cache_hits"] - before["cache_hits"],
                                    slow_programs=_slow_programs[:]))
                    + "\n")


def benchmark_module(name: str):
    """A module of ``benchmarks/`` (not a package: its modules import each other by name, so the
    folder goes on ``sys.path`` and the module is imported once, like any other)."""
    bench = os.path.join(ROOT, "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module(name)


def xdist_worker() -> bool:
    """True in a pytest-xdist worker (``pytest -n 2``), where each worker collects every test."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


if not xdist_worker() and not os.environ.get(JOBS_ENV):  # this process owns the run's job directory
    jobs_dir()
    atexit.register(remove_jobs_dir)


def start_jobs(paths) -> None:
    """Starts the subprocess workload of every given test module (paths absolute or from the
    repository root) that names one (``BACKGROUND_JOB``, ``tests/background.py``)."""
    for path in dict.fromkeys(paths):
        full = path if os.path.isabs(path) else os.path.join(ROOT, path)
        try:
            with open(full) as f:
                if "BACKGROUND_JOB = Job(" not in f.read():
                    continue
        except OSError:
            continue
        module = importlib.import_module(os.path.relpath(full, ROOT).removesuffix(".py").replace(os.sep, "."))
        module.BACKGROUND_JOB.start()


def pytest_collection_finish(session):
    """Run in one process: the selected modules' jobs start now, beside the tests."""
    if session.config.option.collectonly or xdist_worker() or getattr(session.config.option, "numprocesses", None):
        return
    start_jobs(str(item.fspath) for item in session.items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Under ``pytest -n``: the controller starts the selected modules' jobs as soon as the first
    worker has collected, so they run beside both workers from the start."""
    if not getattr(pytest_xdist_node_collection_finished, "done", False):
        pytest_xdist_node_collection_finished.done = True
        start_jobs(i.split("::")[0] for i in ids)


def pytest_sessionfinish(session, exitstatus):
    for job in Job.started:  # a run stopped early (-x, Ctrl-C) leaves no job behind
        job.stop()


# Float32 matmuls at full precision so TF32 on GPUs cannot blur exact-token comparisons.
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_addoption(parser):
    parser.addoption("--exhaustive", action="store_true",
                     help="also run the exhaustive matrices (tests marked exhaustive; outside the default run)")


def pytest_configure(config):
    if config.getoption("--exhaustive"):  # read by the mesh job's module at import (tests/background.py)
        os.environ[EXHAUSTIVE_ENV] = "1"


def pytest_collection_modifyitems(config, items):
    # The tests that wait for a background job run last (stable sort: the rest keep their order), so
    # the workers run everything else while the jobs run.
    items.sort(key=lambda item: getattr(getattr(item, "module", None), "BACKGROUND_JOB", None) is not None)
    if not config.getoption("--exhaustive"):
        wide = pytest.mark.skip(reason="an exhaustive matrix: run with --exhaustive")
        for item in items:
            if "exhaustive" in item.keywords:
                item.add_marker(wide)
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TINY = LlamaConfig(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
)


def tiny_model(seed: int = 0, scale: float = 0.3, cfg: LlamaConfig = TINY) -> Model:
    """A random Llama; a large weight scale makes its distributions peaky (clear argmaxes)."""
    params = init_llama_params(cfg, jax.random.PRNGKey(seed), scale=scale)
    return Model(config=cfg, params=params, dtype=np.dtype(np.float32), eos_token_ids=())


@pytest.fixture(scope="session")
def tiny_target() -> Model:
    return tiny_model()


# Ragged prompts shared by the engine and lossless tests (so their compiles are shared).
PROMPTS_4 = [[5, 17, 33, 2, 9, 41, 7], [60, 3, 14], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [88]]
PROMPTS_1 = [[11, 22, 33, 44, 55]]


def engine(page_size: int = 16, max_batch: int = 4, **kw) -> js.EngineConfig:
    """The tests' engine sizes. Every prefill runs all ``max_batch`` rows and at least 64 positions
    (or ``max_seq_len``): a test compiles one prefill program where requests admitted in groups of
    1, 2 or 4 and prompts of 5 to 60 tokens would compile one per (rows, length) bucket."""
    kw.setdefault("max_seq_len", 128)
    kw.setdefault("steps_per_call", 4)
    kw.setdefault("min_prefill_rows", max_batch)
    kw.setdefault("min_prefill_bucket", min(64, kw["max_seq_len"]))
    return js.EngineConfig(page_size=page_size, max_batch=max_batch, **kw)
