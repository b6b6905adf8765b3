"""EAGLE-1 and EAGLE-3 heads in their published layouts against an independent PyTorch
implementation (scripts/make_golden.py)."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import KVPool
from jaxspec.model.draft import draft_forward, draft_logits, draft_topk
from tests.model.golden import arrays, case_dir, cases

HEADS = cases("eagle3") + cases("eagle1")


@functools.cache
def target(name):
    case = next(c for c in cases("target") if c["name"] == name)
    return js.load_model(case_dir(case), dtype="float32")


@pytest.mark.parametrize("case", HEADS, ids=[c["name"] for c in HEADS])
def test_head_matches_reference(case):
    tgt = target(case["target"])
    draft = js.load_draft(case_dir(case), tgt)
    assert draft.kind == case["kind"]
    cfg = draft.config
    assert cfg.model.rope.theta == case["rope_theta_effective"]
    ref = arrays(case)
    T = case["T"]
    page = 16
    pool = KVPool.create(num_layers=1, num_pages=2, page_size=page, num_kv_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, dtype=jnp.float32)
    table = jnp.asarray([[1]], jnp.int32)
    ids = jnp.asarray(ref["input_ids"][None], jnp.int32)
    pos = jnp.asarray(ref["positions"][None], jnp.int32)
    attn = AttentionInputs.build(table, jnp.zeros((1,), jnp.int32), pos, page)
    h, pool = draft_forward(cfg, draft.params, ids, jnp.asarray(ref["hidden_in"][None]), pos, pool, attn, from_target=True)
    tol = dict(atol=case["atol"], rtol=case["rtol"])
    np.testing.assert_allclose(np.asarray(h[0]), ref["hidden_out"], **tol)
    np.testing.assert_allclose(np.asarray(draft_logits(cfg, draft.params, h)[0]), ref["logits"], **tol)
    # The draft's argmax, mapped to target ids (d2t), is the next token of the recurrent check.
    _, top = draft_topk(cfg, draft.params, h[:, -1], 1)
    assert int(top[0, 0]) == int(ref["next_id"])
    # Recurrent step: the head's own output (H wide: EAGLE-3 skips fc) at the next position.
    nxt = jnp.asarray([[int(ref["next_position"])]], jnp.int32)
    attn = AttentionInputs.build(table, jnp.full((1,), T, jnp.int32), nxt, page)
    h2, _ = draft_forward(cfg, draft.params, jnp.asarray([[int(ref["next_id"])]], jnp.int32), h[:, -1:], nxt, pool,
                          attn, from_target=False)
    np.testing.assert_allclose(np.asarray(h2[0, 0]), ref["next_hidden_out"], **tol)
    np.testing.assert_allclose(np.asarray(draft_logits(cfg, draft.params, h2)[0, 0]), ref["next_logits"], **tol)


def test_eagle3_d2t_maps_draft_ids_to_target_ids():
    case = next(c for c in HEADS if c["name"] == "eagle3_midlayer")
    draft = js.load_draft(case_dir(case), target(case["target"]))
    from safetensors.numpy import load_file

    d2t = load_file(case_dir(case) + "/model.safetensors")["d2t"]
    np.testing.assert_array_equal(np.asarray(draft.params["hot_ids"]), np.arange(len(d2t)) + d2t)
    assert draft.config.model.draft_vocab_size == 96


def test_eagle3_own_embedding_is_used():
    case = next(c for c in HEADS if c["name"] == "eagle3_layers0")
    tgt = target(case["target"])
    draft = js.load_draft(case_dir(case), tgt)
    assert not np.array_equal(np.asarray(draft.params["embed"]), np.asarray(tgt.params["embed"]))
