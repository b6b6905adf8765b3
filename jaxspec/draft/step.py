"""One speculative step, as pure functions over immutable state and pools.

    draft_propose   S-1 draft forwards -> a verify tree (chain: static shapes, no sort)
    target_verify   one target forward over the n tree nodes
    accept          greedy tree walk (exact)
    compact         accepted KV / outputs to the front (trees only)
    draft_extend    draft over the accepted rows -> seed of the next step (fused gather)
    commit          append emitted tokens, stop checks, advance lengths

Plain decoding (no draft) is the same step with a one-node tree. Glossary: B rows, K topk,
S num_steps, n num_draft_tokens, A = S + 1, V vocab, H target hidden, F target feature width,
Hd draft hidden width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.draft import tree as tree_lib
from jaxspec.draft.compact import compact_pool, gather_to_front
from jaxspec.draft.sampling import pick_tokens, sample_categorical, target_probs, uniforms
from jaxspec.draft.verify import (
    verify_chain_greedy,
    verify_chain_rejection,
    verify_tree_greedy,
    verify_tree_target_only,
)
from jaxspec.engine.state import (
    KEY_COINS,
    KEY_DRAFT_STEP,
    KEY_FINAL,
    KEY_SEED,
    DecodeState,
    Plan,
    row_keys,
    sub_keys,
)
from jaxspec.kvcache.layout import draft_scratch_positions, per_step_draft_locs
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.assistant import assistant_forward
from jaxspec.model.draft import draft_forward, draft_logits, draft_topk
from jaxspec.model.target import target_forward, target_logits
from jaxspec.pallas.gather_extras import gather_spec_extras


def _feature(plan: Plan, out) -> jax.Array | None:
    """The target feature a draft consumes at draft-extend."""
    if plan.draft is None or plan.draft.feature is None:
        return None
    return out.aux if plan.draft.feature == "aux" else out.hidden


def _bcast(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Per-row sampling parameter [B] broadcast to [B, ...]."""
    return jnp.broadcast_to(x.reshape(x.shape + (1,) * (len(shape) - 1)), shape)


def draft_distribution(plan: Plan, dparams: dict, hidden: jax.Array, state_rows) -> jax.Array:
    """q: the draft's sampling distribution over the TARGET vocabulary, [..., V], with each
    row's temperature / top_k / top_p (one-hot argmax for greedy rows).

    ``state_rows`` = (temperature, top_k, top_p), each [B]; hidden is [B, ..., Hd]."""
    logits = draft_logits(plan.draft, dparams, hidden)  # f32[..., Vd]
    V = plan.target.vocab_size
    if "hot_ids" in dparams:  # EAGLE-3 reduced vocabulary: scatter into the target's
        full = jnp.full(logits.shape[:-1] + (V,), -jnp.inf, jnp.float32)
        logits = full.at[..., dparams["hot_ids"]].set(logits)
    lead = logits.shape[:-1]
    temperature, top_k, top_p = (_bcast(x, lead) for x in state_rows)
    return target_probs(logits, temperature, top_k, top_p, plan.filtering)


def draft_seed(plan: Plan, dparams: dict, hidden: jax.Array, state_rows, keys: jax.Array):
    """The next step's first draft level from the draft's output at the last accepted row.

    hidden: [R, Hd]. Returns (topk_p f32[R, K], topk_index i32[R, K], q f32[R, V or 1]).
    Greedy drafting takes the draft's top-k; chain sampling draws one token from q.
    """
    R = hidden.shape[0]
    if plan.draft_samples:
        q = draft_distribution(plan, dparams, hidden, state_rows)  # [R, V]
        x = sample_categorical(q, keys)
        return jnp.take_along_axis(q, x[:, None], axis=1), x[:, None], q
    topk_p, topk_index = draft_topk(plan.draft, dparams, hidden, plan.topk)
    return topk_p, topk_index, jnp.zeros((R, 1), jnp.float32)


def draft_ancestor_mask(
    ancestors: jax.Array,  # i32[B, K, S] branch of each row's ancestor at every step
    step: int,
    num_steps: int,
) -> jax.Array:  # bool[B, K, K*S]: scratch offset j*S + i visible to each row
    """Row k at ``step`` sees scratch offset ``j*S + i`` iff i <= step and its step-i
    ancestor is branch j (exact tree attention for the draft)."""
    B, K, S = ancestors.shape
    branch = jnp.arange(K, dtype=jnp.int32)[:, None]  # j
    level = jnp.arange(S, dtype=jnp.int32)[None, :]  # i
    hit = (ancestors[:, :, None, :] == branch[None, None]) & (level[None, None] <= step)  # [B, K, K, S]
    return hit.reshape(B, K, K * num_steps)


