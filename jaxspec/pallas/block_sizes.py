"""Block sizes for the Pallas kernels: one frozen config per kernel and the heuristic that picks it.

Kernels never hard-code a tile size; their jitted wrappers take one of these configs as a
static argument, and ``None`` means "ask the heuristic here". Triton tiles must have a
power-of-two number of elements, and ``tl.dot`` wants every matmul dimension >= 16, so every
tile edge below is a power of two and the attention tiles are at least 16 wide.

The heuristics are written for H100/H200-class GPUs (132 SMs, 64K registers per SM) and also
serve interpret mode on CPU, where what matters is the number of programs (each one is a
step of a sequential loop), so tiny test shapes get a single program per work item.
"""

from __future__ import annotations

import dataclasses

# Streaming multiprocessors to fill before splitting the KV sequence (H100 SXM: 132).
_TARGET_PROGRAMS = 132
# Largest tile (elements) one program keeps in registers for a pure copy (kv_move, gather):
# 4096 elements over 4 warps is 32 values per thread.
_COPY_TILE_ELEMS = 4096
# Fewest KV blocks a split must own for split-KV (flash-decoding) to pay off.
_MIN_BLOCKS_PER_SPLIT = 4
_MAX_KV_SPLITS = 16


def next_pow2(x: int) -> int:
    """Smallest power of two >= max(x, 1)."""
    return 1 << max(int(x) - 1, 0).bit_length()


def _clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionBlocks:
    """Tiles of the paged-attention kernel.

    Attributes:
      block_m: query rows per program, over the folded (T, G) axis (row m is query row
        m // G of q head group-member m % G): every q head sharing one KV head in one tile.
      block_k: KV positions per step of the prefix loop (any page size: positions are
        turned into slots through the page table inside the kernel).
      block_w: block positions (tree / draft scratch / new tokens) per step of the block loop.
      kv_splits: programs that share one (request, KV head, row block) along the prefix
        (flash-decoding); their partial results are merged outside the kernel.
      num_warps, num_stages: Triton launch parameters.
      reload_q: re-read the query tile from global memory (L2) for every KV tile instead of
        holding it in registers across the loop (wide heads; see ``attention_blocks``).
    """

    block_m: int
    block_k: int
    block_w: int
    kv_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    reload_q: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_k", "block_w"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.kv_splits < 1:
            raise ValueError(f"kv_splits must be >= 1, got {self.kv_splits}")


