"""Admitting requests: the target's prefill forward over the prompts, the first token, and the
draft's prefill (its KV and seed), written into free rows of the decode state.

A preempted request is resumed the same way: its "prompt" is the original prompt plus the tokens it
had generated but the last (``prompt_lens`` marks where the prompt ends), and its first token is
forced to that last token (``first``), so the row continues exactly where it stopped: the output
so far in ``out_tokens``, the controls' output counts rebuilt from it, its PRNG position (``steps``).

Glossary: R rows being admitted (a power-of-two bucket), T prompt bucket (> every prompt),
B batch rows, NS stop ids per row, M output width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.spec.plan import Plan
from jaxspec.spec.proposers import proposer_for
from jaxspec.engine.state import DecodeState
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.sampling.controls import Controls, apply_controls, token_logprobs
from jaxspec.model.drafts.base import DraftContext
from jaxspec.sampling.grammar_masks import FREE, Grammar
from jaxspec.sampling.distributions import RowSampling, pick_tokens
from jaxspec.model.targets import target_forward, target_logits


def request_arrays(rows: int, *, max_new: int = 0, num_stop: int = 1, control_vocab: int = 0) -> dict[str, np.ndarray]:
    """The per-row request parameters ``prefill`` takes, for ``rows`` rows, every control at its
    default (greedy, no stop id, no penalty): the caller fills in what differs. ``control_vocab``:
    the logit bias's width (0 when the plan has no controls)."""
    R = rows
    return dict(
        max_new=np.full(R, max_new, np.int32), stop_ids=np.full((R, num_stop), -1, np.int32),
        sampling=RowSampling.host((), R), keys=np.zeros((R, 2), np.uint32),
        repetition_penalty=np.ones(R, np.float32), presence_penalty=np.zeros(R, np.float32),
        frequency_penalty=np.zeros(R, np.float32), logit_bias=np.zeros((R, control_vocab), np.float32),
        prompt_lens=np.full(R, np.iinfo(np.int32).max, np.int32), first=np.full(R, -1, np.int32), steps=np.ones(R, np.int32),
        grammar=np.full(R, FREE, np.int32),
    )


