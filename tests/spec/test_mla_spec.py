"""Speculative decoding on MLA targets: MTP drafting (chain and tree) is lossless against HF's
greedy tokens; MLA latent rows and DSA indexer keys follow the accepted path under tree
drafting; the jitted and eager steps agree on the MLA path (one draft-scratch layout)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.engine.programs import decode_step
from jaxspec.kvcache.paging import AttentionInputs, positions_to_slots
from jaxspec.model.targets.deepseek import create_mla_pool, deepseek_forward
from jaxspec.model.drafts import standalone_draft
from jaxspec.model.targets import Model
from tests.conftest import engine
from tests.spec.test_step import prepared, verify_only
from tests.model.golden import arrays, case_dir, cases
from tests.model.targets.test_golden_deepseek import v32_model


# Ragged prompts for the function-level step tests (shared with the Triton lowering tests).
DSA_PROMPTS = [[5, 9, 1, 33, 7, 2, 8], [60, 3, 14], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [40]]


def step_prompts(case):
    """Four ragged prompts cut from a golden case's prompts."""
    return [p[:6] for p in case["prompts"]] + [case["prompts"][0][:2]]


@functools.cache
def golden(name):
    case = next(c for c in cases("target") if c["name"] == name)
    target = js.load_model(case_dir(case), dtype="float32")
    return case, target, js.load_draft(case_dir(case), target), arrays(case)


@pytest.mark.parametrize("name,spec,page,implementation", [
    ("deepseek_v3_dense", js.SpecConfig.chain(3), 1, None),
    ("deepseek_v3_dense", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=4), 16, None),
    ("deepseek_v3_moe", js.SpecConfig.chain(2), 16, None),
    ("deepseek_v3_moe", js.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4), 1, None),
    # the routed experts of the target and of its MTP layer through the grouped-matmul kernel
    ("deepseek_v3_moe", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 16, {"grouped_matmul": "pallas"}),
], ids=["dense-chain3-page1", "dense-tree-page16", "moe-chain2-page16", "moe-tree-page1", "moe-tree-page16-grouped-kernel"])
def test_mtp_drafting_is_lossless(name, spec, page, implementation):
    case, target, draft, ref = golden(name)
    assert draft.kind == "mtp"
    out = js.generate(target, case["prompts"], draft=draft, spec=spec,
                      sampling=js.SamplingParams(max_new_tokens=case["greedy_new_tokens"], stop_token_ids=()),
                      engine=engine(page, 4, max_seq_len=64, implementation=implementation))
    for i in range(len(case["prompts"])):
        assert out.token_ids[i] == ref[f"greedy_{i}"].tolist()
    assert out.kv_pages_free == out.kv_pages_total


@pytest.mark.parametrize("spec", [js.SpecConfig.chain(2), js.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4)],
                         ids=["chain", "tree"])
def test_mtp_step_jit_equals_eager(spec):
    case, target, draft, _ = golden("deepseek_v3_dense")
    prompts = step_prompts(case)
    plan, state, tpool, dpool, table = prepared(target, draft, spec, page_size=4, prompts=prompts)
    run = functools.partial(decode_step, plan)
    jitted = jax.jit(run)(target.params, draft.params, state, tpool, dpool, table)
    with jax.disable_jit():
        eager = run(target.params, draft.params, state, tpool, dpool, table)
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    for name in ("seq_lens", "bonus", "out_tokens", "out_lens", "accept_log"):
        np.testing.assert_array_equal(np.asarray(getattr(jitted[0], name)), np.asarray(getattr(eager[0], name)), name)


@functools.cache
def dsa_pair():
    cfg, params = v32_model()
    target = Model(config=cfg, params=params, dtype=np.dtype(np.float32))
    keys = iter(np.asarray(jax.random.split(jax.random.PRNGKey(11), 256)))  # numpy: iterating a jax.Array compiles
    noisy = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(next(keys), x.shape, x.dtype)
                         if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    return target, standalone_draft(Model(config=cfg, params=noisy, dtype=np.dtype(np.float32)))


@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_and_indexer_rows_follow_the_accepted_path(page_size):
    """Tree steps on a V3.2-style target (MLA latent + indexer keys) with a partially
    accepting draft: afterwards every committed position's latent row and index key equal
    those of a one-shot forward over the committed tokens."""
    target, draft = dsa_pair()
    cfg = target.config
    spec = js.SpecConfig(num_steps=3, topk=3, num_draft_tokens=8)
    prompts = DSA_PROMPTS
    plan, state, tpool, dpool, table = prepared(target, draft, spec, page_size, prompts=prompts)
    scattered = False
    step = jax.jit(decode_step, static_argnums=0)
    for _ in range(4):
        accept_index, accept_lens, _ = verify_only(plan, target.params, draft.params, state, tpool, dpool, table)
        j = np.arange(accept_index.shape[1])
        scattered |= bool(np.any((np.asarray(accept_index) > j) & (j < np.asarray(accept_lens)[:, None])))
        state, tpool, dpool = step(plan, target.params, draft.params, state, tpool, dpool, table)
    assert scattered, "no step accepted a non-prefix path: compaction was not exercised"
    lens = np.asarray(state.seq_lens)
    out = np.asarray(state.out_tokens)
    committed = [p + out[b, : lens[b] - len(p)].tolist() for b, p in enumerate(prompts)]  # KV is final
    T = int(lens.max())
    tokens = np.zeros((4, T), np.int32)
    for b, c in enumerate(committed):
        tokens[b, : len(c)] = c
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (4, T))
    write = jnp.asarray(np.where(pos < lens[:, None], pos, -1))
    one_pool = jax.jit(lambda tok: deepseek_forward(
        target.params, cfg, tok, jnp.asarray(pos), create_mla_pool(cfg, num_pages=5, page_size=T, dtype=jnp.float32),
        AttentionInputs.build(jnp.arange(1, 5, dtype=jnp.int32)[:, None], jnp.zeros(4, jnp.int32), write, T),
    ).pool)(jnp.asarray(tokens))
    for b in range(4):
        n = int(lens[b])
        slots = np.asarray(positions_to_slots(table[b:b + 1], jnp.arange(n, dtype=jnp.int32)[None], page_size))[0]
        ref = slice((b + 1) * T, (b + 1) * T + n)
        np.testing.assert_allclose(np.asarray(tpool.kv)[:, slots], np.asarray(one_pool.kv)[:, ref], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(tpool.index_k)[:, slots], np.asarray(one_pool.index_k)[:, ref],
                                   atol=1e-4, rtol=1e-4)