def draft_propose(
    plan: Plan,
    dparams: dict,
    state: DecodeState,
    dpool,
    page_table: jax.Array,  # i32[B, W]
    tpool=None,
) -> tuple[tree_lib.Tree, jax.Array | None, object]:
    """Runs the draft S-1 times from the seed in ``state`` and organizes the verify tree.

    A frozen-KV assistant first runs its seed step (the root token + the target's last
    hidden state) as iteration 0 of the same loop, reading ``tpool`` (S forwards, no writes).

    Returns (tree, q_all f32[B, S, V] for chain sampling else None, dpool)."""
    dcfg, spec = plan.draft, plan.spec
    K, S, n = spec.topk, spec.num_steps, spec.num_draft_tokens
    B = state.bonus.shape[0]
    base = state.seq_lens + dcfg.pos_offset  # [B] first draft-scratch position
    # Branch j, step i writes at base + j*S + i; step i uses row i of the [S, B*K] view.
    scratch = draft_scratch_positions(base, K, S)
    scratch = jnp.where(jnp.repeat(state.active, K * S), scratch, -1)
    write_per_step = per_step_draft_locs(scratch, B, K, S)  # [S, B*K]
    carries_hidden = dcfg.feature is not None

    levels: list[tree_lib.DraftLevel] = []
    keys = row_keys(state) if plan.draft_samples else None
    rows = (state.temperature, state.top_k, state.top_p)

    def forward(ids, rows_hidden, i, attn):  # -> (next hidden [B, R, Hd], logit input, dpool)
        if dcfg.frozen_kv:
            h, y = assistant_forward(
                dparams, dcfg.model, ids, rows_hidden, state.seq_lens, tpool, page_table,
                implementation=plan.implementation,
            )
            return h, y, dpool
        positions = jnp.broadcast_to((base + i)[:, None], ids.shape)
        h, new_pool = draft_forward(
            dcfg, dparams, ids, rows_hidden, positions, dpool, attn,
            from_target=False, implementation=plan.implementation,
        )
        return h, h, new_pool

    if dcfg.frozen_kv:  # seed step = iteration 0: root token + the target's last hidden state
        h0, y0, _ = forward(state.bonus[:, None], state.hidden[:, None], 0, None)
        seed_keys = None if keys is None else sub_keys(keys, KEY_SEED)
        topk_p, topk_index, q0 = draft_seed(plan, dparams, y0[:, 0], rows, seed_keys)
        hidden = h0[:, 0]
    else:
        topk_p, topk_index, hidden, q0 = state.topk_p, state.topk_index, state.hidden, state.draft_q
    q_levels = [q0]  # chain sampling: q_j of each drafted token, [B, V]
    scores = None
    ancestors = jnp.zeros((B, K, S), jnp.int32)
    rows_k = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K))
    for i in range(S):
        ids, rows_hidden, scores, parent_row, level = tree_lib.select_top_k_tokens(
            i, K, topk_p, topk_index, hidden, scores
        )
        levels.append(level)
        if i == S - 1:
            break  # the last level needs no forward
        if i > 0:
            ancestors = jnp.take_along_axis(ancestors, parent_row[:, :, None], axis=1)
        ancestors = ancestors.at[:, :, i].set(rows_k)
        if K == 1:
            mask = jnp.asarray(np.broadcast_to(np.arange(S) <= i, (B, 1, S)))
        else:
            mask = draft_ancestor_mask(ancestors, i, S)
        attn = AttentionInputs.build(
            page_table, base, write_per_step[i].reshape(B, K), plan.page_size, block_mask=mask
        )
        h, y, dpool = forward(ids, rows_hidden, i, attn)
        if plan.draft_samples:  # chain: draw x ~ q from the draft's own distribution
            q = draft_distribution(plan, dparams, y[:, 0], rows)  # [B, V]
            x = sample_categorical(q, sub_keys(keys, KEY_DRAFT_STEP + i))
            q_levels.append(q)
            topk_p = jnp.take_along_axis(q, x[:, None], axis=1)[:, :, None]  # [B, 1, 1]
            topk_index = x[:, None, None]
        else:
            topk_p, topk_index = draft_topk(dcfg, dparams, y, K)  # [B, K, K]
        hidden = h if carries_hidden else rows_hidden
    parent_list, top_index, draft_tokens = tree_lib.organize(levels, K, n)
    q_all = jnp.stack(q_levels, axis=1) if plan.draft_samples else None  # [B, S, V]
    if K == 1:
        return tree_lib.chain_tree(state.bonus, draft_tokens), q_all, dpool
    return tree_lib.build_tree(state.bonus, parent_list, top_index, draft_tokens, K, S), q_all, dpool


