"""Where the shipped demo pair lives, and the prompt ``jaxspec generate`` uses by default
(shared by the CLI, the benchmark and the tests, so it sits below all of them)."""

from __future__ import annotations

import os

DEMO_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo")
DEMO_TARGET = os.path.join(DEMO_DIR, "target")
DEMO_DRAFT = os.path.join(DEMO_DIR, "eagle3")
DEMO_DFLASH = os.path.join(DEMO_DIR, "dflash")  # a DFlash block draft for the same target
DEMO_DSPARK = os.path.join(DEMO_DIR, "dspark")  # a DSpark block draft (speculators layout)
DEMO_PEAGLE = os.path.join(DEMO_DIR, "peagle")  # a P-EAGLE head (speculators layout)
DEMO_BLOCK = DEMO_DSPARK  # the block drafter ``jaxspec generate --compare`` runs
# Ends mid-line on purpose: the byte-level BPE merges a newline with the next line's indent into one
# token, so a prompt ending in a bare "\n" tells the model the next line starts at column 0.
DEMO_PROMPT = 'def read_lines(path):\n    """Return the lines of a text file."""\n    with open(path) as f:'

# What ``jaxspec generate --compare`` runs on the demo pair, one line each: name -> (draft: a directory,
# "ngram" or None for plain decoding; draft depth S; n-gram tokens grafted onto the model draft's chain).
DEMO_METHODS = {
    "plain": (None, 0, 0),
    "EAGLE-3": (DEMO_DRAFT, 5, 0),
    "n-gram": ("ngram", 5, 0),
    "hybrid": (DEMO_DRAFT, 3, 8),
    "block": (DEMO_BLOCK, 8, 0),
}
# What ``jaxspec generate`` runs with no arguments, by JAX backend: the method that measured fastest on
# the demo prompt there (``jaxspec generate --compare``; benchmarks/RESULTS.md has the runs). CPU (2
# cores): n-gram 2.0x plain, the block drafter 1.4x (a verify of n tokens costs nearly n decode steps,
# so the cheapest draft wins). GPU: the block drafter and the hybrid (EAGLE-3 + n-gram) lead every run,
# within a run's spread of each other: H200 2.55x / 2.42x, 2.28x / 2.30x; H100 2.40x / 2.42x (n-gram
# 1.80-1.91x, EAGLE-3 1.51-1.67x). The block drafter stays: ahead on average, and one draft model
# instead of a model and a lookup. A backend not measured yet takes the CPU's choice.
DEMO_DEFAULTS = {"cpu": "n-gram", "gpu": "block"}


def demo_default(backend: str) -> str:
    """The demo's default method on JAX backend ``backend`` (``jax.default_backend()``)."""
    return DEMO_DEFAULTS.get(backend, DEMO_DEFAULTS["cpu"])
