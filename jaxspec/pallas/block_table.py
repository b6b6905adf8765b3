"""Block sizes by GPU kind and shape class, and the shapes a GPU must not run natively.

``block_table.json`` (next to this file) holds, per GPU kind (``"h100"``, ``"h200"``, ...):

* ``"blocks"``: shape-class pattern -> tile fields (``block_m``, ``block_k``, ``block_w``,
  ``num_warps``, ``num_stages``, ``reload_q`` and the launch size ``target_programs`` for attention; ``num_warps``, ``tile_elems``
  for the copy kernels). Written by the block-size sweep of ``benchmarks/gpu_check.py``.
* ``"xla"``: shape-class pattern -> the reason that shape runs on XLA on that GPU (a kernel
  that fails natively, spills, or loses to XLA). ``implementation=None`` routes matching
  calls to XLA with a one-time warning naming the op and the reason.

A shape class is a string ``op/phase/d<head dim>/p<page size>`` for attention (phase:
decode, prefill, verify, draft; MLA uses the latent width as its head dim),
``mla_sparse_attention/<decode|rows>/d<latent>`` for sparse MLA (slots are given: no page
size), ``dsa_indexer/<decode|rows>/h<heads>d<width>`` for the DSA indexer scores (its tile is
``IndexerBlocks``, not read from the table), and the op name for the copy kernels. Patterns use ``fnmatch`` wildcards (``paged_attention/*/d512/*``); the
most specific match wins (fewest ``*``, then longest). What the table does not name falls
back to the heuristics of ``block_sizes`` (the default entry), and interpret mode always uses
the heuristics (the CPU runs programs one after another, so it wants few of them).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import json
import re
from pathlib import Path
from typing import Any

from jaxspec.pallas.block_sizes import AttentionBlocks, attention_blocks, with_kv_splits

TABLE_PATH = Path(__file__).with_name("block_table.json")
ATTENTION_FIELDS = ("block_m", "block_k", "block_w", "num_warps", "num_stages", "reload_q")
# An attention entry's launch size: programs to reach before the KV splits stop (``split_kv``).
LAUNCH_FIELDS = ("target_programs",)
COPY_FIELDS = ("num_warps", "tile_elems")


def gpu_key(device_kind: str) -> str:
    """Table key of a device kind: ``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,3}[A-Z]?)\b", device_kind.upper())
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-")


def attention_phase(*, rows: int, block_width: int, causal: bool) -> str:
    """decode (one causal row), prefill (causal rows), verify (tree mask over the rows
    themselves), draft (ancestor mask over a wider scratch block)."""
    if causal:
        return "decode" if rows == 1 else "prefill"
    return "verify" if block_width == rows else "draft"


def attention_class(op: str, *, phase: str, head_dim: int, page_size: int) -> str:
    return f"{op}/{phase}/d{head_dim}/p{page_size}"


def attention_class_of(op: str, *, rows: int, block_mask, head_dim: int, page_size: int) -> str:
    """The class of an attention call with ``rows`` query rows and a block mask [B, T, Wb] (or
    None: causal)."""
    width = rows if block_mask is None else block_mask.shape[2]
    phase = attention_phase(rows=rows, block_width=width, causal=block_mask is None)
    return attention_class(op, phase=phase, head_dim=head_dim, page_size=page_size)


@functools.cache
def load_table(path: str | None = None) -> dict[str, Any]:
    with open(path or TABLE_PATH) as f:
        return json.load(f)


def lookup(gpu: str | None, section: str, shape_class: str, *, table: dict | None = None) -> Any:
    """The most specific entry of ``table[gpu][section]`` matching ``shape_class``, or None."""
    if gpu is None:
        return None
    entries = (table if table is not None else load_table()).get(gpu, {}).get(section, {})
    hits = [p for p in entries if fnmatch.fnmatchcase(shape_class, p)]
    if not hits:
        return None
    return entries[min(hits, key=lambda p: (p.count("*"), -len(p)))]


def xla_reason(gpu: str | None, shape_class: str) -> str | None:
    """Why ``shape_class`` runs on XLA on this GPU (the table's ``"xla"`` section), or None."""
    return lookup(gpu, "xla", shape_class)


def attention_blocks_for(
    shape_class: str,
    *,
    gpu: str | None,
    batch: int,
    kv_heads: int,
    rows: int,
    block_width: int,
    head_dim: int,
    max_kv_len: int,
    interpret: bool,
) -> AttentionBlocks:
    """Tiles of an attention launch: the table's entry for (GPU kind, shape class) over the
    heuristics; KV splits always follow from the launch size (``block_sizes.split_kv``), towards
    the entry's ``target_programs`` where it has one."""
    blocks = attention_blocks(batch=batch, kv_heads=kv_heads, rows=rows, block_width=block_width,
                              head_dim=head_dim, max_kv_len=max_kv_len, interpret=interpret)
    entry = None if interpret else lookup(gpu, "blocks", shape_class)
    if not entry:
        return blocks
    blocks = dataclasses.replace(blocks, **{k: v for k, v in entry.items() if k in ATTENTION_FIELDS})
    launch = {k: entry[k] for k in LAUNCH_FIELDS if k in entry}
    return with_kv_splits(blocks, batch=batch, kv_heads=kv_heads, rows=rows, max_kv_len=max_kv_len,
                          interpret=interpret, **launch)


def copy_overrides(op: str, *, gpu: str | None, interpret: bool) -> dict[str, int]:
    """``num_warps`` / ``tile_elems`` for a copy kernel (kv_move, gather) from the table."""
    entry = None if interpret else lookup(gpu, "blocks", op)
    return {k: v for k, v in (entry or {}).items() if k in COPY_FIELDS}


def write_entries(gpu: str, section: str, entries: dict[str, Any], path: str | Path | None = None) -> Path:
    """Merges ``entries`` into ``table[gpu][section]`` of the JSON table (what a sweep calls)."""
    path = Path(path or TABLE_PATH)
    table = json.loads(path.read_text()) if path.exists() else {}
    table.setdefault(gpu, {}).setdefault(section, {}).update(entries)
    path.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    load_table.cache_clear()
    return path
