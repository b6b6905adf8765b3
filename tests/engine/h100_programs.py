"""The H100 programs ``tests/engine/test_gpu_launches.py`` reads, compiled in one process of
``.venv-aot`` (jaxlib's CUDA plugin) by ``benchmarks/gpu_launches.py``: the plugin loads once for
all of them, and the process runs beside the rest of the suite (``tests/background.py``).

    JAX_PLATFORMS=cpu PYTHONPATH=. .venv-aot/bin/python -m tests.engine.h100_programs OUT [NAME ...]

Each program set ``NAME`` writes ``OUT/NAME.json`` (``gpu_launches.py``'s rows) and its optimized
HLO under ``OUT/NAME/``, or ``OUT/NAME.error`` with the traceback where it failed.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

# name: gpu_launches.py's arguments (--out and --hlo-dir added per name).
PROGRAMS = {
    # the Llama-3-8B plain step at batch 1 (the default kernels), 4 and 8
    "plain": ["--methods", "plain", "--batches", "1,4,8"],
    # the same at batch 1 with RoPE + K/V write and the norms on XLA
    "plain_small_kernels_on_xla": ["--methods", "plain", "--batches", "1",
                                   "--implementation", "rope_write=xla,rms_norm=xla"],
    # an EAGLE-3 chain of 5 verifying 6 rows: padded to 8 (the GPU's row multiple), and not padded
    "eagle3_chain5": ["--methods", "EAGLE-3 chain 5", "--batches", "1"],
    "eagle3_chain5_unpadded": ["--methods", "EAGLE-3 chain 5", "--batches", "1", "--product-rows", "1"],
    "dspark_chain8": ["--methods", "DSpark chain 8", "--batches", "1"],
    "qwen35": ["--methods", "plain", "--batches", "1", "--target", "qwen35"],
    "v4": ["--methods", "plain", "--batches", "1,16", "--target", "v4"],
    # Qwen3-0.6B at batch 1, its one-token forwards over 1 row and over 8
    "qwen3_one_row_1": ["--methods", "plain", "--batches", "1", "--target", "qwen3-0.6b", "--one-row-rows", "1"],
    "qwen3_one_row_8": ["--methods", "plain", "--batches", "1", "--target", "qwen3-0.6b", "--one-row-rows", "8"],
}


def main(argv: list[str]) -> int:
    out, names = argv[0], argv[1:] or list(PROGRAMS)
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
    sys.path.insert(0, bench)
    import gpu_launches

    failed = 0
    for name in names:
        t0 = time.perf_counter()
        try:
            gpu_launches.main(PROGRAMS[name] + ["--out", os.path.join(out, name + ".json"),
                                               "--hlo-dir", os.path.join(out, name)])
        except BaseException:  # noqa: BLE001 -- a SystemExit from the plugin's set-up included
            failed += 1
            with open(os.path.join(out, name + ".error"), "w") as f:
                f.write(traceback.format_exc())
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
