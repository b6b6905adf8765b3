"""DeepSeek-V3.2 sparse attention against HF ``DeepseekV32ForCausalLM`` (goldens from
``scripts/goldens/deepseek_v32.py``: index_topk 8, contexts up to 64 positions, a margin between every
sparse row's k-th and (k+1)-th index score): prefill logits, logits of one-token decode steps,
greedy tokens through ``generate`` on a ragged batch, the MTP layer with its own indexer, and
that the output differs from dense attention's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.targets import forward_sequence, target_logits
from jaxspec.model.targets.deepseek import create_mla_pool, deepseek_forward
from tests.conftest import engine
from tests.model.golden import arrays, case_dir, cases
from tests.model.targets.test_golden_deepseek import check_mtp_head

V32 = [c for c in cases("target") if c["model_type"] == "deepseek_v32"]
PAGE = {"deepseek_v32_dense": 1, "deepseek_v32_moe": 16}  # each case runs generate at one page size


@functools.cache
def load(name):
    case = next(c for c in V32 if c["name"] == name)
    return case, js.load_model(case_dir(case), dtype="float32", progress=False), arrays(case)


@functools.partial(jax.jit, static_argnums=0)
def decode_one(cfg, params, pool, token, pos):  # i32[1, 1] at i32[1, 1] -> (f32[1, V], pool)
    W = 64
    attn = AttentionInputs.build(jnp.arange(1, W + 1, dtype=jnp.int32)[None], pos[:, 0], pos, 1)
    out = deepseek_forward(params, cfg, token, pos, pool, attn)
    return target_logits(cfg, params, out.hidden)[:, 0], out.pool


def test_the_cases_are_sparse():
    assert sorted(PAGE) == sorted(c["name"] for c in V32)
    for c in V32:
        assert c["index"]["index_topk"] == 8 and c["index"]["min_index_margin"] > 0
        assert max(len(p) for p in c["prompts"]) + c["greedy_new_tokens"] > 4 * c["index"]["index_topk"]


def test_sparse_prefill_with_the_kernels_matches_hf():
    """The indexer-score and sparse-MLA Pallas kernels (interpret mode) inside the model: a causal
    prefill beyond ``index_topk`` matches HF's logits, as the XLA path does."""
    case, model, ref = load("deepseek_v32_dense")
    kernels = {"dsa_indexer": "pallas", "mla_sparse_attention": "pallas"}
    i = max(range(len(case["prompts"])), key=lambda j: len(case["prompts"][j]))
    assert len(case["prompts"][i]) > 2 * model.config.index_topk
    logits, _, _ = forward_sequence(model, np.asarray([case["prompts"][i]]), implementation=kernels)
    np.testing.assert_allclose(np.asarray(logits[0]), ref[f"logits_{i}"], atol=case["atol"], rtol=case["rtol"])


@pytest.mark.parametrize("name", sorted(PAGE))
def test_sparse_attention_matches_hf(name):
    case, model, ref = load(name)
    cfg, tol = model.config, dict(atol=case["atol"], rtol=case["rtol"])
    assert cfg.has_indexer and cfg.index_topk == 8
    n = case["greedy_new_tokens"]
    for i, prompt in enumerate(case["prompts"]):
        logits, hidden, _ = forward_sequence(model, np.asarray([prompt]))  # prefill
        np.testing.assert_allclose(np.asarray(logits[0]), ref[f"logits_{i}"], **tol)
        np.testing.assert_allclose(np.asarray(hidden[0]), ref[f"hidden_final_{i}"], **tol)
    # Decode: one token at a time (every row is a decode row selecting among all cached positions).
    prompt, greedy = case["prompts"][0], ref["greedy_0"].tolist()
    seq = prompt + greedy[:-1]
    pool = create_mla_pool(cfg, num_pages=65, page_size=1, dtype=jnp.float32)
    steps = []
    for p, tok in enumerate(seq):
        logit, pool = decode_one(cfg, model.params, pool, jnp.array([[tok]], jnp.int32), jnp.array([[p]], jnp.int32))
        steps.append(np.asarray(logit[0]))
    steps = np.stack(steps)  # [len(seq), V]
    np.testing.assert_allclose(steps[: len(prompt)], ref["logits_0"], **tol)
    np.testing.assert_allclose(steps[len(prompt) - 1:], ref["decode_logits_0"], **tol)
    # HF's dense logits (top-k off) are far from ours: sparsity is active and matters.
    dense = ref["dense_logits_0"][len(prompt) - 1: len(prompt) - 1 + n]
    assert np.abs(steps[len(prompt) - 1:] - dense).max() > 100 * case["atol"]
    # Greedy tokens through the engine: ragged batch of 3, prefill + decode, contexts beyond index_topk.
    out = js.generate(model, case["prompts"], sampling=js.SamplingParams(max_new_tokens=n, stop_token_ids=()),
                      engine=engine(PAGE[name], 4, max_seq_len=64))
    for i in range(len(case["prompts"])):
        assert out.token_ids[i] == ref[f"greedy_{i}"].tolist(), f"prompt {i}"
    # The MTP layer's block with its own indexer (HF DeepseekV32DecoderLayer), sparse over T > 8 rows.
    check_mtp_head(case, model, ref)
