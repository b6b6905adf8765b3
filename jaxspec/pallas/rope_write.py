"""RoPE on a layer's new queries and keys, and their K/V written into the pool, in one launch.

Glossary: R new token rows (B * T), Hq query heads, Hkv KV heads, D head width, L layers,
N pool slots.

What it replaces. The Llama layer body rotates q and k (rotate-half RoPE) and then writes k and v
into the pool at each row's slot. On an H200, XLA ran that part of a batch-1 decode layer as six
small kernels (the query rotation; the scatter's bounds check, a read of the old row, a select and
two in-place updates, the key rotation fused into one of them): six launches of a few kilobytes
each, 32 times a step. This op is one launch per layer. The XLA path the model runs
otherwise is ``apply_rope`` and ``KVPool.write`` in ``jaxspec.model.layers``; the reference here
is the same arithmetic in float32, written out.

Arithmetic: the angles are ``position * inv_freq`` in f32, their cosine and sine are scaled (YaRN's
attention factor) and rounded to the input dtype as the XLA path does, and each rotated element is
``x1 * cos - x2 * sin`` / ``x2 * cos + x1 * sin`` in f32, rounded once. Rows are independent, so a
row's result never depends on the batch or on how many rows a call holds (lossless: verify and
decode rotate a token identically).

Pallas kernel (Triton): grid ``(R,)``; the heads arrive joined, ``[R, Hq + 2 Hkv, D]`` (the q/k/v
product's output as it lies). The program of row ``r`` loads the two halves of every query and key
head as ``[heads, D / 2]`` tiles, rotates them, stores the queries to a new array and the keys and
values to the pool rows ``(layer * N + slot) * Hkv + h`` in place (``input_output_aliases``). A row
whose slot is below ``scratch_slots`` (the scratch page, see ``kvcache.paging.scratch_dropped``) or
``>= N`` rotates its query and writes nothing. The kernel tests the scratch bound itself: mapping
the slots past N in the layer would be one more small launch per layer, which XLA does not hoist out
of the layer loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.block_sizes import next_pow2
from jaxspec.pallas.triton_common import tile_mask, whole


def rope_cos_sin(
    positions: jax.Array,  # i32[...]
    inv_freq,  # f32[D // 2]
    scale: float,
    dtype,
) -> tuple[jax.Array, jax.Array]:  # cos, sin: [..., D // 2] in dtype
    """Cosine and sine of ``positions * inv_freq`` (f32), times ``scale``, rounded to ``dtype``."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return (jnp.cos(freqs) * scale).astype(dtype), (jnp.sin(freqs) * scale).astype(dtype)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:  # x [R, H, D]; cos, sin [R, D/2]
    """Rotate-half RoPE in f32, rounded once to ``x.dtype``."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.astype(jnp.float32)[:, None, :], sin.astype(jnp.float32)[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def rope_write_reference(
    qkv: jax.Array,  # [R, Hq + 2 Hkv, D] a layer's joined q/k/v heads, unrotated
    k_pool: jax.Array,  # [L, N, Hkv, D]
    v_pool: jax.Array,  # [L, N, Hkv, D]
    layer: jax.Array,  # i32[]
    slots: jax.Array,  # i32[R] write slots (< scratch_slots or >= N: not written)
    positions: jax.Array,  # i32[R]
    inv_freq,  # f32[D // 2]
    *,
    q_heads: int,
    scale: float = 1.0,
    scratch_slots: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # rotated q [R, Hq, D], k_pool, v_pool
    """Pure-jnp oracle of the kernel."""
    Hkv, N = k_pool.shape[2], k_pool.shape[1]
    slots = jnp.where(slots >= scratch_slots, slots, N)
    q, k, v = qkv[:, :q_heads], qkv[:, q_heads:q_heads + Hkv], qkv[:, q_heads + Hkv:]
    cos, sin = rope_cos_sin(positions, inv_freq, scale, qkv.dtype)
    k = rotate(k, cos, sin)
    return (rotate(q, cos, sin),
            k_pool.at[layer, slots].set(k.astype(k_pool.dtype), mode="drop"),
            v_pool.at[layer, slots].set(v.astype(v_pool.dtype), mode="drop"))


def _rope_write_kernel(
    layer_ref,  # i32[1]
    slot_ref,  # i32[R]
    pos_ref,  # i32[R]
    freq_ref,  # f32[D / 2]
    qkv_ref,  # [R * (Hq + 2 Hkv), D]
    _k_pool_in,  # aliased to k_pool_ref
    _v_pool_in,  # aliased to v_pool_ref
    q_out_ref,  # [R * Hq, D]
    k_pool_ref,  # [L * N * Hkv, D]
    v_pool_ref,  # [L * N * Hkv, D]
    *,
    q_heads: int,
    kv_heads: int,
    half: int,  # D / 2
    num_slots: int,  # N
    scratch_slots: int,  # slots below it are the scratch page's
    scale: float,
):
    r = pl.program_id(0)
    c = jnp.arange(next_pow2(half), dtype=jnp.int32)  # [Dh]: unclamped, masked past half
    c_ok = None if c.shape[0] == half else c < half
    freq = plgpu.load(freq_ref.at[c]) if c_ok is None else plgpu.load(freq_ref.at[c], mask=c_ok, other=0.0)
    angle = pos_ref[r].astype(jnp.float32) * freq  # f32[Dh]
    # Rounded to the input dtype first, as the XLA path's cos / sin are.
    cos = (jnp.cos(angle) * scale).astype(qkv_ref.dtype).astype(jnp.float32)[None, :]
    sin = (jnp.sin(angle) * scale).astype(qkv_ref.dtype).astype(jnp.float32)[None, :]

    def halves(ref, row, mask):  # the two halves of rows ``row`` (i32[h]): [h, Dh] each
        return (plgpu.load(ref.at[row[:, None], c[None, :]], mask=mask, other=0),
                plgpu.load(ref.at[row[:, None], half + c[None, :]], mask=mask, other=0))

    def rotated(x1, x2):  # f32, as the reference's ``rotate``
        x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    def store(ref, row, lo, hi, mask):
        plgpu.store(ref.at[row[:, None], c[None, :]], lo.astype(ref.dtype), mask=mask)
        plgpu.store(ref.at[row[:, None], half + c[None, :]], hi.astype(ref.dtype), mask=mask)

    first = r * (q_heads + 2 * kv_heads)  # this row's first head in qkv
    hq = jnp.arange(next_pow2(q_heads), dtype=jnp.int32)
    q_ok = hq < q_heads
    q_mask = tile_mask(q_ok, c, c_ok)
    q_out = jnp.where(q_ok, r * q_heads + hq, q_out_ref.shape[0])  # masked rows: out of range
    store(q_out_ref, q_out, *rotated(*halves(qkv_ref, first + jnp.where(q_ok, hq, 0), q_mask)), q_mask)

    slot = slot_ref[r]
    hk = jnp.arange(next_pow2(kv_heads), dtype=jnp.int32)
    src_ok = hk < kv_heads
    dst_ok = src_ok & (slot >= max(scratch_slots, 0)) & (slot < num_slots)
    k_row = first + q_heads + jnp.where(src_ok, hk, 0)
    dst = jnp.where(dst_ok, (layer_ref[0] * num_slots + slot) * kv_heads + hk, k_pool_ref.shape[0])
    src_mask, dst_mask = tile_mask(src_ok, c, c_ok), tile_mask(dst_ok, c, c_ok)
    store(k_pool_ref, dst, *rotated(*halves(qkv_ref, k_row, src_mask)), dst_mask)
    store(v_pool_ref, dst, *halves(qkv_ref, k_row + kv_heads, src_mask), dst_mask)


@functools.partial(jax.jit, static_argnames=("q_heads", "scale", "scratch_slots", "interpret"))
def _rope_write_call(qkv, k_pool, v_pool, layer, slots, positions, inv_freq, *, q_heads: int, scale: float,
                     scratch_slots: int, interpret: bool):
    R, Hw, D = qkv.shape
    L, N, Hkv, _ = k_pool.shape
    ins = (layer, slots, positions, inv_freq, qkv.reshape(R * Hw, D), k_pool.reshape(L * N * Hkv, D),
           v_pool.reshape(L * N * Hkv, D))
    out_shape = (jax.ShapeDtypeStruct((R * q_heads, D), qkv.dtype), jax.ShapeDtypeStruct(ins[5].shape, k_pool.dtype),
                 jax.ShapeDtypeStruct(ins[6].shape, v_pool.dtype))
    q_out, k_flat, v_flat = pl.pallas_call(
        functools.partial(_rope_write_kernel, q_heads=q_heads, kv_heads=Hkv, half=D // 2, num_slots=N,
                          scratch_slots=scratch_slots, scale=scale),
        grid=(R,),
        in_specs=[whole(x) for x in ins],
        out_specs=tuple(whole(s) for s in out_shape),
        out_shape=out_shape,
        input_output_aliases={5: 1, 6: 2},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="rope_write",
    )(*ins)
    return q_out.reshape(R, q_heads, D), k_flat.reshape(k_pool.shape), v_flat.reshape(v_pool.shape)


def rope_write_unsupported(pool_shape: tuple) -> str | None:
    """Why the kernel cannot take a pool ``[L, N, Hkv, D]``, or None."""
    L, N, Hkv, D = pool_shape
    if D % 2:
        return f"rotate-half RoPE needs an even head width, got {D}"
    if L * N * Hkv >= 2**31:  # (Pallas widens element offsets itself past 4 GiB)
        return f"pool rows L*N*Hkv = {L * N * Hkv} overflow the kernel's int32 row index"
    return None


def rope_write_pallas(
    qkv: jax.Array,  # [R, Hq + 2 Hkv, D] joined q/k/v heads, unrotated
    k_pool: jax.Array,  # [L, N, Hkv, D]
    v_pool: jax.Array,  # [L, N, Hkv, D]
    layer: jax.Array,  # i32[]
    slots: jax.Array,  # i32[R] write slots (< scratch_slots or >= N: not written)
    positions: jax.Array,  # i32[R]
    inv_freq,  # f32[D // 2]
    *,
    q_heads: int,
    scale: float = 1.0,
    scratch_slots: int = 0,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # rotated q [R, Hq, D], k_pool, v_pool (updated in place)
    """Pallas path: rotates q and k, writes k and v at ``slots`` of ``layer`` (module docstring).
    The heads come joined as the q/k/v product leaves them, so the kernel reads its output where
    it lies (split apart, they would be copied into buffers of their own first)."""
    if reason := rope_write_unsupported(k_pool.shape):
        raise NotImplementedError(f"rope_write: {reason}")
    R, Hw, D = qkv.shape
    if k_pool.shape != v_pool.shape or k_pool.shape[3] != D or Hw != q_heads + 2 * k_pool.shape[2]:
        raise ValueError(f"qkv {qkv.shape} with {q_heads} query heads does not fit pools {k_pool.shape} / "
                         f"{v_pool.shape}")
    return _rope_write_call(
        qkv, k_pool, v_pool, jnp.asarray(layer, jnp.int32).reshape(1), slots.astype(jnp.int32).reshape(R),
        positions.astype(jnp.int32).reshape(R), jnp.asarray(inv_freq, jnp.float32), q_heads=q_heads,
        scale=float(scale), scratch_slots=int(scratch_slots), interpret=interpret,
    )