def split_kv(*, programs: int, max_kv_len: int, block_k: int, interpret: bool,
             target_programs: int = _TARGET_PROGRAMS) -> int:
    """KV splits (flash-decoding) for a launch of ``programs`` programs: when too few to reach
    ``target_programs`` (decode / verify at small batch), split the prefix across programs, as
    long as each split keeps a few KV blocks. ``target_programs`` defaults to one program per SM;
    a block-table entry may ask for more (several resident programs per SM hide memory latency
    in a kernel that only streams KV). Interpret mode keeps one (the CPU runs programs in turn)."""
    if interpret or programs >= target_programs:
        return 1
    want = -(-target_programs // programs)
    max_blocks = -(-max_kv_len // block_k)
    return _clamp(min(want, max_blocks // _MIN_BLOCKS_PER_SPLIT), 1, _MAX_KV_SPLITS)


def attention_blocks(
    *,
    batch: int,  # B
    kv_heads: int,  # Hkv
    rows: int,  # T * G folded query rows per (request, KV head)
    block_width: int,  # Wb
    head_dim: int,  # D
    max_kv_len: int,  # W * P: positions the page table can address
    interpret: bool,
) -> AttentionBlocks:
    """Heuristic tiles for the paged-attention kernel (and MLA, as one KV head of width C).

    Head dims up to 128 take up to 128 rows per program. Wider heads (Gemma's 256 / 512, the
    MLA latent 512) keep the f32 accumulator at block_m x D <= 32 x 512 over 8 warps and
    re-read the query tile per KV tile (``reload_q``): held across the loop, a [bm, 512]
    query costs an mma.sync operand of 16 rows x 512 per warp (128 registers) on top of the
    accumulator, and the kernel spills (measured with ``scripts/triton_report.py``).
    """
    d_pad = next_pow2(head_dim)
    if d_pad <= 128:
        block_m, block_k, reload_q = _clamp(next_pow2(rows), 16, 128), 64, False
    else:
        block_m, block_k, reload_q = _clamp(next_pow2(rows), 16, 32), (32 if d_pad <= 256 else 16), True
    block_w = _clamp(next_pow2(block_width), 16, block_k)
    # Eight warps for big tiles; at head dim 128, tiles of up to 32 rows run faster on four
    # (H200, B=16, context 8192, device time: verify n=8 187 vs 228 us, an 8-token draft extend
    # 181 vs 227 us; benchmarks/block_sweep.py).
    num_warps = 8 if block_m * d_pad >= 4096 and not (d_pad <= 128 and block_m <= 32) else 4
    blocks = AttentionBlocks(block_m=block_m, block_k=block_k, block_w=block_w, num_warps=num_warps, num_stages=2,
                             reload_q=reload_q)
    return with_kv_splits(blocks, batch=batch, kv_heads=kv_heads, rows=rows, max_kv_len=max_kv_len,
                          interpret=interpret)


def with_kv_splits(blocks: AttentionBlocks, *, batch: int, kv_heads: int, rows: int, max_kv_len: int,
                   interpret: bool, target_programs: int = _TARGET_PROGRAMS) -> AttentionBlocks:
    """``blocks`` with the KV splits of its launch (B x Hkv x row blocks programs, ``split_kv``)."""
    programs = batch * kv_heads * -(-rows // blocks.block_m)
    return dataclasses.replace(blocks, kv_splits=split_kv(programs=programs, max_kv_len=max_kv_len,
                                                          block_k=blocks.block_k, interpret=interpret,
                                                          target_programs=target_programs))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoveBlocks:
    """Tiles of the KV-move kernel.

    Attributes:
      group_rows: moves per program (a power of two >= the moves of the requests it owns);
        each program reads all of its moves' sources before writing any target.
      requests_per_group: whole requests per program (``None``: all moves in one group, when
        the request structure of the move list is unknown).
      block_cols: row elements per program, per buffer (one entry per buffer of the pool).
      num_warps: Triton launch parameter.
    """

    group_rows: int
    requests_per_group: int | None
    block_cols: tuple[int, ...]
    num_warps: int = 4

    def __post_init__(self):
        for v in (self.group_rows, *self.block_cols):
            if v < 1 or v & (v - 1):
                raise ValueError(f"kv_move tiles must be powers of two, got {self}")


def move_blocks(
    *,
    num_moves: int,  # M = B * S
    moves_per_request: int | None,  # S, or None when unknown
    row_widths: tuple[int, ...],  # C of each buffer (elements per slot)
    tile_elems: int = _COPY_TILE_ELEMS,
    num_warps: int = 4,
) -> MoveBlocks:
    """Heuristic tiles for the KV-move kernel (``tile_elems``, ``num_warps``: from the block
    table when a sweep tuned them)."""
    if moves_per_request is None or num_moves % moves_per_request:
        per_group, rows = None, next_pow2(num_moves)
    else:
        # As many whole requests as fit 32 rows (at least one request).
        per_group = max(1, min(num_moves // moves_per_request, 32 // max(moves_per_request, 1)))
        rows = next_pow2(per_group * moves_per_request)
    cols = tuple(_clamp(tile_elems // rows, 1, next_pow2(c)) for c in row_widths)
    return MoveBlocks(group_rows=rows, requests_per_group=per_group, block_cols=cols, num_warps=num_warps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatherBlocks:
    """Tiles of the fused spec-extras gather.

    Attributes:
      block_rows: gathered rows per program.
      block_cols: columns per program, per gathered array (one entry per array).
      num_warps: Triton launch parameter.
    """

    block_rows: int
    block_cols: tuple[int, ...]
    num_warps: int = 4

    def __post_init__(self):
        for v in (self.block_rows, *self.block_cols):
            if v < 1 or v & (v - 1):
                raise ValueError(f"gather tiles must be powers of two, got {self}")


def gather_blocks(*, num_rows: int, widths: tuple[int, ...], tile_elems: int = _COPY_TILE_ELEMS,
                  num_warps: int = 4) -> GatherBlocks:
    """Heuristic tiles for the fused gather (R rows; C_i columns per array)."""
    rows = _clamp(next_pow2(num_rows), 1, 32)
    cols = tuple(_clamp(tile_elems // rows, 1, next_pow2(max(w, 1))) for w in widths)
    return GatherBlocks(block_rows=rows, block_cols=cols, num_warps=num_warps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedBlocks:
    """Tiles of the grouped (per-expert) matmul.

    Attributes:
      block_m: rows per tile; every tile holds rows of one group only (each group is padded to a
        multiple of it), so a tile reads one expert's weights.
      block_n: output columns per program.
      block_k: the reduction step.
      num_warps, num_stages: Triton launch parameters.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for v in (self.block_m, self.block_n, self.block_k):
            if v < 16 or v & (v - 1):
                raise ValueError(f"grouped-matmul tiles must be powers of two >= 16 (tl.dot), got {self}")


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n (1 when n is odd)."""
    d = 1
    while d < cap and n % (2 * d) == 0:
        d *= 2
    return d


def grouped_blocks(*, rows: int, groups: int, k: int, n: int, block_m: int | None = None) -> GroupedBlocks | None:
    """Heuristic tiles for the grouped matmul of ``rows`` rows over ``groups`` groups (``[rows, k]``
    times a ``[k, n]`` weight per group), or None when ``k`` or ``n`` has no power-of-two divisor
    >= 16 (the kernel never pads the weights: a padded copy of every expert would cost more than
    the product). Rows per group average ``rows / groups``: at a verify (a few rows per expert)
    tiles of 16 rows waste the least padding; a prefill (hundreds of rows per expert) takes 64, so
    each weight tile is read by 4x fewer programs. ``block_m``: the rows per tile of a layout
    already built."""
    bn, bk = _pow2_divisor(n, 128), _pow2_divisor(k, 64)
    if bn < 16 or bk < 16:
        return None
    if block_m is None:
        block_m = 64 if rows >= 64 * groups else 16
    if block_m >= 64:  # 8 warps: the gated product's two [64, 128] f32 accumulators
        return GroupedBlocks(block_m=block_m, block_n=bn, block_k=bk, num_warps=8)
    return GroupedBlocks(block_m=block_m, block_n=bn, block_k=bk)
