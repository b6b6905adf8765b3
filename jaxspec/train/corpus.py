"""Text corpora: list files, split off a held-out set by a stable hash, tokenize, sample windows.

The demo corpus is the Python standard library of the running interpreter. Its held-out
files are chosen by a hash of the path relative to the stdlib root, so the split does not
depend on the machine, the Python version or the order files are listed in: a file that is
held out is never trained on, whichever Python trained the demo.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterable, Sequence

import numpy as np

# Directories of the stdlib that are not library code (tests, bundled packages).
STDLIB_EXCLUDE = ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__")
HELD_OUT_PERCENT = 5


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_held_out(relpath: str, percent: int = HELD_OUT_PERCENT) -> bool:
    """Stable split: sha256 of the '/'-separated relative path, first 8 hex digits mod 100."""
    rel = relpath.replace(os.sep, "/")
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 100 < percent


def list_files(paths: str | Sequence[str], exts: tuple[str, ...] = (".py",),
               exclude_dirs: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(root, relative path) of every file under ``paths`` (files or directories) whose name
    ends with one of ``exts`` (all files when ``exts`` is empty), sorted.

    Raises:
      FileNotFoundError: a path does not exist or nothing matched.
    """
    if isinstance(paths, str):
        paths = [paths]
    out = []
    for path in paths:
        if os.path.isfile(path):
            out.append((os.path.dirname(path) or ".", os.path.basename(path)))
            continue
        if not os.path.isdir(path):
            raise FileNotFoundError(f"corpus path not found: {path}")
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if d not in exclude_dirs)
            for name in sorted(filenames):
                if not exts or name.endswith(exts):
                    out.append((path, os.path.relpath(os.path.join(dirpath, name), path)))
    if not out:
        raise FileNotFoundError(f"no corpus files ({', '.join(exts) or 'any'}) under {list(paths)}")
    return out


def stdlib_files(split: str) -> list[tuple[str, str]]:
    """The stdlib's library ``.py`` files: ``split`` is "train", "heldout" or "all"."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    files = list_files(stdlib_root(), (".py",), STDLIB_EXCLUDE)
    if split == "all":
        return files
    want = split == "heldout"
    return [f for f in files if is_held_out(f[1]) == want]


def read_text(root: str, rel: str) -> str:
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
        return f.read()


def tokenize_files(tokenizer, files: Iterable[tuple[str, str]], eos_id: int | None) -> np.ndarray:
    """All files' tokens in one i32 stream, each file followed by ``eos_id`` (if given)."""
    chunks = []
    for root, rel in files:
        text = read_text(root, rel)
        if not text.strip():
            continue
        ids = tokenizer.encode(text, add_special_tokens=False) if hasattr(tokenizer, "encode") else tokenizer(text)
        ids = getattr(ids, "ids", ids)
        chunks.append(np.asarray(ids, np.int32))
        if eos_id is not None:
            chunks.append(np.asarray([eos_id], np.int32))
    if not chunks:
        raise ValueError("the corpus is empty after tokenization")
    return np.concatenate(chunks)


def sample_windows(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """``batch`` random windows of ``length`` tokens: i32[batch, length]."""
    if len(stream) < length + 1:
        raise ValueError(f"corpus has {len(stream)} tokens, fewer than one window of {length}")
    starts = rng.integers(0, len(stream) - length, size=batch)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def fixed_windows(stream: np.ndarray, count: int, length: int) -> np.ndarray:
    """``count`` evenly spaced windows (deterministic evaluation set): i32[count, length]."""
    if len(stream) < length:
        raise ValueError(f"corpus has {len(stream)} tokens, fewer than one window of {length}")
    starts = np.linspace(0, len(stream) - length, num=count).astype(np.int64)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def spread_by_package(files: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """Reorders files round-robin over their top-level directory (a top-level file is its own
    group), groups in sorted order: the first files taken come from different packages (a
    diverse prompt set, not, say, a run of similar codec tables)."""
    groups: dict[str, list] = {}
    for f in sorted(files, key=lambda f: f[1]):
        rel = f[1].replace(os.sep, "/")
        groups.setdefault(rel.split("/")[0] if "/" in rel else rel, []).append(f)
    order = [groups[k] for k in sorted(groups)]
    out = []
    for i in range(max((len(g) for g in order), default=0)):
        out.extend(g[i] for g in order if i < len(g))
    return out


def file_prompts(tokenizer, files: Sequence[tuple[str, str]], count: int, prompt_tokens: int) -> list[list[int]]:
    """The first ``prompt_tokens`` tokens of each of the first ``count`` files that are long
    enough (files are taken in sorted order: deterministic)."""
    out = []
    for root, rel in files:
        text = read_text(root, rel)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= prompt_tokens + 16:
            out.append([int(t) for t in ids[:prompt_tokens]])
        if len(out) == count:
            break
    return out
