"""Device-side decoding state, carried across steps and host round trips, and ``commit``.

Glossary: B batch rows (a power-of-two bucket), M output-buffer width, NS stop ids per row,
A tokens a step may emit (num_steps + 1), Hd draft hidden width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.spec.plan import StepRows
from jaxspec.spec.step import StepOutput
from jaxspec.sampling.controls import Controls, TokenLogprobs
from jaxspec.sampling.distributions import RowSampling
from jaxspec.model.drafts.base import DraftSeed
from jaxspec.sampling.grammar_masks import FREE, Grammar, GrammarTable, path_states


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Per-row state.

    Attributes:
      seq_lens: i32[B] committed KV positions (the root token is not yet in the KV).
      bonus: i32[B] root of the next step = last emitted token.
      active: bool[B] row is generating.
      out_tokens: i32[B, M] emitted tokens; out_lens: i32[B] how many.
      stop_token: i32[B] the stop token that ended the row (-1: none, e.g. it ran to max_new).
      max_new: i32[B] per-request token limit.
      stop_ids: i32[B, NS] stop tokens (-1 padded).
      sampling: each row's sampling settings (``RowSampling``, every field [B]).
      controls: logit bias, penalties and the output-token counts they read (``Controls``;
        [B, 0] arrays when no request uses them).
      keys: u32[B, 2] per-request PRNG key data; steps: i32[B] draws so far (fold_in counter).
      num_verify: i32[B] verify steps run; accept_log: i32[B, M] accept length of each;
        verify_log: i32[B, M] nodes each verified for the row (root included; a row capped by a
        confidence head counts its own).
      logprobs: raw log-probabilities of the emitted tokens, ``TokenLogprobs`` with chosen
        f32[B, M] and top ids / values [B, M, k] beside ``out_tokens`` (M = 0 when no request
        asks for them).
      grammar: i32[B] each row's structured-output automaton state after its last emitted token
        (``FREE`` for unconstrained rows); grammar_table: the automata of the call, shared by every
        row (not split by rows on a mesh; [0, 1] when no request is constrained).
      seed: the draft's seed for the next step (its kind's pytree, every leaf [B, ...]; a
        ``DraftSeed`` with hidden [B, Hd] for the recurrent drafts).
    """

    seq_lens: jax.Array
    bonus: jax.Array
    active: jax.Array
    out_tokens: jax.Array
    out_lens: jax.Array
    stop_token: jax.Array
    max_new: jax.Array
    stop_ids: jax.Array
    sampling: RowSampling
    controls: Controls
    keys: jax.Array
    steps: jax.Array
    num_verify: jax.Array
    accept_log: jax.Array
    verify_log: jax.Array
    logprobs: TokenLogprobs
    seed: DraftSeed
    grammar: jax.Array
    grammar_table: GrammarTable

    @classmethod
    def empty(cls, *, batch: int, out_width: int, num_stop: int, seed=None, hidden_size: int = 1,
              hidden_dtype=jnp.float32, control_vocab: int = 0, top_logprobs: int | None = None,
              grammar_table: GrammarTable | None = None):
        """Zeroed state for ``batch`` rows; ``seed`` is the draft's empty seed (default: a
        ``DraftSeed`` of width ``hidden_size``). ``control_vocab``: the vocabulary the controls
        cover (0: none in use); ``top_logprobs``: top log-probabilities kept per token (None:
        log-probabilities off); ``grammar_table``: the call's automata (None: no request is
        constrained)."""
        B = batch
        M_lp = out_width if top_logprobs is not None else 0
        k = top_logprobs or 0
        zeros_i = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
        return cls(
            seq_lens=zeros_i(B),
            bonus=zeros_i(B),
            active=jnp.zeros((B,), bool),
            out_tokens=zeros_i(B, out_width),
            out_lens=zeros_i(B),
            stop_token=jnp.full((B,), -1, jnp.int32),
            max_new=zeros_i(B),
            stop_ids=jnp.full((B, num_stop), -1, jnp.int32),
            sampling=RowSampling.empty(B),
            controls=Controls.empty(B, control_vocab),
            keys=jnp.zeros((B, 2), jnp.uint32),
            steps=zeros_i(B),
            num_verify=zeros_i(B),
            accept_log=zeros_i(B, out_width),
            verify_log=zeros_i(B, out_width),
            logprobs=TokenLogprobs(chosen=jnp.zeros((B, M_lp), jnp.float32), top_ids=zeros_i(B, M_lp, k),
                                   top=jnp.zeros((B, M_lp, k), jnp.float32)),
            seed=DraftSeed.empty(B, hidden_size, hidden_dtype) if seed is None else seed,
            grammar=jnp.full((B,), FREE, jnp.int32),
            grammar_table=GrammarTable.empty() if grammar_table is None else grammar_table,
        )

    def specs(self, rows_axis):
        """PartitionSpecs: every per-row array split over ``rows_axis``, the grammar table whole."""
        from jax.sharding import PartitionSpec as P

        row = jax.tree.map(lambda _: P(rows_axis), dataclasses.replace(self, grammar_table=None))
        return dataclasses.replace(row, grammar_table=jax.tree.map(lambda _: P(), self.grammar_table))

    def step_rows(self) -> StepRows:
        """What one speculative step reads, with this step's PRNG key per row:
        fold_in(request key, steps so far)."""
        keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(self.keys), self.steps)
        return StepRows(seq_lens=self.seq_lens, bonus=self.bonus, active=self.active, sampling=self.sampling,
                        controls=self.controls, keys=keys, seed=self.seed, grammar=self.constraint())

    def constraint(self) -> Grammar:
        """The rows' structured-output automata (their states, the call's table, their stop ids)."""
        return Grammar(table=self.grammar_table, state=self.grammar, stop_ids=self.stop_ids)


