"""PARD drafts against an independent torch reference (goldens by ``scripts/goldens/pard.py``;
see tests/data/golden/pard/README.md): detection by the config's ``pard_token``, one block's logits
and greedy tokens over [context..., bonus, pard_token...], and the reference drafting loop's greedy
tokens and per-step acceptance lengths (HF Qwen3 and Llama drafts trained briefly with PARD's
objective for the DFlash goldens' target, so acceptance varies)."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kvcache.paging import AttentionInputs
from tests.model.golden_drafts import GoldenDrafts, target

DRAFTS = GoldenDrafts("pard")
ROOT, manifest, golden, draft, case = DRAFTS.root, DRAFTS.manifest, DRAFTS.golden, DRAFTS.draft, DRAFTS.case

NAMES = [c["name"] for c in manifest()["cases"]]
TOL = dict(atol=manifest()["atol"], rtol=manifest()["rtol"])


@pytest.mark.parametrize("name", NAMES)
def test_detected_by_pard_token(name):
    """An LM whose config carries ``pard_token`` loads as a PARD draft with that mask token, its
    own family and width; the same LM without it is a standalone draft."""
    d, c = draft(name), case(name)
    assert d.kind == "pard" and d.config.proposer == "block"
    assert d.config.mask_token_id == c["pard_token"] == manifest()["pard_token"]
    with open(os.path.join(ROOT, name, "config.json")) as f:
        raw = json.load(f)
    assert raw["architectures"] == [c["architecture"]] and raw["spd_type"] == "pard"
    assert d.config.model.hidden_size == raw["hidden_size"] and d.config.model.vocab_size == 256


def block_logits(name: str, context: list[int], bonus: int, num: int):
    """The draft's context K/V for ``context`` at 0..C-1 (its extend), then one block forward over
    [bonus, mask x (num - 1)] at C..C+num-1 -> f32[num, V]."""
    d = draft(name)
    cfg, page = d.config, 4
    C = len(context)
    pool = cfg.create_pool(num_pages=1 + -(-(C + num) // page), page_size=page, dtype=jnp.float32)
    table = jnp.arange(1, pool.num_slots // page, dtype=jnp.int32)[None]
    pos = jnp.arange(C, dtype=jnp.int32)[None]
    _, pool = cfg.extend(d.params, jnp.asarray([context], jnp.int32), None, pos, pool,
                         AttentionInputs.build(table, jnp.zeros(1, jnp.int32), pos, page), None)
    tokens = jnp.asarray([[bonus] + [cfg.mask_token_id] * (num - 1)], jnp.int32)
    bpos = C + jnp.arange(num, dtype=jnp.int32)[None]
    hidden, _ = cfg.block_forward(d.params, tokens, bpos, pool,
                                  AttentionInputs.build(table, jnp.full((1,), C, jnp.int32), bpos, page))
    return cfg.logits(d.params, cfg.proposal_hidden(hidden, None))[0], hidden


@pytest.mark.parametrize("name", NAMES)
def test_block_logits_and_greedy_tokens(name):
    """[context..., bonus, pard_token x (K - 1)]: the bonus row's logits predict draft 1, each mask
    row's the next; the greedy block (the chain's proposals) equals the reference's."""
    c, g = case(name), golden()
    prompt, K = c["block_prompt"], c["num_speculative_tokens"]
    logits, hidden = block_logits(name, prompt[:-1], prompt[-1], K)
    np.testing.assert_allclose(np.asarray(logits), g[f"{name}/block/logits"], **TOL)
    d = draft(name)
    tokens, _ = d.config.candidates(d.params, d.config.proposal_hidden(hidden, None), jnp.asarray([prompt[-1]]), 1)
    np.testing.assert_array_equal(np.asarray(tokens[0, :, 0]), g[f"{name}/block/tokens"])


@pytest.mark.parametrize("name,page", [(n, 16 if i % 2 else 1) for i, n in enumerate(NAMES)])
def test_generate_tokens_and_acceptance_lengths(name, page):
    """The reference loop's greedy tokens and the accept length of every step before the last (it
    runs whole blocks, as jaxspec does, and cuts the output); a ragged batch of three prompts, the
    chain of K drafts, pages 1 and 16."""
    DRAFTS.check_generate(name, page)
