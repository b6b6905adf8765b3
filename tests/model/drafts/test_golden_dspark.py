"""DSpark (and ``speculators``' DFlash) against the ``speculators`` library's model classes (goldens
by ``scripts/goldens/dspark.py``; see tests/data/golden/dspark/README.md): loading the
library's layout, the block's hidden states and logits for given context features, the greedy
path through the Markov head, the Markov bias and confidence of every drafting slot, and the
reference drafting loop's greedy tokens and per-step acceptance lengths (drafts trained briefly
on the DFlash goldens' target, so acceptance varies)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.drafts.dspark import markov_bias
from jaxspec.model.targets import forward_sequence
from tests.model.golden_drafts import GoldenDrafts, target

DRAFTS = GoldenDrafts("dspark")
manifest, golden, draft, case = DRAFTS.manifest, DRAFTS.golden, DRAFTS.draft, DRAFTS.case

NAMES = [c["name"] for c in manifest()["cases"]]
DSPARK = [n for n in NAMES if case(n)["speculators_model_type"] == "dspark"]
TOL = dict(atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("name", NAMES)
def test_loads_the_speculators_layout(name):
    """Detected by ``speculators_model_type``: DSpark as "dspark"; the library's DFlash (nested
    config, z-lab's architecture name) as "dflash", the z-lab drafting; the taps are the HF
    ``hidden_states`` indices as they are."""
    c, d = case(name), draft(name)
    assert d.kind == c["speculators_model_type"]
    assert d.block_size == c["block_size"]
    assert list(d.config.aux_layers) == c["aux_hidden_state_layer_ids"]
    m = d.config.model
    if name in DSPARK:
        assert m.sample_from_anchor == c["sample_from_anchor"]
        assert m.num_speculative_tokens == c["num_speculative_tokens"]


def block_hidden(name: str):
    """The golden's context K/V at positions 0..C-1, then [anchor, mask...] at C..C+Q-1 -> [1, Q, H]."""
    d, g = draft(name), golden()
    ctx = jnp.asarray(g[f"{name}/block/context"])[None]  # [1, C, F]
    anchor = int(g[f"{name}/block/anchor"])
    S = len(g[f"{name}/block/path"])
    Q = d.config.block_length(S) if name in DSPARK else S + 1
    tokens = jnp.asarray([[anchor] + [d.config.model.mask_token_id] * (Q - 1)], jnp.int32)
    C, page = ctx.shape[1], 4
    pool = d.config.create_pool(num_pages=1 + -(-(C + Q) // page), page_size=page, dtype=jnp.float32)
    table = jnp.arange(1, pool.num_slots // page, dtype=jnp.int32)[None]
    pos = jnp.arange(C, dtype=jnp.int32)[None]
    _, pool = d.config.write_context(d.params, ctx, pos, pool, AttentionInputs.build(table, jnp.zeros(1, jnp.int32),
                                                                                      pos, page))
    bpos = C + jnp.arange(Q, dtype=jnp.int32)[None]
    hidden, _ = d.config.block_forward(d.params, tokens, bpos, pool,
                                       AttentionInputs.build(table, jnp.full((1,), C, jnp.int32), bpos, page))
    return hidden, jnp.asarray([anchor], jnp.int32)


@pytest.mark.parametrize("name", NAMES)
def test_context_features_and_block_outputs(name):
    """The target's taps equal the library's context; the block's normed hidden and the head's
    logits before the Markov bias (the draft's own head over its reduced vocabulary) match."""
    d, g, c = draft(name), golden(), case(name)
    _, _, aux = forward_sequence(target(), [c["block_prompt"]], aux_layers=d.config.aux_layers)
    np.testing.assert_allclose(np.asarray(aux[0]), g[f"{name}/block/context"], **TOL)
    hidden, _ = block_hidden(name)
    np.testing.assert_allclose(np.asarray(hidden[0]), g[f"{name}/block/hidden"], **TOL)
    base = d.config.base_logits(d.params, hidden) if name in DSPARK else d.config.logits(d.params, hidden)
    np.testing.assert_allclose(np.asarray(base[0]), g[f"{name}/block/base_logits"], **TOL)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_path_markov_bias_and_confidence(name):
    """The greedy block path (each slot's argmax given the greedy token before it), each drafting
    slot's corrected logits and Markov bias (over the draft vocabulary), and the confidence head's
    logits along that path."""
    d, g = draft(name), golden()
    hidden, anchor = block_hidden(name)
    path = g[f"{name}/block/path"]
    tokens, _ = d.config.candidates(d.params, d.config.proposal_hidden(hidden, None), anchor, 1)
    np.testing.assert_array_equal(np.asarray(tokens[0, :, 0]), path)
    if name not in DSPARK:
        return
    cfg = d.config.model
    _, corrected = d.config.slot_logits(d.params, hidden, anchor, lambda t, logits: jnp.asarray(path[t:t + 1]))
    cols = np.asarray(d.params["hot_ids"]) if cfg.own_vocab else np.arange(cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(corrected[0][:, cols]), g[f"{name}/block/corrected"], **TOL)
    s = cfg.first_draft_slot
    prev = np.concatenate([[int(anchor[0])], path])  # the token chosen before each slot, from slot 0
    prev = prev if s == 0 else np.concatenate([[int(anchor[0])], prev])
    state = jnp.zeros((1, cfg.markov_rank), jnp.float32)
    for k in range(hidden.shape[1]):
        bias, state, _ = markov_bias(d.params, cfg, jnp.asarray(prev[k:k + 1]), hidden[:, k], state)
        if k >= s:
            np.testing.assert_allclose(np.asarray(bias[0]), g[f"{name}/block/markov_bias"][k - s], **TOL)
    if cfg.confidence_head:
        conf = d.config.confidence(d.params, hidden, anchor, jnp.asarray(path)[None])
        np.testing.assert_allclose(np.asarray(conf[0]), 1 / (1 + np.exp(-g[f"{name}/block/confidence"])), **TOL)


@pytest.mark.parametrize("name,page", [(n, 16 if i % 2 else 1) for i, n in enumerate(NAMES)])
def test_generate_tokens_and_acceptance_lengths(name, page):
    """The reference loop's greedy tokens and the accept length of every step before the last (it
    runs whole blocks, as jaxspec does, and cuts the output); a ragged batch of three prompts, the
    chain the draft was trained for, pages 1 and 16."""
    out, S = DRAFTS.check_generate(name, page), case(name)["num_speculative_tokens"]
    assert all(s.verify_lens == [S + 1] * len(s.accept_lens) for s in out.stats)  # the whole block