def commit(state: DecodeState, out: StepOutput) -> DecodeState:
    """Appends ``out.emitted[b, :accept_lens[b]]`` (cut at the first stop token, which is not
    emitted, at max_new, and after a token that completes a structured-output match the language
    cannot extend), retires finished rows, advances their automata, and takes the next bonus and
    seed for rows that were active."""
    emitted, accept_lens = out.emitted, out.accept_lens
    B, A = emitted.shape
    M = state.out_tokens.shape[1]
    active = state.active
    j = jnp.arange(A, dtype=jnp.int32)[None, :]
    within = j < accept_lens[:, None]
    is_stop = jnp.any(emitted[:, :, None] == state.stop_ids[:, None, :], axis=-1) & within
    first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), A)
    room = state.max_new - state.out_lens
    grammar = state.constraint()
    path = path_states(grammar, emitted)  # [B, A] each emitted token's automaton state
    ends = grammar.terminal(path) & within  # a complete match nothing may extend: the request ends there
    through_end = jnp.where(jnp.any(ends, axis=1), jnp.argmax(ends, axis=1) + 1, A + 1)
    keep = jnp.where(active, jnp.minimum(jnp.minimum(jnp.minimum(first_stop, accept_lens), room), through_end), 0)
    done = (first_stop < accept_lens) | (state.out_lens + keep >= state.max_new) | (through_end <= keep)
    # A stop token came before the length cap (and before a complete match ended the request).
    stopped = active & (first_stop < jnp.minimum(jnp.minimum(accept_lens, room), through_end))
    stop_token = jnp.take_along_axis(emitted, jnp.minimum(first_stop, A - 1)[:, None], axis=1)[:, 0]
    col = jnp.where(j < keep[:, None], state.out_lens[:, None] + j, M)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, A))
    log_col = jnp.where(active, state.num_verify, M)

    def if_active(new, old):
        keep_old = active.reshape((B,) + (1,) * (old.ndim - 1))
        return jnp.where(keep_old, new.astype(old.dtype), old)

    logprobs = state.logprobs
    if out.logprobs is not None:  # beside out_tokens, in the same columns
        logprobs = jax.tree.map(lambda buf, new: buf.at[rows, col].set(new, mode="drop"), logprobs, out.logprobs)
    return dataclasses.replace(
        state,
        out_tokens=state.out_tokens.at[rows, col].set(emitted, mode="drop"),
        out_lens=state.out_lens + keep,
        stop_token=jnp.where(stopped, stop_token, state.stop_token),
        controls=state.controls.count(emitted, j < keep[:, None]),
        logprobs=logprobs,
        active=active & ~done,
        seq_lens=jnp.where(active, state.seq_lens + accept_lens, state.seq_lens),
        steps=state.steps + active,
        num_verify=state.num_verify + active,
        accept_log=state.accept_log.at[jnp.arange(B), log_col].set(accept_lens, mode="drop"),
        verify_log=state.verify_log.at[jnp.arange(B), log_col].set(out.verified, mode="drop"),
        bonus=if_active(out.bonus, state.bonus),
        seed=jax.tree.map(if_active, out.seed, state.seed),
        grammar=jnp.where(keep > 0, jnp.take_along_axis(path, jnp.maximum(keep - 1, 0)[:, None], axis=1)[:, 0],
                          state.grammar),
    )
