"""One speculative step at the function level: jit equals eager (one draft-scratch layout,
docs/architecture.md#jitted-and-eager-runs-agree), and tree compaction moves exactly the accepted KV
for every page size (docs/architecture.md#accepted-path-compaction)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.spec import step as step_lib
from jaxspec.spec.compact import compact_pool
from jaxspec.spec.plan import Plan
from jaxspec.spec.proposers import proposer_for
from jaxspec.spec.shape import shape_for
from jaxspec.engine.prefill import prefill
from jaxspec.engine.prefill import request_arrays
from jaxspec.engine.programs import decode_step
from jaxspec.engine.state import DecodeState
from jaxspec.kvcache.paging import positions_to_slots
from jaxspec.model.drafts.base import DraftContext
from jaxspec.model.targets import create_target_pool
from tests.conftest import PROMPTS_4
from tests.spec.test_lossless import drafts


def prefill_args(target, draft, spec, page_size, prompts=PROMPTS_4):
    """(plan, arguments of ``prefill``) for ``prompts`` (4, ragged) in a batch of 4."""
    plan = Plan(target=target.config, draft=draft.config, spec=spec, page_size=page_size)
    B, W = 4, -(-64 // page_size)
    num_pages = B * W + 1
    tpool = create_target_pool(target.config, num_pages=num_pages, page_size=page_size, dtype=jnp.float32)
    d = draft.config
    dpool = d.create_pool(num_pages=num_pages, page_size=page_size, dtype=jnp.float32)
    state = DecodeState.empty(batch=B, out_width=64, num_stop=1, hidden_size=d.hidden_size, hidden_dtype=jnp.float32)
    # A scrambled page table: request pages are not contiguous in the pool.
    perm = np.random.default_rng(page_size).permutation(np.arange(1, num_pages)).astype(np.int32)
    table = jnp.asarray(perm.reshape(B, W))
    T = 16
    tokens = np.zeros((B, T), np.int32)
    lens = np.zeros(B, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
        lens[i] = len(p)
    req = request_arrays(B, max_new=60)
    return plan, (target.params, draft.params, state, tpool, dpool, table, jnp.arange(B, dtype=jnp.int32),
                  jnp.asarray(tokens), jnp.asarray(lens), req)


def prepared(target, draft, spec, page_size, prompts=PROMPTS_4):
    """State and pools right after prefilling ``prompts`` (4, ragged) into a batch of 4."""
    plan, args = prefill_args(target, draft, spec, page_size, prompts)
    state, tpool, dpool = jax.jit(prefill, static_argnums=0)(plan, *args)
    return plan, state, tpool, dpool, args[5]


@functools.partial(jax.jit, static_argnums=0)
def verify_only(plan, tparams, dparams, state, tpool, dpool, table):
    """Draft -> verify -> accept of one step, without committing: (accept_index, accept_lens,
    the target pool with the verify KV written)."""
    rows = state.step_rows()
    tree, q_all, _, _ = proposer_for(plan).propose(plan, dparams, rows, dpool, DraftContext(table, rows.seq_lens, tpool))
    logits, _, tpool = step_lib.target_verify(plan, tparams, rows, tree, tpool, table)
    accept_index, accept_lens, _ = shape_for(plan).accept(plan, rows, tree, logits, q_all)
    return accept_index, accept_lens, tpool


@pytest.mark.parametrize("spec", [js.SpecConfig.chain(3), js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)],
                         ids=["chain", "tree"])
def test_step_jit_equals_eager(tiny_target, spec):
    draft = drafts(tiny_target)["eagle3"]
    plan, state, tpool, dpool, table = prepared(tiny_target, draft, spec, page_size=4)
    run = functools.partial(decode_step, plan)
    jitted = jax.jit(run)(tiny_target.params, draft.params, state, tpool, dpool, table)
    with jax.disable_jit():
        eager = run(tiny_target.params, draft.params, state, tpool, dpool, table)
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    # Integer state (tokens, lengths, accept logs) must agree exactly.
    for name in ("seq_lens", "bonus", "out_tokens", "out_lens", "accept_log"):
        np.testing.assert_array_equal(np.asarray(getattr(jitted[0], name)), np.asarray(getattr(eager[0], name)), name)


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_tree_compaction_moves_the_accepted_path(tiny_target, page_size):
    """Run draft -> verify -> accept on a partially-accepting draft, then check that after
    compaction position seq_len + j holds what position seq_len + a_j held, for every layer,
    K and V, and that nothing else in the pool changed."""
    spec = js.SpecConfig(num_steps=4, topk=4, num_draft_tokens=12)
    draft = drafts(tiny_target)["perturbed"]
    plan, state, tpool, dpool, table = prepared(tiny_target, draft, spec, page_size)
    moved_somewhere = False
    for _ in range(4):  # a few steps so scattered accepts show up
        accept_index, accept_lens, verified = verify_only(plan, tiny_target.params, draft.params, state, tpool, dpool,
                                                          table)
        before_k, before_v = np.asarray(verified.k), np.asarray(verified.v)
        after = compact_pool(verified, table, state.seq_lens, accept_index, accept_lens, state.active)
        ak, av = np.asarray(after.k), np.asarray(after.v)
        touched = set()
        for b in range(4):
            s = int(state.seq_lens[b])
            for j in range(int(accept_lens[b])):
                a = int(accept_index[b, j])
                assert a >= j
                moved_somewhere |= a != j
                src = int(positions_to_slots(table[b:b + 1], jnp.asarray([[s + a]]), page_size)[0, 0])
                dst = int(positions_to_slots(table[b:b + 1], jnp.asarray([[s + j]]), page_size)[0, 0])
                np.testing.assert_array_equal(ak[:, dst], before_k[:, src])
                np.testing.assert_array_equal(av[:, dst], before_v[:, src])
                touched.add(dst)
        untouched = np.setdiff1d(np.arange(ak.shape[1]), list(touched))
        np.testing.assert_array_equal(ak[:, untouched], before_k[:, untouched])
        np.testing.assert_array_equal(av[:, untouched], before_v[:, untouched])
        # Continue from the real step so later iterations see fresh trees.
        state, tpool, dpool = jax.jit(decode_step, static_argnums=0)(
            plan, tiny_target.params, draft.params, state, tpool, dpool, table)
        assert bool(state.active.all())
    assert moved_somewhere, "the perturbed draft never accepted a non-prefix path"