def target_verify(plan: Plan, tparams: dict, state: DecodeState, tree, tpool, page_table):
    """One target forward over the tree; KV written at seq_len + i, RoPE at seq_len + depth."""
    n = plan.num_verify
    B = state.bonus.shape[0]
    if tree is None:  # plain decoding: a one-node tree
        tokens = state.bonus[:, None]
        depth = jnp.zeros((B, 1), jnp.int32)
        mask = None
    else:
        tokens, depth = tree.tokens, tree.depth
        mask = None if plan.topk == 1 else tree.mask  # chains verify with a causal block
    node = jnp.arange(n, dtype=jnp.int32)[None, :]
    write = jnp.where(state.active[:, None], state.seq_lens[:, None] + node, -1)
    attn = AttentionInputs.build(page_table, state.seq_lens, write, plan.page_size, block_mask=mask)
    positions = state.seq_lens[:, None] + depth
    out = target_forward(
        plan.target, tparams, tokens, positions, tpool, attn,
        aux_layers=plan.aux_layers, implementation=plan.implementation,
    )
    logits = target_logits(plan.target, tparams, out.hidden)  # f32[B, n, V]
    return logits, _feature(plan, out), out.pool


def accept(plan: Plan, state: DecodeState, tree, logits: jax.Array, q_all=None):
    """(accept_index [B, A], accept_lens [B], predict [B, n]) from the target logits.

    Greedy: exact tree walk. Temperature > 0: chain rejection sampling with the draft's q
    (chains, exact thresholds), else target-only tree sampling (SGLang semantics)."""
    B = state.bonus.shape[0]
    if tree is None:
        predict = pick_tokens(
            logits[:, 0], state.temperature, state.top_k, state.top_p, row_keys(state), plan.greedy_only,
            plan.filtering,
        )[:, None]
        return jnp.zeros((B, 1), jnp.int32), jnp.ones((B,), jnp.int32), predict
    spec = plan.spec
    if plan.greedy_only:
        target_predict = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if plan.topk == 1:
            return verify_chain_greedy(tree.tokens, target_predict)
        return verify_tree_greedy(tree, target_predict, spec.num_steps)
    lead = logits.shape[:-1]
    p = target_probs(
        logits, _bcast(state.temperature, lead), _bcast(state.top_k, lead), _bcast(state.top_p, lead), plan.filtering
    )  # [B, n, V]
    keys = row_keys(state)
    coins = uniforms(sub_keys(keys, KEY_COINS), (plan.num_verify,))  # [B, n]
    coin_final = uniforms(sub_keys(keys, KEY_FINAL))  # [B]
    if plan.draft_samples:
        return verify_chain_rejection(tree.tokens, q_all, p, coins[:, : spec.num_steps], coin_final)
    return verify_tree_target_only(
        tree, p, coins, coin_final, spec.num_steps, spec.accept_threshold_single, spec.accept_threshold_acc
    )


def draft_extend(plan: Plan, dparams: dict, state: DecodeState, predict, feature, accept_lens, dpool, page_table):
    """Draft over the A accepted-front rows; row accept_len - 1 seeds the next step.

    Returns (topk_p [B, K], topk_index [B, K], bonus [B], hidden [B, Hd], draft_q, dpool).
    """
    dcfg, K = plan.draft, plan.topk
    B, A = predict.shape
    select = jnp.arange(B, dtype=jnp.int32) * A + accept_lens - 1
    if dcfg.frozen_kv:  # nothing to extend: keep the root and the target's hidden at it
        bonus = predict.reshape(B * A)[select]
        hidden = feature.reshape(B * A, -1)[select].astype(state.hidden.dtype)
        return state.topk_p, state.topk_index, bonus, hidden, state.draft_q, dpool
    j = jnp.arange(A, dtype=jnp.int32)[None, :]
    base = state.seq_lens + dcfg.pos_offset
    positions = base[:, None] + j
    write = jnp.where(state.active[:, None], positions, -1)
    attn = AttentionInputs.build(page_table, base, write, plan.page_size)
    h, dpool = draft_forward(
        dcfg, dparams, predict, feature, positions, dpool, attn,
        from_target=True, implementation=plan.implementation,
    )
    if plan.draft_samples:  # the seed is drawn from q at the selected row
        h_sel = h.reshape(B * A, -1)[select]  # [B, Hd]
        rows = (state.temperature, state.top_k, state.top_p)
        topk_p, topk_index, q = draft_seed(plan, dparams, h_sel, rows, sub_keys(row_keys(state), KEY_SEED))
        bonus = predict.reshape(B * A)[select]
        hidden = h_sel if dcfg.feature is not None else state.hidden
        return topk_p, topk_index, bonus, hidden.astype(state.hidden.dtype), q, dpool
    topk_p, topk_index = draft_topk(dcfg, dparams, h, K)  # [B, A, K]
    hidden = h.reshape(B * A, -1) if dcfg.feature is not None else None
    topk_p, topk_index, bonus, hidden = gather_spec_extras(
        select, topk_p.reshape(B * A, K), topk_index.reshape(B * A, K), predict.reshape(B * A), hidden,
        implementation=plan.implementation,
    )
    if hidden is None:
        hidden = state.hidden
    return topk_p, topk_index, bonus, hidden.astype(state.hidden.dtype), state.draft_q, dpool


