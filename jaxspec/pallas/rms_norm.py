"""RMSNorm of rows with a layer's weight taken from the stacked weights, in one launch.

Glossary: R rows, H width, L layers.

What it replaces. XLA runs an RMSNorm as two kernels: a row reduction (the mean of squares) and an
elementwise fusion (scale and weight). A decode layer has two norms, so four launches of a few
kilobytes each, 32 times a step. This op is one launch per norm. It takes the whole stacked weight
``[L, H]`` and the layer index, because a layer's slice of a stacked array handed to a custom call
would first be copied into a buffer of its own (one more small kernel); the products do not have
this problem, since XLA passes their slices to cuBLAS where they lie.

Arithmetic (HF Llama's): ``ms = mean(x^2)`` in f32, ``x * rsqrt(ms + eps)`` rounded to the input
dtype, then times the weight (the product of two bf16 values is exact in f32, so rounding it once
equals XLA's bf16 multiply). ``centred`` (Qwen3-Next / Qwen3.5, zero-centred weights): the
normalized row stays in f32 and is scaled by ``1 + w`` in f32, then rounded once to the input dtype.
The mean's summation order is the kernel's own: a row's result is independent of the other rows and
of how many rows a call holds, so verify and decode normalize a token identically.

Recording the input (``record``). A target whose hidden states feed a draft (EAGLE-3's and DFlash's
taps) keeps the stream entering each tapped layer: in a layer loop every layer writes its input
into a slot of a stacked buffer (untapped layers into a dummy slot), one more small kernel a layer.
The layer's first norm reads that row anyway, so with ``record=(buffer [S, R, H], slots i32[L])`` it
also stores the row, unchanged, at ``buffer[slots[layer]]``: the buffer is aliased in place, and the
record costs no launch. (The kernel looks the slot up itself: a slot indexed outside it would be one
more small kernel a layer, for one integer.)

Pallas kernel (Triton): grid ``(R,)``; the program of row ``r`` loads the row (padded to a power of
two, masked), reduces it, and stores the normalized row (and the row itself when recording).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.block_sizes import next_pow2
from jaxspec.pallas.triton_common import whole


def rms_norm_reference(
    x: jax.Array,  # [R, H]
    weights: jax.Array,  # [L, H]
    layer: jax.Array,  # i32[]
    eps: float,
    centred: bool = False,
) -> jax.Array:  # [R, H], result dtype of (weights, x); centred: x's
    """Pure-jnp oracle: HF Llama's RMSNorm with ``weights[layer]`` (``centred``: Qwen3-Next's)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if centred:
        return (xf * (1.0 + weights[layer].astype(jnp.float32))).astype(x.dtype)
    return weights[layer] * xf.astype(x.dtype)


def record_reference(
    buffer: jax.Array,  # [S, R, H]
    slots: jax.Array,  # i32[L] the slot of each layer
    layer: jax.Array,  # i32[]
    x: jax.Array,  # [R, H]
) -> jax.Array:  # [S, R, H]: x at buffer[slots[layer]]
    """Pure-jnp oracle of ``record``: x written into its layer's slot, every other slot kept."""
    return jax.lax.dynamic_update_index_in_dim(buffer, x.astype(buffer.dtype), jnp.asarray(slots)[layer], axis=0)


def _rms_norm_kernel(layer_ref, *refs, width: int, rows: int, eps: float, centred: bool, record: bool):
    if record:  # (slots, x, w, buffer (aliased to its output)) -> (o, buffer)
        slots_ref, x_ref, w_ref, _, o_ref, buffer_ref = refs
    else:
        x_ref, w_ref, o_ref = refs
    r = pl.program_id(0)
    c = jnp.arange(next_pow2(width), dtype=jnp.int32)
    ok = None if c.shape[0] == width else c < width
    load = (lambda ref, idx: plgpu.load(ref.at[idx])) if ok is None else (
        lambda ref, idx: plgpu.load(ref.at[idx], mask=ok, other=0))
    x_in = load(x_ref, r * width + c)  # [Hp]
    if record:
        slot = slots_ref[layer_ref[0]]
        plgpu.store(buffer_ref.at[(slot * rows + r) * width + c], x_in.astype(buffer_ref.dtype), mask=ok)
    x = x_in.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(x * x) / width + eps)
    w = load(w_ref, layer_ref[0] * width + c).astype(jnp.float32)
    if centred:
        out = (x * inv) * (1.0 + w)
    else:
        out = w * (x * inv).astype(x_ref.dtype).astype(jnp.float32)
    plgpu.store(o_ref.at[r * width + c], out.astype(o_ref.dtype), mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "centred", "interpret"))
def _rms_norm_call(x, weights, layer, buffer, slots, *, eps: float, centred: bool, interpret: bool):
    R, H = x.shape
    L = weights.shape[0]
    record = buffer is not None
    ins = (layer,) + ((slots,) if record else ()) + (x.reshape(R * H), weights.reshape(L * H))
    out_shape = jax.ShapeDtypeStruct((R * H,), x.dtype if centred else jnp.result_type(weights.dtype, x.dtype))
    out_shapes = (out_shape,)
    if record:
        ins += (buffer.reshape(-1),)
        out_shapes += (jax.ShapeDtypeStruct((buffer.size,), buffer.dtype),)
    out = pl.pallas_call(
        functools.partial(_rms_norm_kernel, width=H, rows=R, eps=eps, centred=centred, record=record),
        grid=(R,),
        in_specs=[whole(a) for a in ins],
        out_specs=tuple(whole(o) for o in out_shapes),
        out_shape=out_shapes,
        input_output_aliases={len(ins) - 1: 1} if record else {},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="rms_norm",
    )(*ins)
    normed = out[0].reshape(R, H)
    return (normed, out[1].reshape(buffer.shape)) if record else normed


def rms_norm_pallas(
    x: jax.Array,  # [R, H]
    weights: jax.Array,  # [L, H] stacked per layer
    layer: jax.Array,  # i32[]
    eps: float,
    *,
    interpret: bool,
    centred: bool = False,
    record: tuple[jax.Array, jax.Array] | None = None,  # (buffer [S, R, H], slots i32[L])
):  # [R, H], or ([R, H], the buffer with x at its layer's slot) when recording
    """Pallas path: RMSNorm of every row of ``x`` with ``weights[layer]`` (module docstring;
    ``centred``: zero-centred weights, Qwen3-Next's arithmetic; ``record``: x also stored, in
    place, at ``buffer[slots[layer]]``)."""
    if x.ndim != 2 or weights.ndim != 2 or weights.shape[1] != x.shape[1]:
        raise ValueError(f"x {x.shape} and stacked weights {weights.shape} must be [R, H] and [L, H]")
    buffer, slots = (None, None) if record is None else record
    if buffer is not None:
        if buffer.ndim != 3 or buffer.shape[1:] != x.shape:
            raise ValueError(f"record buffer {buffer.shape} must be [S, R, H] for rows {x.shape}")
        slots = jnp.asarray(slots, jnp.int32).reshape(-1)
    return _rms_norm_call(x, weights, jnp.asarray(layer, jnp.int32).reshape(1), buffer, slots, eps=float(eps),
                          centred=centred, interpret=interpret)
