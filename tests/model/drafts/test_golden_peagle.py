"""P-EAGLE against the ``speculators`` library's model classes (goldens by
``scripts/goldens/peagle.py``; see tests/data/golden/peagle/README.md): loading the library's
layout, every context row's logits after the extend, the anchor row's and the parallel mask rows'
hidden states and logits, the greedy chain, and the reference drafting loop's greedy tokens and
per-step acceptance lengths (heads trained briefly with the library's own training forward on the
DFlash goldens' target, so acceptance varies)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.drafts.base import DraftSeed
from jaxspec.model.targets import forward_sequence
from tests.model.golden_drafts import GoldenDrafts, target

DRAFTS = GoldenDrafts("peagle")
manifest, golden, draft, case = DRAFTS.manifest, DRAFTS.golden, DRAFTS.draft, DRAFTS.case

NAMES = [c["name"] for c in manifest()["cases"]]
TOL = dict(atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("name", NAMES)
def test_loads_the_speculators_layout(name):
    """Detected by ``speculators_model_type`` "peagle": its layers (Llama or Qwen3, one or more),
    the taps as HF ``hidden_states`` indices, its draft vocabulary, its own trained embedding,
    and the chain it was trained for as ``block_size - 1``."""
    c, d = case(name), draft(name)
    m = d.config.model
    assert d.kind == "peagle" and d.config.proposer == "block"
    assert m.num_layers == c["num_layers"] and m.qk_norm == (c["layer_model_type"] == "qwen3")
    assert list(d.config.aux_layers) == c["eagle_aux_hidden_state_layer_ids"]
    assert m.draft_vocab_size == c["draft_vocab_size"] and m.num_speculative_tokens == c["num_speculative_tokens"]
    assert d.block_size == c["num_speculative_tokens"] + 1
    assert not np.allclose(np.asarray(d.params["embed"]), np.asarray(target().params["embed"]))


def rows(name: str):
    """The extend over the golden's context (row p: the token at p + 1, the last one the bonus; the
    target's features at p) at positions 0..C-1, then the mask rows at C..C+K-2.
    Returns (context rows' hidden [1, C, H], proposal hidden [1, K, H]: the seed then the mask rows)."""
    d, g, c = draft(name), golden(), case(name)
    ctx = jnp.asarray(g[f"{name}/block/context"])[None]  # [1, C, F]
    C, K, page = ctx.shape[1], c["num_speculative_tokens"], 4
    tokens = jnp.asarray([c["block_prompt"][1:] + [int(g[f"{name}/block/bonus"])]], jnp.int32)
    pool = d.config.create_pool(num_pages=1 + -(-(C + K) // page), page_size=page, dtype=jnp.float32)
    table = jnp.arange(1, pool.num_slots // page, dtype=jnp.int32)[None]
    pos = jnp.arange(C, dtype=jnp.int32)[None]
    h, pool = d.config.extend(d.params, tokens, ctx, pos, pool,
                              AttentionInputs.build(table, jnp.zeros(1, jnp.int32), pos, page), None)
    bpos = C + jnp.arange(K - 1, dtype=jnp.int32)[None]
    mask_rows, _ = d.config.block_forward(d.params, jnp.zeros((1, K - 1), jnp.int32), bpos, pool,
                                          AttentionInputs.build(table, jnp.full((1,), C, jnp.int32), bpos, page))
    return h, d.config.proposal_hidden(mask_rows, DraftSeed(hidden=h[:, C - 1]))


@pytest.mark.parametrize("name", NAMES)
def test_context_rows_and_parallel_rows(name):
    """The target's taps equal the library's features; every context row's logits (EAGLE-3's
    row: the token after it with the target's features), the anchor row's and the mask rows'
    hidden states (before the final norm) and logits, and the greedy chain (target ids)."""
    d, g, c = draft(name), golden(), case(name)
    _, _, aux = forward_sequence(target(), [c["block_prompt"]], aux_layers=d.config.aux_layers)
    np.testing.assert_allclose(np.asarray(aux[0]), g[f"{name}/block/context"], **TOL)
    context, hidden = rows(name)
    np.testing.assert_allclose(np.asarray(d.config.logits(d.params, context)[0]), g[f"{name}/block/context_logits"],
                               **TOL)
    np.testing.assert_allclose(np.asarray(hidden[0]), g[f"{name}/block/hidden"], **TOL)
    np.testing.assert_allclose(np.asarray(d.config.logits(d.params, hidden)[0]), g[f"{name}/block/logits"], **TOL)
    tokens, _ = d.config.candidates(d.params, hidden, None, 1)
    np.testing.assert_array_equal(np.asarray(tokens[0, :, 0]), g[f"{name}/block/path"])


@pytest.mark.parametrize("name,page", [(n, 16 if i % 2 else 1) for i, n in enumerate(NAMES)])
def test_generate_tokens_and_acceptance_lengths(name, page):
    """The reference loop's greedy tokens and the accept length of every step before the last (it
    runs whole chains, as jaxspec does, and cuts the output); a ragged batch of three prompts, the
    chain the head was trained for, pages 1 and 16."""
    DRAFTS.check_generate(name, page)