def commit(state: DecodeState, emitted: jax.Array, accept_lens: jax.Array, **updates) -> DecodeState:
    """Appends ``emitted[b, :accept_lens[b]]`` (cut at the first stop token, which is not
    emitted, and at max_new), retires finished rows and applies ``updates`` to active rows."""
    B, A = emitted.shape
    M = state.out_tokens.shape[1]
    active = state.active
    j = jnp.arange(A, dtype=jnp.int32)[None, :]
    within = j < accept_lens[:, None]
    is_stop = jnp.any(emitted[:, :, None] == state.stop_ids[:, None, :], axis=-1) & within
    first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), A)
    room = state.max_new - state.out_lens
    keep = jnp.where(active, jnp.minimum(jnp.minimum(first_stop, accept_lens), room), 0)
    done = (first_stop < accept_lens) | (state.out_lens + keep >= state.max_new)
    col = jnp.where(j < keep[:, None], state.out_lens[:, None] + j, M)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, A))
    out_tokens = state.out_tokens.at[rows, col].set(emitted, mode="drop")
    log_col = jnp.where(active, state.num_verify, M)
    accept_log = state.accept_log.at[jnp.arange(B), log_col].set(accept_lens, mode="drop")
    new = dict(
        out_tokens=out_tokens,
        out_lens=state.out_lens + keep,
        active=active & ~done,
        seq_lens=jnp.where(active, state.seq_lens + accept_lens, state.seq_lens),
        steps=state.steps + active,
        num_verify=state.num_verify + active,
        accept_log=accept_log,
    )
    for name, value in updates.items():
        old = getattr(state, name)
        keep_old = active.reshape((B,) + (1,) * (old.ndim - 1))
        new[name] = jnp.where(keep_old, value.astype(old.dtype), old)
    return dataclasses.replace(state, **new)


def spec_step(plan: Plan, tparams, dparams, state: DecodeState, tpool, dpool, page_table):
    """One draft -> verify -> accept -> compact -> extend -> commit step for every row."""
    tree = q_all = None
    if plan.draft is not None:
        tree, q_all, dpool = draft_propose(plan, dparams, state, dpool, page_table, tpool)
    logits, feature, tpool = target_verify(plan, tparams, state, tree, tpool, page_table)
    accept_index, accept_lens, predict = accept(plan, state, tree, logits, q_all)
    if plan.draft is None:
        return commit(state, predict, accept_lens, bonus=predict[:, 0]), tpool, dpool
    if plan.topk > 1:
        tpool = compact_pool(
            tpool, page_table, state.seq_lens, accept_index, accept_lens, state.active,
            implementation=plan.implementation,
        )
        predict = gather_to_front(predict, accept_index)  # [B, A]
        feature = None if feature is None else gather_to_front(feature, accept_index)
    topk_p, topk_index, bonus, hidden, draft_q, dpool = draft_extend(
        plan, dparams, state, predict, feature, accept_lens, dpool, page_table
    )
    state = commit(
        state, predict, accept_lens, bonus=bonus, topk_p=topk_p, topk_index=topk_index, hidden=hidden,
        draft_q=draft_q,
    )
    return state, tpool, dpool


