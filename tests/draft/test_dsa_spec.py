"""Speculative decoding under DeepSeek-V3.2 sparse attention (DSA): MTP drafting (chain and tree)
with an MTP layer carrying its own indexer is lossless against plain greedy decoding of the same
target, at page sizes 1 and 16, on a ragged batch whose contexts reach far beyond ``index_topk``
(target verify rows, draft rows and prefill all select their positions)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.drafts.mtp import MtpConfig, mtp_draft
from jaxspec.model.io.mtp import init_mtp_params
from jaxspec.model.targets import Model
from tests.conftest import engine
from tests.model.test_golden_deepseek import v32_model

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
def plain_greedy():
    target, _ = dsa_target_and_mtp()
    out = js.generate(target, PROMPTS, sampling=js.SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=()),
                      engine=engine(16, 4, max_seq_len=64))
    return out.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("spec,page", [
    (js.SpecConfig.chain(3), 1),
    (js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=4), 16),
], ids=["chain3-page1", "tree-page16"])
def test_mtp_drafting_under_sparse_attention_is_lossless(spec, page):
    target, draft = dsa_target_and_mtp()
    assert draft.kind == "mtp" and draft.config.model.indexer
    out = js.generate(target, PROMPTS, draft=draft, spec=spec,
                      sampling=js.SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=()),
                      engine=engine(page, 4, max_seq_len=64))
    assert out.token_ids == plain_greedy()
    assert out.kv_pages_free == out.kv_pages_total
