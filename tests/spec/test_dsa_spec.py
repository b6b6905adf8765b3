"""Speculative decoding under DeepSeek-V3.2 sparse attention (DSA): MTP drafting (chain and tree)
with an MTP layer carrying its own indexer is lossless against plain greedy decoding of the same
target, at page sizes 1 and 16, on a ragged batch whose contexts reach far beyond ``index_topk``
(target verify rows, draft rows and prefill all select their positions). A random MTP layer is
rarely accepted, so a tree case with a perturbed copy of the target as the draft (accepted often,
partly) checks that tree rows select among the prefix and their own ancestors only."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.drafts import standalone_draft
from jaxspec.model.drafts.mtp import MtpConfig, mtp_draft
from jaxspec.model.checkpoints.mtp import init_mtp_params
from jaxspec.model.targets import Model
from tests.conftest import engine
from tests.model.targets.test_golden_deepseek import v32_model

INDEX_TOPK = 8
PROMPTS = [[5, 9, 1, 33, 7, 2, 8, 40, 11, 3, 17, 29, 50, 6, 21, 13, 2, 44, 9, 30],
           [60, 3, 14, 7, 7, 19, 2, 58, 1],
           list(range(1, 34))]
NEW_TOKENS = 16  # contexts reach 49 positions, 8 attended per row


@functools.cache
def dsa_target_and_mtp():
    cfg, params = v32_model()
    cfg = dataclasses.replace(cfg, index_topk=INDEX_TOPK)
    target = Model(config=cfg, params=params, dtype=np.dtype(np.float32))
    mcfg = MtpConfig(target=cfg, moe=False, indexer=True, layer_index=cfg.num_layers)
    mp = init_mtp_params(mcfg, seed=21, scale=0.3)
    mp["embed"], mp["head"] = params["embed"], params["lm_head"]  # shared with the target, as DeepSeek ships it
    return target, mtp_draft(mcfg, jax.tree.map(np.asarray, mp))


@functools.cache
def perturbed_draft():
    target, _ = dsa_target_and_mtp()
    keys = iter(np.asarray(jax.random.split(jax.random.PRNGKey(11), 256)))  # numpy: iterating a jax.Array compiles
    noisy = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(next(keys), x.shape, x.dtype)
                         if jnp.issubdtype(x.dtype, jnp.floating) else x, target.params)
    return standalone_draft(Model(config=target.config, params=noisy, dtype=np.dtype(np.float32)))


@functools.cache
def plain_greedy():
    target, _ = dsa_target_and_mtp()
    out = js.generate(target, PROMPTS, sampling=js.SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=()),
                      engine=engine(16, 4, max_seq_len=64))
    return out.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("spec,page,kind", [
    (js.SpecConfig.chain(3), 1, "mtp"),
    (js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5), 1, "perturbed"),
], ids=["mtp-chain3-page1", "perturbed-tree-page1"])
# The MTP tree at page 16 under sparse attention runs in tests/mesh (deepseek_v32_tp2_tree_mtp: TP=2
# against one device), which also covers it on one device's numerics; not repeated here for time.
def test_drafting_under_sparse_attention_is_lossless(spec, page, kind):
    target, mtp = dsa_target_and_mtp()
    assert mtp.kind == "mtp" and mtp.config.model.indexer
    draft = mtp if kind == "mtp" else perturbed_draft()
    out = js.generate(target, PROMPTS, draft=draft, spec=spec,
                      sampling=js.SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=()),
                      engine=engine(page, 4, max_seq_len=64))
    assert out.token_ids == plain_greedy()
    assert out.kv_pages_free == out.kv_pages_total
    if kind == "perturbed":  # drafts accepted, partly: verify rows beyond the root matter
        assert 1.5 < out.mean_accept_len < 4.0, out.mean_accept_len
