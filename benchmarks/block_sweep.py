"""Block sizes per shape class of the Pallas attention kernels, swept natively on a GPU.

Shape classes, in priority order: the Llama-3-8B shape at B=16, context 8192 (decode, verify n=8, a
causal 8-token draft extend: the launches the bandwidth goals name), then decode at B=32 and page 64,
verify at page 64, a long prefill, DeepSeek-V3 MLA and Gemma-like wide heads. Each candidate (tiles
and the launch size the KV splits aim for, ``target_programs``) runs against the f32 reference and
is timed in device time (``kernels.device_seconds``: many calls in one compiled loop, so a small
launch is not hidden under its dispatch); the fastest that matches is kept, as what it changes over
the heuristic's tiles (so a class's shapes the sweep did not launch keep the heuristic's). The search is staged to
fit a GPU call: launch size x warps at the heuristic's tiles, then the tiles at the best launch, then
deeper pipelines. ``sweep`` writes the repository's table with this GPU's entries merged into
``OUT/block_table.json`` (copy it to ``jaxspec/pallas/block_table.json``; ``write_table`` also
updates the checkout's table, so later items of the same run use it). A class where every candidate
fails, or whose best loses clearly to XLA, gets an ``"xla"`` entry with the reason, so
``implementation=None`` runs XLA there. Run by ``benchmarks/gpu_check.py`` (item ``sweep``);
``dry_run`` sweeps two tiny classes in interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ (kernels.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import kernels as kbench  # noqa: E402  (benchmarks/kernels.py)
from jaxspec.pallas import block_table, dispatch  # noqa: E402
from jaxspec.pallas.block_sizes import AttentionBlocks, attention_blocks, with_kv_splits  # noqa: E402
from jaxspec.pallas.mla_attention import mla_attention_pallas, mla_attention_reference  # noqa: E402
from jaxspec.pallas.paged_attention import paged_attention_pallas, paged_attention_reference  # noqa: E402

# Best Pallas time over the XLA path's beyond which a swept class is sent to XLA.
XLA_FALLBACK_RATIO = 1.25
# Launch sizes the KV splits may aim for: one to eight programs per SM of an H100 / H200 (132 SMs).
TARGET_PROGRAMS = (132, 264, 528, 1056)


@dataclasses.dataclass(frozen=True)
class SweepShape:
    """One shape class to tune, at one representative launch."""

    op: str  # paged_attention | mla_attention
    shape: object  # kernels.AttnShape | kernels.MLAShape

    def problem(self):
        if self.op == "paged_attention":
            args, floor = kbench.attention_problem(self.shape)
            causal = self.shape.nodes == 1 or "prefill" in self.shape.name or "causal" in self.shape.name
            return args[:6] + ((None,) if causal else (args[6],)), floor
        return kbench.mla_problem(self.shape)

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim if self.op == "paged_attention" else self.shape.latent

    @property
    def rows(self) -> int:  # folded rows per (request, KV head)
        s = self.shape
        return s.nodes * (s.q_heads // s.kv_heads if self.op == "paged_attention" else s.heads)

    @property
    def kv_heads(self) -> int:
        return self.shape.kv_heads if self.op == "paged_attention" else 1

    def shape_class(self, args) -> str:
        return block_table.attention_class_of(self.op, rows=self.shape.nodes, block_mask=args[6],
                                              head_dim=self.head_dim, page_size=self.shape.page_size)

    def run(self, blocks, interpret):
        fn = paged_attention_pallas if self.op == "paged_attention" else mla_attention_pallas
        return jax.jit(functools.partial(fn, page_size=self.shape.page_size, sm_scale=0.088, interpret=interpret,
                                         blocks=blocks))

    def heuristic(self, args) -> AttentionBlocks:
        """The tiles ``block_sizes`` picks for this launch (the search starts there)."""
        width = self.shape.nodes if args[6] is None else args[6].shape[2]
        return attention_blocks(batch=self.shape.batch, kv_heads=self.kv_heads, rows=self.rows, block_width=width,
                                head_dim=self.head_dim, max_kv_len=args[4].shape[1] * self.shape.page_size,
                                interpret=False)

    def reference(self):
        fn = paged_attention_reference if self.op == "paged_attention" else mla_attention_reference
        return jax.jit(functools.partial(fn, page_size=self.shape.page_size, sm_scale=0.088))

    def xla(self):
        if self.op == "paged_attention":
            return kbench.attention_fn(self.shape, "xla")
        return kbench.mla_fn(self.shape, "xla")


def sweep_shapes(dry_run: bool) -> list[SweepShape]:
    A, M = kbench.AttnShape, kbench.MLAShape
    if dry_run:
        return [SweepShape("paged_attention", A("sweep-smoke verify", 2, 40, 4, q_heads=4, kv_heads=2, head_dim=16,
                                                 dtype="float32")),
                SweepShape("mla_attention", M("sweep-smoke mla decode", 2, 40, 1, heads=4, latent=32, rope=8,
                                              dtype="float32"))]
    ctx = 4096
    return [
        SweepShape("paged_attention", A("llama3-8b decode B=16 ctx=8192", 16, 8192, 1)),
        SweepShape("paged_attention", A("llama3-8b verify n=8 B=16 ctx=8192", 16, 8192, 8)),
        SweepShape("paged_attention", A("llama3-8b draft-extend T=8 B=16 ctx=8192 causal", 16, 8192, 8)),
        SweepShape("paged_attention", A("llama3-8b decode B=32", 32, ctx, 1)),
        SweepShape("paged_attention", A("llama3-8b decode B=32 p64", 32, ctx, 1, page_size=64)),
        SweepShape("paged_attention", A("llama3-8b verify n=8 B=16 p64", 16, ctx, 8, page_size=64)),
        SweepShape("paged_attention", A("llama3-8b prefill T=2048", 1, 0, 2048)),
        SweepShape("mla_attention", M("deepseek-v3 mla decode B=32", 32, ctx, 1)),
        SweepShape("mla_attention", M("deepseek-v3 mla verify n=8 B=16", 16, ctx, 8)),
        SweepShape("paged_attention", A("gemma4 sliding D=256 verify n=8 B=16", 16, ctx, 8, q_heads=32, kv_heads=16,
                                        head_dim=256)),
        SweepShape("paged_attention", A("gemma4 full D=512 verify n=8 B=16", 16, ctx, 8, q_heads=32, kv_heads=4,
                                        head_dim=512)),
    ]


def with_launch(s: SweepShape, blocks: AttentionBlocks, max_kv_len: int, target_programs: int,
                interpret: bool) -> AttentionBlocks:
    """``blocks`` with the KV splits its launch implies when they aim for ``target_programs``."""
    return with_kv_splits(blocks, batch=s.shape.batch, kv_heads=s.kv_heads, rows=s.rows, max_kv_len=max_kv_len,
                          interpret=interpret, target_programs=target_programs)


def launch_candidates(s: SweepShape, start: AttentionBlocks, max_kv_len: int,
                      dry_run: bool) -> list[tuple[AttentionBlocks, int]]:
    """Stage 1: the heuristic's tiles at every launch size and warp count (distinct launches only)."""
    out, seen = [], set()
    for tp in TARGET_PROGRAMS[:1] if dry_run else TARGET_PROGRAMS:
        for w in (4,) if dry_run else (4, 8):
            b = with_launch(s, dataclasses.replace(start, num_warps=w), max_kv_len, tp, dry_run)
            if b not in seen:
                seen.add(b)
                out.append((b, tp))
    return out