def prefill(
    plan: Plan,
    tparams: dict,
    dparams,
    state: DecodeState,
    tpool,
    dpool,
    page_table: jax.Array,  # i32[B, W] (rows being admitted already hold their pages)
    rows: jax.Array,  # i32[R] batch rows to fill (>= B: padding)
    tokens: jax.Array,  # i32[R, T] prompts, right-padded; T > every prompt length
    lens: jax.Array,  # i32[R] prompt lengths (0 for padding rows)
    request: dict,  # per-row arrays: max_new i32[R], stop_ids i32[R, NS], temperature, top_k, top_p, keys
):
    """Prefills R new requests into ``rows`` of the batch: target KV for the prompt, the
    first token, and the draft's KV and seed."""
    R, T = tokens.shape
    B = state.bonus.shape[0]
    pt = page_table[jnp.minimum(rows, B - 1)]
    real = lens > 0
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (R, T))
    write = jnp.where(pos < lens[:, None], pos, -1)
    attn = AttentionInputs.build(pt, jnp.zeros((R,), jnp.int32), write, plan.page_size)
    out = target_forward(
        plan.target, tparams, tokens, pos, tpool, attn,
        aux_layers=plan.aux_layers, implementation=plan.implementation,
    )
    tpool = out.pool
    last = jnp.maximum(lens - 1, 0)
    h_last = jnp.take_along_axis(out.hidden, last[:, None, None], axis=1)[:, 0]  # [R, H]
    logits = target_logits(plan.target, tparams, h_last)
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(request["keys"]), jnp.zeros((R,), jnp.int32))
    first = pick_tokens(
        logits, request["temperature"], request["top_k"], request["top_p"], keys, plan.greedy_only, plan.filtering
    )
    r = jnp.arange(R)
    K = plan.topk
    topk_p = jnp.zeros((R, K), jnp.float32)
    topk_index = jnp.zeros((R, K), jnp.int32)
    hidden = jnp.zeros((R,) + state.hidden.shape[1:], state.hidden.dtype)
    draft_q = jnp.zeros((R,) + state.draft_q.shape[1:], jnp.float32)
    if plan.draft is not None and plan.draft.frozen_kv:  # the seed step runs inside the draft loop
        hidden = jnp.take_along_axis(_feature(plan, out), last[:, None, None], axis=1)[:, 0].astype(hidden.dtype)
    elif plan.draft is not None:
        dcfg = plan.draft
        if dcfg.pos_offset == 0:  # row p consumes the token at p + 1
            dtok = jnp.concatenate([tokens[:, 1:], jnp.zeros((R, 1), tokens.dtype)], axis=1)
            dtok = dtok.at[r, last].set(first)
            dwrite, sel = write, last
        else:  # row p consumes the token at p (prompt + first token)
            dtok = tokens.at[r, lens].set(first, mode="drop")
            dwrite, sel = jnp.where(pos <= lens[:, None], pos, -1), lens
        dwrite = jnp.where(real[:, None], dwrite, -1)
        dattn = AttentionInputs.build(pt, jnp.zeros((R,), jnp.int32), dwrite, plan.page_size)
        h, dpool = draft_forward(
            dcfg, dparams, dtok, _feature(plan, out), pos, dpool, dattn,
            from_target=True, implementation=plan.implementation,
        )
        h_sel = jnp.take_along_axis(h, sel[:, None, None], axis=1)[:, 0]  # [R, Hd]
        rows_params = (request["temperature"], request["top_k"], request["top_p"])
        topk_p, topk_index, draft_q = draft_seed(plan, dparams, h_sel, rows_params, sub_keys(keys, KEY_SEED))
        if dcfg.feature is not None:
            hidden = h_sel.astype(state.hidden.dtype)
    stop = jnp.any(first[:, None] == request["stop_ids"], axis=1)
    out_width = state.out_tokens.shape[1]
    row = dict(
        seq_lens=lens,
        bonus=first,
        active=real & ~stop & (request["max_new"] > 1),
        out_tokens=jnp.zeros((R, out_width), jnp.int32).at[:, 0].set(first),
        out_lens=jnp.where(stop, 0, 1).astype(jnp.int32),
        max_new=request["max_new"],
        stop_ids=request["stop_ids"],
        temperature=request["temperature"],
        top_k=request["top_k"],
        top_p=request["top_p"],
        keys=request["keys"],
        steps=jnp.ones((R,), jnp.int32),
        topk_p=topk_p,
        topk_index=topk_index,
        hidden=hidden,
        num_verify=jnp.zeros((R,), jnp.int32),
        accept_log=jnp.zeros((R, out_width), jnp.int32),
        draft_q=draft_q,
    )
    new = {k: getattr(state, k).at[rows].set(v.astype(getattr(state, k).dtype), mode="drop") for k, v in row.items()}
    return dataclasses.replace(state, **new), tpool, dpool
