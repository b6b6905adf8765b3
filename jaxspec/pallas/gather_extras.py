"""Fused gather of the speculative "extras" by one index vector (seed 002).

After draft-extend, each request's next draft seed lives in row ``accept_len - 1`` of its
block: ``topk_p``, ``topk_index``, the next token and (for feature-level drafts) the hidden
state. One op gathers all four with a single index vector instead of four gathers.
"""

from __future__ import annotations

import jax

from jaxspec.pallas import dispatch


def gather_spec_extras_reference(
    index: jax.Array,  # i32[R] rows to take
    topk_p: jax.Array,  # f32[N, K]
    topk_index: jax.Array,  # i32[N, K]
    tokens: jax.Array,  # i32[N]
    hidden: jax.Array | None,  # [N, Hd] | None
):  # -> (f32[R, K], i32[R, K], i32[R], [R, Hd] | None)
    take = lambda x: None if x is None else x[index]  # noqa: E731
    return take(topk_p), take(topk_index), take(tokens), take(hidden)


def gather_spec_extras_pallas(index, topk_p, topk_index, tokens, hidden, *, interpret):
    # TODO(kernels issue): Pallas Triton kernel.
    raise NotImplementedError("the Pallas fused-gather kernel is not written yet")


def gather_spec_extras(index, topk_p, topk_index, tokens, hidden=None, *, implementation=None):
    """Rows ``index`` of (topk_p, topk_index, tokens, hidden); ``hidden`` may be None."""
    if dispatch.resolve(implementation) == "pallas":
        return gather_spec_extras_pallas(index, topk_p, topk_index, tokens, hidden, interpret=dispatch.interpret_mode())
    return gather_spec_extras_reference(index, topk_p, topk_index, tokens, hidden)