def prefill(
    plan: Plan,
    tparams: dict,
    dparams,
    state: DecodeState,
    tpool,
    dpool,
    page_table,  # i32[B, W] or PageTables (rows being admitted already hold their pages)
    rows: jax.Array,  # i32[R] batch rows to fill (>= B: padding)
    tokens: jax.Array,  # i32[R, T] prompts, right-padded
    lens: jax.Array,  # i32[R] prompt lengths (0 for padding rows)
    request: dict,  # per-row arrays: max_new i32[R], stop_ids i32[R, NS], sampling (``RowSampling``, [R] each),
    #                 repetition / presence / frequency_penalty, logit_bias f32[R, V] (V = 0: controls off), keys u32[R, 2];
    #                 resuming: prompt_lens i32[R] (tokens past it were generated; default: none), first i32[R] (>= 0:
    #                 the forced first token), steps i32[R] (PRNG draws so far, 1 for a new request);
    #                 grammar i32[R] the structured-output automaton state before the first token (FREE: none);
    #                 prefix caching: start i32[R] (positions already in the pools' cached pages) and suffix
    #                 i32[R, Ts] (tokens from position start on; absent: start 0, suffix = tokens)
):
    """Prefills R new (or resumed) requests into ``rows`` of the batch; returns (state, tpool, dpool)."""
    R, T = tokens.shape
    B = state.bonus.shape[0]
    pt = jax.tree.map(lambda table: table[jnp.minimum(rows, B - 1)], page_table)  # every table's rows
    real = lens > 0
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (R, T))
    start = request.get("start", jnp.zeros((R,), jnp.int32))  # cached prefix: only the suffix is computed
    suffix = request.get("suffix", tokens)  # [R, Ts]
    Ts = suffix.shape[1]
    new_lens = jnp.where(real, lens - start, 0)
    new_pos = start[:, None] + jnp.arange(Ts, dtype=jnp.int32)[None, :]
    write = jnp.where(jnp.arange(Ts)[None, :] < new_lens[:, None], new_pos, -1)
    attn = AttentionInputs.build(pt, start, write, plan.page_size, state_rows=rows)
    out = target_forward(plan.target, tparams, suffix, new_pos, tpool, attn, aux_layers=plan.aux_layers,
                         implementation=plan.implementation, exact=plan.exact)
    tpool = out.pool
    last = jnp.maximum(new_lens - 1, 0)
    h_last = jnp.take_along_axis(out.hidden, last[:, None, None], axis=1)[:, 0]  # [R, H]
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(request["keys"]), jnp.zeros((R,), jnp.int32))
    logits = target_logits(plan.target, tparams, h_last, exact=plan.exact)  # [R, V]
    prompt_lens = jnp.minimum(request["prompt_lens"], lens)
    generated = (pos >= prompt_lens[:, None]) & (pos < lens[:, None])  # [R, T] resumed rows' earlier output
    controls = Controls.for_prompts(tokens, prompt_lens, request, request["logit_bias"].shape[-1])
    controls = controls.count(tokens, generated)
    grammar = Grammar(table=state.grammar_table, state=request["grammar"], stop_ids=request["stop_ids"])
    masked = grammar.mask(logits, grammar.state)  # the grammar first, then the controls (vLLM's order)
    processed = apply_controls(masked[:, None], controls, None, None)[:, 0]
    first = pick_tokens(processed, request["sampling"], keys, plan.greedy_only, plan.filtering)
    first = jnp.where(request["first"] >= 0, request["first"], first)
    done = lens - prompt_lens  # tokens generated before this prefill (all but the forced first)
    empty = jax.tree.map(lambda x: jnp.zeros((R,) + x.shape[1:], x.dtype), state.seed)
    ctx = DraftContext(pt, start, tpool, state_rows=rows, context=(tokens, lens))
    seed, dpool = proposer_for(plan).prefill(plan, dparams, suffix, new_lens, first, out, dpool, ctx, empty)
    after_first = grammar.advance(grammar.state, first)
    # A stop token, or a language that allows nothing at all (only the empty string): nothing is emitted.
    stop_token = jnp.any(first[:, None] == request["stop_ids"], axis=1)
    stop = stop_token | grammar.terminal(grammar.state)
    out_width = state.out_tokens.shape[1]
    logprobs = jax.tree.map(lambda x: jnp.zeros((R,) + x.shape[1:], x.dtype), state.logprobs)
    r_idx = jnp.arange(R)[:, None]
    if plan.logprobs is not None:  # the first token's, in its column (the earlier ones' are the host's)
        first_lp = token_logprobs(masked[:, None], first[:, None], plan.logprobs, exact=plan.exact)
        logprobs = jax.tree.map(lambda buf, new: buf.at[r_idx, done[:, None]].set(new, mode="drop"), logprobs,
                                first_lp)
    out_cols = jnp.where(generated, pos - prompt_lens[:, None], out_width)  # earlier output, from column 0
    out_tokens = jnp.zeros((R, out_width), jnp.int32).at[jnp.broadcast_to(r_idx, (R, T)), out_cols].set(
        tokens, mode="drop")
    out_tokens = out_tokens.at[r_idx[:, 0], done].set(first, mode="drop")
    row = dict(
        seq_lens=lens,
        bonus=first,
        active=real & ~stop & (request["max_new"] > done + 1) & ~grammar.terminal(after_first),
        out_tokens=out_tokens,
        out_lens=jnp.where(stop, done, done + 1).astype(jnp.int32),
        stop_token=jnp.where(stop_token, first, -1).astype(jnp.int32),
        max_new=request["max_new"],
        stop_ids=request["stop_ids"],
        sampling=request["sampling"],
        controls=controls.count(first[:, None], (~stop)[:, None]),
        logprobs=logprobs,
        keys=request["keys"],
        steps=request["steps"],
        num_verify=jnp.zeros((R,), jnp.int32),
        accept_log=jnp.zeros((R, out_width), jnp.int32),
        verify_log=jnp.zeros((R, out_width), jnp.int32),
        seed=seed,
        grammar=jnp.where(stop, grammar.state, after_first),
    )
    put = lambda old, new: old.at[rows].set(new.astype(old.dtype), mode="drop")  # noqa: E731
    return dataclasses.replace(state, **jax.tree.map(put, {k: getattr(state, k) for k in row}, row)), tpool, dpool