def tile_candidates(s: SweepShape, best: AttentionBlocks, target_programs: int, max_kv_len: int, block_width: int,
                    dry_run: bool) -> list[AttentionBlocks]:
    """Stage 2: block_m x block_k around the best launch (block_w as the heuristic sets it: the
    block's width, 16 to block_k), each with the KV splits of that launch size."""
    wide = s.head_dim > 128
    block_ms = [16, 32] if wide else [16, 32, 64, 128]
    block_ks = [16, 32] if wide else [32, 64, 128]
    if dry_run:
        block_ms, block_ks = [16], [16, 32]
    out = []
    for bm in block_ms:
        if bm > max(16, 2 * s.rows):  # more than half the tile would be padding rows
            continue
        for bk in block_ks:
            block_w = min(bk, max(16, 1 << max(block_width - 1, 0).bit_length()))
            b = dataclasses.replace(best, block_m=bm, block_k=bk, block_w=block_w, reload_q=wide)
            b = with_launch(s, b, max_kv_len, target_programs, dry_run)
            if b != best:
                out.append(b)
    return out


def sweep(out_dir: Path, *, dry_run: bool, deadline, write_table: bool = False, only: str | None = None) -> dict:
    """Sweeps ``sweep_shapes`` (``only``: those whose name holds one of its comma-separated parts);
    ``deadline.passed(reserve_s)`` stops early."""
    interpret = not dispatch.on_gpu()
    gpu = dispatch.gpu_kind() or "cpu-dry-run"
    timing = dict(repeats=1, n_fixed=2) if dry_run else dict(repeats=5)
    bandwidth = kbench.bandwidth_bytes_per_s(None)
    blocks_entries, xla_entries, rows = {}, {}, []
    parts = [p.strip() for p in (only or "").split(",") if p.strip()]
    for s in sweep_shapes(dry_run):
        if parts and not any(p in s.shape.name for p in parts):
            continue
        if deadline.passed(reserve_s=90):
            rows.append(dict(shape=s.shape.name, skipped="deadline"))
            continue
        row = dict(shape=s.shape.name, tried=[])
        try:
            a, floor = s.problem()
            cls = s.shape_class(a)
            row["class"] = cls
            if bandwidth:
                row["floor_us"] = floor / bandwidth * 1e6
            want = np.asarray(s.reference()(*a), np.float32)
            t_xla, _ = kbench.device_seconds(s.xla(), a, **timing)
            row["xla_us"] = t_xla * 1e6
            max_kv_len = a[4].shape[1] * s.shape.page_size
            heuristic = s.heuristic(a)

            def attempt(blocks, target_programs):
                try:
                    fn = s.run(blocks, interpret)
                    got = np.asarray(fn(*a), np.float32)
                    tol = kbench.TOL[s.shape.dtype]
                    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
                    t, _ = kbench.device_seconds(fn, a, **timing)
                    row["tried"].append(dict(blocks=dataclasses.asdict(blocks), target_programs=target_programs,
                                             us=t * 1e6))
                    return t
                except Exception as e:  # noqa: BLE001 - a failing candidate is a result
                    row["tried"].append(dict(blocks=dataclasses.asdict(blocks), error=f"{type(e).__name__}: "
                                             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]))
                    return None

            best, best_tp, best_t = None, TARGET_PROGRAMS[0], None

            def consider(blocks, tp):
                nonlocal best, best_tp, best_t
                if deadline.passed(reserve_s=60):
                    return
                t = attempt(blocks, tp)
                if t is not None and (best_t is None or t < best_t):
                    best, best_tp, best_t = blocks, tp, t

            for blocks, tp in launch_candidates(s, heuristic, max_kv_len, dry_run):
                if blocks == heuristic:
                    row["heuristic_index"] = len(row["tried"])
                consider(blocks, tp)
            width = s.shape.nodes if a[6] is None else a[6].shape[2]
            if best is not None:
                for blocks in tile_candidates(s, best, best_tp, max_kv_len, width, dry_run):
                    consider(blocks, best_tp)
            if best is not None and not dry_run:  # deeper pipelines for the winner
                for stages in (3, 4):
                    consider(dataclasses.replace(best, num_stages=stages), best_tp)
            if best is None:
                errors = {t.get("error") for t in row["tried"]} - {None}
                xla_entries[cls] = f"no tile configuration ran natively ({'; '.join(sorted(errors))[:300]})"
            else:
                row["best"] = dict(blocks=dataclasses.asdict(best), target_programs=best_tp, us=best_t * 1e6,
                                   xla_over_pallas=t_xla / best_t if best_t > 0 else None)
                if "floor_us" in row and row["floor_us"] > 0:
                    row["best"]["over_floor"] = best_t * 1e6 / row["floor_us"]
                # Only what the winner changes over the heuristic: a class's other shapes (a long
                # prefill, a wider verify) keep the heuristic's tiles, which this launch did not measure.
                entry = {k: getattr(best, k) for k in block_table.ATTENTION_FIELDS
                         if getattr(best, k) != getattr(heuristic, k)}
                if best_tp != TARGET_PROGRAMS[0]:
                    entry["target_programs"] = best_tp
                blocks_entries[cls] = entry
                if best_t > XLA_FALLBACK_RATIO * t_xla:
                    xla_entries[cls] = (f"Pallas {best_t * 1e6:.0f} us vs XLA {t_xla * 1e6:.0f} us at "
                                        f"{s.shape.name} (gpu_check sweep, device time)")
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        rows.append(row)
        best = row.get("best")
        print(f"  {s.shape.name}: " + (f"best {best['blocks']} aiming at {best['target_programs']} programs: "
                                       f"{best['us']:.1f} us (XLA {row['xla_us']:.1f} us"
                                       + (f", floor {row['floor_us']:.1f} us" if "floor_us" in row else "") + ")"
                                       if best else row.get("error", row.get("skipped", "no candidate ran"))),
              flush=True)
    table_path = Path(out_dir) / "block_table.json"
    table_path.write_text(block_table.TABLE_PATH.read_text())  # start from the repo's table
    block_table.write_entries(gpu, "blocks", blocks_entries, table_path)
    block_table.write_entries(gpu, "xla", xla_entries, table_path)
    if write_table:
        block_table.write_entries(gpu, "blocks", blocks_entries)
        block_table.write_entries(gpu, "xla", xla_entries)
    return dict(gpu=gpu, results=rows, table=str(table_path), blocks=blocks_entries, xla=xla_entries)
