"""The XLA options jaxspec compiles its programs with: one table, per backend.

Every compiled program of the engine (prefill and the decode loop, with the draft loops inside
them) is compiled through ``jax.jit(..., compiler_options=...)`` with ``TABLE[backend]``, the
backend being the platform of the target's devices ("gpu", "cpu", "tpu"). Each entry says what it
was measured to do. The options are per program: the library never sets ``XLA_FLAGS``, and other
JAX code in the process compiles as it would without jaxspec.

Override the table per engine with ``EngineConfig(compiler_options=...)``:

- ``None`` (default): the table for the backend the programs run on;
- a mapping name -> value (or (name, value) pairs): merged over that table; a value of ``None``
  drops the table's entry (XLA's own default applies);
- ``False``: no options at all (XLA's defaults everywhere).

Names are fields of XLA's ``DebugOptions`` without leading dashes (``xla_gpu_enable_triton_gemm``);
values are bools, ints, floats or strings. A repeated enum field (``xla_gpu_enable_command_buffer``)
takes its names comma-separated without spaces, or as a tuple of names, and the list replaces XLA's
(``""`` empties it). jaxlib checks every name and value when the config is built: it compiles a
one-op program with each new (name, value) once per process (tens of milliseconds) and refuses
what it does not know with a ``ValueError`` naming the option.

``CANDIDATES`` names option sets not in the table: measured to change nothing yet, or not measured;
a GPU check times each over the table (``EngineConfig(compiler_options=CANDIDATES[name])``).
``REJECTED`` keeps the sets measured to lose, with the measurement.
Benchmarks that jit their own functions take the table with ``compiler_options()``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

# The options of every engine program, per backend (``Plan.compiler_options`` after resolution).
TABLE: dict[str, dict[str, bool | int | float | str]] = {
    "gpu": {
        # cuBLAS instead of Triton GEMM fusions for the products (a decode step's are skinny: a
        # few rows against each weight). NVIDIA H200, Llama-3-8B shape with random bf16 weights,
        # plain decode step, context 1024, 16 steps a call (benchmarks/step_timing.py, main at
        # 4e430e3): batch 1 12.35 -> 6.93 ms a step, batch 16 12.55 -> 6.39 ms. Again on an H200
        # with q/k/v and gate/up joined (benchmarks/gpu_check.py --call 1, benchmarks/RESULTS.md):
        # batch 1 11.58 -> 5.94 ms, batch 16 12.07 -> 5.47 ms.
        "xla_gpu_enable_triton_gemm": False,
        # XLA's dot merger off. It joins products that share an input into one, concatenating their
        # weights inside the program: a DFlash or DSpark draft layer's q and k/v products (wq and
        # wkv, kept apart because the context projects k/v alone) became one product over a
        # [4096, 6144] weight built again every step, five to six 48-64 MB copies a step at the 8B
        # shape (counted in the H100 program compiled without a GPU, benchmarks/gpu_launches.py:
        # DFlash block 16 at batch 1 575 -> 513 kernels a step). NVIDIA H200, batch 1, the 8B shape
        # (benchmarks/gpu_check.py, RESULTS.md): DFlash block 16 6.29 -> 6.09 ms and 6.26 -> 6.00 ms
        # in two runs, DSpark chain 8 6.67 -> 6.42 ms; the plain step within its run-to-run spread
        # (4.70 / 4.76, 4.69 / 4.66 ms); EAGLE-3 and n-gram programs unchanged by it.
        "xla_gpu_dot_merger_threshold_mb": 0,
    },
    # CPU: nothing. Measured against XLA's defaults (plain decode step, random f32 weights, context
    # 256, 8 steps a call, medians of 9 interleaved calls on a shared 2-core x86 machine under load,
    # benchmarks/step_timing.py's prepare), for the demo target's shape at batch 1 / 8 and a
    # 4-layer 1024-wide Llama at batch 1 / 8: xla_cpu_use_xnnpack 1.00 / 1.05 / 0.96 / 1.04x the
    # step time, xla_cpu_prefer_vector_width=512 1.01 / 1.04 / 1.02 / 1.04x, single-threaded Eigen
    # 1.00 / 1.01 / 1.09 / 0.99x: no gain beyond the noise. YNNPACK's dot fusions off
    # (xla_cpu_experimental_ynn_fusion_type="") 1.10 / 1.26 / 1.10 / 1.19x: XLA's default stays.
    "cpu": {},
    "tpu": {},
}

# XLA's default command-buffer (CUDA graph) kinds as its debug-option defaults list them; jaxlib
# does not show its own defaults to Python. A value for the field replaces XLA's list.
_XLA_COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"

# Option sets to time over the table on a GPU (not in it: no measured gain yet). The GPU check's
# ``candidates`` item times each; its H200 run at cf1614b (plain 8B step 4.76 / 5.26 ms at batch 1 /
# 16 over the table, one run, benchmarks/RESULTS.md): every set within the 4.73-4.89 ms the table's own
# step spread over in that run. Its H100 run at ac9006f (6.135 / 6.907 ms): every set 1.00-1.03x the
# table's step, none faster.
CANDIDATES: dict[str, dict[str, bool | int | float | str]] = {
    # CUDA graphs over the loops too: XLA's default command buffers hold fusions and library calls
    # but not WHILE / CONDITIONAL, so the layer loop, the draft loops and the step loop are
    # launched kernel by kernel (what the optimized HLO of the decode program shows on an H200).
    # The list replaces XLA's: its five kinds, then the two loop kinds. Measured on an H200 over
    # cuBLAS (gpu_check --call 1, one run): batch 1 5.94 -> 5.85 ms, batch 16 5.47 -> 5.43 ms, a
    # gain within what one run can tell from noise: not in the table yet.
    "command_buffer_loops": {"xla_gpu_enable_command_buffer": f"{_XLA_COMMAND_BUFFER},WHILE,CONDITIONAL"},
    # The same, with loops of a known trip count (the layer loop) unrolled inside the graph. H200,
    # batch 1: 5.96 against 5.92 ms.
    "command_buffer_unrolled_loops": {"xla_gpu_enable_command_buffer": f"{_XLA_COMMAND_BUFFER},WHILE,CONDITIONAL",
                                      "xla_gpu_command_buffer_unroll_loops": True},
    # Per-layer weights read through dynamic-slice fusions instead of copied out of the stacked
    # arrays. Measured on the H200 above: no change (batch 1 / 16: 12.44 / 12.51 ms with Triton
    # GEMMs, 6.91 / 6.41 ms with cuBLAS; with the joined products, over cuBLAS and command buffers:
    # 5.85 / 5.51 against 5.85 / 5.43 ms).
    "dynamic_slice_fusion": {"xla_gpu_enable_dynamic_slice_fusion": True},
    # cuBLASLt for the products (epilogues fused into the GEMM). H200, batch 1: 5.95 against 5.92 ms.
    "cublaslt": {"xla_gpu_enable_cublaslt": True},
    # The latency-hiding scheduler overlaps the per-layer weight copies (async dynamic slices) with
    # the products before them. H200, batch 1: 5.95 against 5.92 ms (the GPU program copies no
    # weight slice: each product reads its slice where it lies, benchmarks/hlo_copies.py).
    "latency_hiding_scheduler": {"xla_gpu_enable_latency_hiding_scheduler": True},
}

# Option sets measured and kept out of the table for good, with the measurement that decided it (the
# GPU check can still time one by name: ``--target-candidate``).
REJECTED: dict[str, dict[str, bool | int | float | str]] = {
    # XLA unrolls every loop of a known trip count. On the 8B shape it removes the layer loop's
    # counter (a kernel a layer, 55 us a step at batch 1 on an H200) and doubled the compile time
    # (2.0-2.6 against 0.9-1.2 s); H200 plain step at batch 1 in three runs -1.5%, -2.6%, -1.8%,
    # EAGLE-3 chain 5 -0.9%; NVIDIA H100 (gpu_check at ac9006f): plain 6.148 against 6.135 ms at batch
    # 1, 6.965 against 6.907 at batch 16, EAGLE-3 chain 5 7.856 against 7.879 ms, the Qwen3.5-shaped
    # hybrid 9.18 against 9.29 ms: within one run's spread. And it unrolls every loop of known trip
    # count, not the layer loop alone: the DeepSeek-V4-shaped target's step (through the engine, H100,
    # batch 1, the same item of the same run) took 137.4 against 16.5 ms, 8.3x slower (not traced).
    "unrolled_layer_loop": {"xla_gpu_enable_while_loop_unrolling": "WHILE_LOOP_UNROLLING_FULL_UNROLL"},
}

Value = bool | int | float | str
# None: the table for the backend; False: no options; else sorted (name, value | None) pairs.
Setting = None | bool | tuple[tuple[str, Value | None], ...]


def normalize_options(value) -> Setting:
    """A user's compiler-options setting, checked by jaxlib: None, False, or sorted (name, value)
    pairs (a mapping's items; a tuple of names joined by commas; None drops a table entry).

    Raises:
      ValueError: a name jaxlib does not know, or a value it refuses for that name (naming it).
    """
    if value is None or value is False:
        return value
    if value is True:
        raise ValueError("True is not a setting: None takes the table, False turns it off, a mapping overrides it")
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (tuple, list)) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        items = list(value)
    else:
        raise ValueError(f"must be None, False or a mapping option name -> value, got {value!r}")
    pairs = {}
    for name, v in items:
        if not isinstance(name, str) or not name:
            raise ValueError(f"option names are strings, got {name!r}")
        if name.startswith("-"):
            raise ValueError(f"option {name!r}: give the name without leading dashes ({name.lstrip('-')!r})")
        if isinstance(v, (tuple, list)) and all(isinstance(x, str) for x in v):
            v = ",".join(v)  # a repeated enum field's names
        if v is not None and not isinstance(v, (bool, int, float, str)):
            raise ValueError(f"option {name!r}: values are bools, ints, floats, strings or None, got {v!r}")
        if name in pairs:
            raise ValueError(f"option {name!r} is given twice")
        pairs[name] = v
    for name, v in pairs.items():
        check_option(name, v, type(v))
    return tuple(sorted(pairs.items()))


def resolve_options(setting: Setting, backend: str) -> tuple[tuple[str, Value], ...]:
    """The options a program on ``backend`` compiles with: sorted (name, value) pairs."""
    if setting is False:
        return ()
    merged = dict(TABLE.get(backend, {}))
    for name, value in setting or ():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = value
    return tuple(sorted(merged.items()))


def compiler_options(backend: str | None = None, setting: Setting = None) -> dict[str, Value]:
    """``jax.jit``'s ``compiler_options`` for a function of jaxspec's: the table for ``backend``
    (default: JAX's default backend), with a normalized ``setting`` over it."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    return dict(resolve_options(setting, backend))


def program_backend(mesh=None) -> str:
    """The platform a model's programs run on: its mesh's devices', else JAX's default backend."""
    if mesh is not None:
        return mesh.devices.flat[0].platform
    import jax

    return jax.default_backend()


@functools.cache
def check_option(name: str, value: Value | None, kind: type) -> None:
    """Asks jaxlib whether it takes ``name=value`` (``None``: whether it knows ``name``) by
    compiling a one-op program with it; the verdict is kept for the process (per value and type:
    ``1`` and ``True`` are equal keys, yet jaxlib takes only one of them for a field)."""
    import jax
    import jaxlib
    import numpy as np

    probe = "" if value is None else value  # a string is parsed for any field type: refused only by value
    try:
        # A function of its own: jax's caches take (name, True) and (name, 1) for the same key.
        jax.jit(lambda x: x + 1, compiler_options={name: probe}).lower(np.float32(0)).compile()
    except jax.errors.JaxRuntimeError as e:
        message = str(e).split("\n")[0]
        if "No such compile option" in message:
            raise ValueError(f"option {name!r} is not an XLA option jaxlib {jaxlib.__version__} knows") from None
        if value is not None:
            raise ValueError(f"option {name!r}: jaxlib refuses the value {value!r} ({message})") from None

