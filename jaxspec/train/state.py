"""Training checkpoints: any pytree of arrays (params, optimizer state) plus JSON metadata.

A checkpoint is a directory with ``arrays.npz`` (the tree's leaves in flattening order) and
``meta.json``. Restoring takes a template tree of the same structure (e.g. a freshly
initialized optimizer state), so no Python objects are pickled. Writes are atomic (write to
a temporary name, then rename), so an interrupted run leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np


def save_checkpoint(path: str, tree, meta: dict) -> None:
    """Writes ``tree`` (any pytree of arrays) and ``meta`` to the directory ``path``."""
    leaves = jax.tree.leaves(tree)
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    arrays = {f"leaf_{i:05d}": np.asarray(x) for i, x in enumerate(leaves)}
    np.savez(os.path.join(tmp, "arrays.npz"), **arrays)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(dict(meta, num_leaves=len(leaves)), f, indent=1)
    old = path.rstrip("/") + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str, template):
    """(tree shaped like ``template``, meta) from ``path``.

    Raises:
      FileNotFoundError: no checkpoint at ``path``.
      ValueError: the checkpoint's structure or shapes do not match ``template``.
    """
    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"no training checkpoint at {path}")
    with open(meta_path) as f:
        meta = json.load(f)
    leaves, treedef = jax.tree.flatten(template)
    if meta.get("num_leaves") != len(leaves):
        raise ValueError(
            f"checkpoint {path} has {meta.get('num_leaves')} arrays, the current run expects {len(leaves)} "
            f"(different model or optimizer settings?)"
        )
    with np.load(os.path.join(path, "arrays.npz"), allow_pickle=False) as data:
        loaded = [data[f"leaf_{i:05d}"] for i in range(len(leaves))]
    for i, (a, b) in enumerate(zip(loaded, leaves)):
        if tuple(a.shape) != tuple(np.shape(b)):
            raise ValueError(f"checkpoint {path}: array {i} has shape {a.shape}, expected {np.shape(b)}")
    loaded = [jax.numpy.asarray(a, dtype=np.asarray(b).dtype if hasattr(b, "dtype") else None)
              for a, b in zip(loaded, leaves)]
    return jax.tree.unflatten(treedef, loaded), meta
