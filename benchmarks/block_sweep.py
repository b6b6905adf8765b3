"""Block sizes per shape class of the Pallas attention kernels, swept natively on a GPU.

Shape classes: Llama-3-8B decode / verify / draft / prefill at page 16 and 64, DeepSeek-V3 MLA,
Gemma-like wide heads. Each candidate tile (around the heuristic's) runs against the f32 reference and
is timed (dispatched calls, medians); the fastest that matches is kept, and ``sweep`` writes the
repository's table with this GPU's entries merged into ``OUT/block_table.json`` (copy it to
``jaxspec/pallas/block_table.json``). A class where every candidate fails, or whose best loses
clearly to XLA, gets an ``"xla"`` entry with the reason, so ``implementation=None`` runs XLA there.
Run by ``benchmarks/gpu_check.py`` (item ``sweep``); ``dry_run`` sweeps two tiny classes in interpret mode.
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
from jaxspec.pallas.block_sizes import AttentionBlocks, next_pow2, split_kv  # noqa: E402
from jaxspec.pallas.mla_attention import mla_attention_pallas, mla_attention_reference  # noqa: E402
from jaxspec.pallas.paged_attention import paged_attention_pallas, paged_attention_reference  # noqa: E402

# Best Pallas time over the XLA path's beyond which a swept class is sent to XLA.
XLA_FALLBACK_RATIO = 1.25


@dataclasses.dataclass(frozen=True)
class SweepShape:
    """One shape class to tune, at one representative launch."""

    op: str  # paged_attention | mla_attention
    shape: object  # kernels.AttnShape | kernels.MLAShape

    def problem(self):
        if self.op == "paged_attention":
            args, _ = kbench.attention_problem(self.shape)
            return args[:6] + ((None,) if self.shape.nodes == 1 or "prefill" in self.shape.name else (args[6],))
        args, _ = kbench.mla_problem(self.shape)
        return args

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
        SweepShape("paged_attention", A("llama3-8b decode B=32", 32, ctx, 1)),
        SweepShape("paged_attention", A("llama3-8b decode B=32 p64", 32, ctx, 1, page_size=64)),
        SweepShape("paged_attention", A("llama3-8b verify n=8 B=16", 16, ctx, 8)),
        SweepShape("paged_attention", A("llama3-8b verify n=8 B=16 p64", 16, ctx, 8, page_size=64)),
        SweepShape("paged_attention", A("llama3-8b prefill T=2048", 1, 0, 2048)),
        SweepShape("mla_attention", M("deepseek-v3 mla decode B=32", 32, ctx, 1)),
        SweepShape("mla_attention", M("deepseek-v3 mla verify n=8 B=16", 16, ctx, 8)),
        SweepShape("paged_attention", A("gemma4 sliding D=256 verify n=8 B=16", 16, ctx, 8, q_heads=32, kv_heads=16,
                                        head_dim=256)),
        SweepShape("paged_attention", A("gemma4 full D=512 verify n=8 B=16", 16, ctx, 8, q_heads=32, kv_heads=4,
                                        head_dim=512)),
    ]


def candidates(s: SweepShape, max_kv_len: int, block_width: int, dry_run: bool) -> list[AttentionBlocks]:
    """Tiles around the heuristic (block_m x block_k x warps at 2 stages; more stages for the
    best of those are tried separately), each with the KV splits its launch size implies and
    block_w as the heuristic sets it (the block's width, 16 to block_k)."""
    wide = s.head_dim > 128
    block_ms = [16, 32] if wide else [16, 32, 64, 128]
    block_ks = [16, 32] if wide else [32, 64]
    warps = [4, 8]
    if dry_run:
        block_ms, block_ks, warps = [16], [16, 32], [4]
    rows = s.rows
    out = []
    for bm in block_ms:
        if bm > max(16, 2 * rows):  # more than half the tile would be padding rows
            continue
        for bk in block_ks:
            for w in warps:
                splits = split_kv(programs=s.shape.batch * s.kv_heads * -(-rows // bm), max_kv_len=max_kv_len,
                                  block_k=bk, interpret=dry_run)
                block_w = min(bk, max(16, next_pow2(block_width)))
                out.append(AttentionBlocks(block_m=bm, block_k=bk, block_w=block_w, kv_splits=splits,
                                           num_warps=w, num_stages=2, reload_q=wide))
    return out


def sweep(out_dir: Path, *, dry_run: bool, deadline, write_table: bool = False) -> dict:
    """Sweeps ``sweep_shapes``; ``deadline.passed(reserve_s)`` stops early."""
    interpret = not dispatch.on_gpu()
    gpu = dispatch.gpu_kind() or "cpu-dry-run"
    timing = dict(warmup=1, repeats=2) if dry_run else dict(warmup=3, repeats=20)
    blocks_entries, xla_entries, rows = {}, {}, []
    for s in sweep_shapes(dry_run):
        if deadline.passed(reserve_s=90):
            rows.append(dict(shape=s.shape.name, skipped="deadline"))
            continue
        row = dict(shape=s.shape.name, tried=[])
        try:
            a = s.problem()
            cls = s.shape_class(a)
            row["class"] = cls
            want = np.asarray(s.reference()(*a), np.float32)
            t_xla = kbench.median_seconds(s.xla(), a, **timing)
            row["xla_us"] = t_xla * 1e6
            max_kv_len = a[4].shape[1] * s.shape.page_size

            def attempt(blocks):
                try:
                    fn = s.run(blocks, interpret)
                    got = np.asarray(fn(*a), np.float32)
                    tol = kbench.TOL[s.shape.dtype]
                    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
                    t = kbench.median_seconds(fn, a, **timing)
                    row["tried"].append(dict(blocks=dataclasses.asdict(blocks), us=t * 1e6))
                    return t
                except Exception as e:  # noqa: BLE001 - a failing candidate is a result
                    row["tried"].append(dict(blocks=dataclasses.asdict(blocks), error=f"{type(e).__name__}: "
                                             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]))
                    return None

            best, best_t = None, None
            width = s.shape.nodes if a[6] is None else a[6].shape[2]
            for blocks in candidates(s, max_kv_len, width, dry_run):
                if deadline.passed(reserve_s=60):
                    break
                t = attempt(blocks)
                if t is not None and (best_t is None or t < best_t):
                    best, best_t = blocks, t
            if best is not None and not dry_run:  # deeper pipelines for the winner
                for stages in (3, 4):
                    t = attempt(dataclasses.replace(best, num_stages=stages))
                    if t is not None and t < best_t:
                        best, best_t = dataclasses.replace(best, num_stages=stages), t
            if best is None:
                errors = {t.get("error") for t in row["tried"]} - {None}
                xla_entries[cls] = f"no tile configuration ran natively ({'; '.join(sorted(errors))[:300]})"
            else:
                row["best"] = dict(blocks=dataclasses.asdict(best), us=best_t * 1e6, xla_over_pallas=t_xla / best_t)
                blocks_entries[cls] = {k: getattr(best, k) for k in block_table.ATTENTION_FIELDS}
                if best_t > XLA_FALLBACK_RATIO * t_xla:
                    xla_entries[cls] = (f"Pallas {best_t * 1e6:.0f} us vs XLA {t_xla * 1e6:.0f} us at "
                                        f"{s.shape.name} (gpu_check sweep)")
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        rows.append(row)
        best = row.get("best")
        print(f"  {s.shape.name}: " + (f"best {best['blocks']} {best['us']:.1f} us (XLA {row['xla_us']:.1f} us)"
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
