"""Where the shipped demo pair lives, and the prompt ``jaxspec generate`` uses by default
(shared by the CLI, the benchmark and the tests, so it sits below all of them)."""

from __future__ import annotations

import os

DEMO_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo")
DEMO_TARGET = os.path.join(DEMO_DIR, "target")
DEMO_DRAFT = os.path.join(DEMO_DIR, "eagle3")
DEMO_DFLASH = os.path.join(DEMO_DIR, "dflash")  # a DFlash block draft for the same target
# Ends mid-line on purpose: the byte-level BPE merges a newline with the next line's indent into one
# token, so a prompt ending in a bare "\n" tells the model the next line starts at column 0.
DEMO_PROMPT = 'def read_lines(path):\n    """Return the lines of a text file."""\n    with open(path) as f:'
