"""Random paged-attention problems and an independent numpy oracle (shared by the
reference and kernel tests)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Problem:
    q: np.ndarray  # [B, T, Hq, D]
    k_pool: np.ndarray  # [L, N, Hkv, D]
    v_pool: np.ndarray
    layer: int
    page_table: np.ndarray  # [B, W]
    prefix_lens: np.ndarray  # [B]
    block_mask: np.ndarray | None  # [B, T, Wb]
    page_size: int
    sm_scale: float


def make_problem(kind: str, *, B=2, T=4, Hq=4, Hkv=2, D=16, page_size=4, W=6, L=2, seed=0, dtype=np.float32,
                 prefix=None, padded=0) -> Problem:
    """kind: "prefill" (causal), "decode" (T=1), "tree" (random tree mask), "draft" (block wider
    than T: topk rows over a scratch region). The last ``padded`` requests are engine padding:
    prefix 0 and every page-table entry on the scratch page 0 (their rows write slot 0)."""
    rng = np.random.default_rng(seed)
    num_pages = B * W + 1
    N = num_pages * page_size
    table = (1 + rng.permutation(B * W)).reshape(B, W).astype(np.int32)
    if kind == "decode":
        T = 1
    block = T if kind != "draft" else 3 * T
    cap = W * page_size - block
    prefix_lens = (rng.integers(0, cap + 1, size=B) if prefix is None else np.asarray(prefix)).astype(np.int32)
    mask = None
    if kind == "tree":
        parent = [-1] + [int(rng.integers(0, i)) for i in range(1, T)]
        m = np.eye(T, dtype=bool)
        for i in range(T):
            j = parent[i]
            while j >= 0:
                m[i, j] = True
                j = parent[j]
        mask = np.broadcast_to(m, (B, T, T)).copy()
    elif kind == "draft":
        mask = rng.random((B, T, block)) < 0.4
        mask[:, np.arange(T), np.arange(T) * 3] = True  # every row sees itself
    elif kind == "decode":
        mask = None
    if padded:
        table[B - padded:] = 0
        prefix_lens[B - padded:] = 0
    q = rng.standard_normal((B, T, Hq, D)).astype(dtype)
    k_pool = rng.standard_normal((L, N, Hkv, D)).astype(dtype)
    v_pool = rng.standard_normal((L, N, Hkv, D)).astype(dtype)
    return Problem(q, k_pool, v_pool, int(rng.integers(0, L)), table, prefix_lens, mask, page_size, D**-0.5)


def oracle(p: Problem) -> np.ndarray:
    """Loops over rows and heads; float64."""
    B, T, Hq, D = p.q.shape
    Hkv = p.k_pool.shape[2]
    G = Hq // Hkv
    P = p.page_size
    out = np.zeros((B, T, Hq, D))
    for b in range(B):
        prefix = int(p.prefix_lens[b])
        wb = T if p.block_mask is None else p.block_mask.shape[2]
        for t in range(T):
            visible = list(range(prefix))
            for w in range(wb):
                ok = (w <= t) if p.block_mask is None else bool(p.block_mask[b, t, w])
                if ok:
                    visible.append(prefix + w)
            slots = [p.page_table[b, pos // P] * P + pos % P for pos in visible]
            for h in range(Hq):
                k = p.k_pool[p.layer, slots, h // G].astype(np.float64)
                v = p.v_pool[p.layer, slots, h // G].astype(np.float64)
                s = k @ p.q[b, t, h].astype(np.float64) * p.sm_scale
                w_ = np.exp(s - s.max())
                out[b, t, h] = (w_ / w_.sum()) @ v
    return out


def visible_positions(p: Problem, b: int) -> list[int]:
    """Positions of request ``b`` that at least one of its rows may attend to."""
    T = p.q.shape[1]
    prefix = int(p.prefix_lens[b])
    wb = T if p.block_mask is None else p.block_mask.shape[2]
    seen = [w for w in range(wb) if (p.block_mask is None and w < T) or
            (p.block_mask is not None and p.block_mask[b, :, w].any())]
    return list(range(prefix)) + [prefix + w for w in seen]


def poison_invisible(p: Problem) -> tuple[np.ndarray, np.ndarray]:
    """Copies of the K/V pools with NaN in every element no row can see: other layers
    entirely, and every slot of ``p.layer`` outside the requests' visible positions. A
    kernel that reads only what it may see returns the clean oracle's output."""
    P = p.page_size
    keep = np.zeros(p.k_pool.shape[1], dtype=bool)
    for b in range(p.q.shape[0]):
        for pos in visible_positions(p, b):
            keep[p.page_table[b, pos // P] * P + pos % P] = True
    k = np.full_like(p.k_pool, np.nan)
    v = np.full_like(p.v_pool, np.nan)
    k[p.layer, keep] = p.k_pool[p.layer, keep]
    v[p.layer, keep] = p.v_pool[p.layer, keep]
    return k, v
