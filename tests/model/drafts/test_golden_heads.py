"""EAGLE-1 and EAGLE-3 heads in their published layouts against an independent PyTorch
implementation (scripts/goldens/targets.py)."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.layers import padded_tokens
from jaxspec.pallas import dispatch
from tests.model.golden import arrays, case_dir, cases

HEADS = cases("eagle3") + cases("eagle1")


@functools.cache
def target(name):
    case = next(c for c in cases("target") if c["name"] == name)
    return js.load_model(case_dir(case), dtype="float32")


# rows 8: the head's forward pads its 9 rows to 16, as on a GPU (``padded_tokens``); the padding rows
# must write nothing (the recurrent step reads the pool) and change no real row.
@pytest.mark.parametrize("rows", [1, 8], ids=["unpadded", "rows-padded-to-8"])
@pytest.mark.parametrize("case", HEADS, ids=[c["name"] for c in HEADS])
def test_head_matches_reference(case, rows):
    with dispatch.rows_padded_to(rows):
        assert (padded_tokens(1, case["T"]) > case["T"]) == (rows == 8)
        check_head(case)


def check_head(case):
    tgt = target(case["target"])
    draft = js.load_draft(case_dir(case), tgt)
    assert draft.kind == case["kind"]
    cfg = draft.config
    assert cfg.model.rope.theta == case["rope_theta_effective"]
    ref = arrays(case)
    T = case["T"]
    page = 16
    pool = cfg.create_pool(num_pages=2, page_size=page, dtype=jnp.float32)
    table = jnp.asarray([[1]], jnp.int32)
    ids = jnp.asarray(ref["input_ids"][None], jnp.int32)
    pos = jnp.asarray(ref["positions"][None], jnp.int32)
    attn = AttentionInputs.build(table, jnp.zeros((1,), jnp.int32), pos, page)
    h, _, pool = cfg.forward(draft.params, ids, jnp.asarray(ref["hidden_in"][None]), pos, pool, attn, None,
                             from_target=True)
    tol = dict(atol=case["atol"], rtol=case["rtol"])
    np.testing.assert_allclose(np.asarray(h[0]), ref["hidden_out"], **tol)
    np.testing.assert_allclose(np.asarray(cfg.logits(draft.params, h)[0]), ref["logits"], **tol)
    # The draft's argmax, mapped to target ids (d2t), is the next token of the recurrent check.
    top = cfg.to_target_ids(draft.params, jnp.argmax(cfg.logits(draft.params, h[:, -1]), axis=-1))
    assert int(top[0]) == int(ref["next_id"])
    # Recurrent step: the head's own output (H wide: EAGLE-3 skips fc) at the next position.
    nxt = jnp.asarray([[int(ref["next_position"])]], jnp.int32)
    attn = AttentionInputs.build(table, jnp.full((1,), T, jnp.int32), nxt, page)
    h2, _, _ = cfg.forward(draft.params, jnp.asarray([[int(ref["next_id"])]], jnp.int32), h[:, -1:], nxt, pool,
                           attn, None, from_target=False)
    np.testing.assert_allclose(np.asarray(h2[0, 0]), ref["next_hidden_out"], **tol)
    np.testing.assert_allclose(np.asarray(cfg.logits(draft.params, h2)[0, 0]), ref["next_logits"], **tol)


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


def _copy(tmp_path, name):
    import shutil

    case = next(c for c in HEADS if c["name"] == name)
    dst = tmp_path / name
    shutil.copytree(case_dir(case), dst)
    return dst


def _edit(d, **fields):
    import json

    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("name,fields,match", [
    ("eagle3_midlayer", dict(vocab_size=300), "draft vocab_size 300 does not match the target's 256"),
    ("eagle3_midlayer", dict(target_hidden_size=128), "expects target hidden size 128, the target has 64"),
    ("eagle3_layers0", dict(hidden_size=32), "has shape"),
    ("eagle1", dict(vocab_size=255), "vocab_size 255 does not match"),
    ("eagle3_midlayer", dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}), "outside the target's 7"),
    ("eagle3_midlayer", dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 5]},
                             eagle_aux_hidden_state_layer_ids=[0, 2, 5]), "disagree"),
], ids=["eagle3-vocab", "eagle3-target-hidden", "eagle3-misshaped", "eagle1-vocab", "eagle3-aux-layers",
        "eagle3-aux-layers-disagree"])
def test_draft_that_does_not_fit_the_target_is_refused(tmp_path, name, fields, match):
    d = _copy(tmp_path, name)
    _edit(d, **fields)
    with pytest.raises(ValueError, match=match):
        js.load_draft(d, target("llama3"))


@pytest.mark.parametrize("fields", [
    dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}),  # SGLang's: the layers' outputs
    dict(eagle_config=None, eagle_aux_hidden_state_layer_ids=[1, 3, 6]),  # vLLM's, top level: their inputs
    dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}, eagle_aux_hidden_state_layer_ids=[1, 3, 6]),
], ids=["nested-sglang", "top-level-vllm", "both"])
def test_eagle3_taps_are_read_from_either_layout(tmp_path, fields):
    d = _copy(tmp_path, "eagle3_midlayer")
    _edit(d, **fields)
    assert js.load_draft(d, target("llama3")).config.aux_layers == (1, 3, 6)


def test_eagle3_draft_vocabulary_comes_from_d2t_when_the_config_has_none(tmp_path):
    """A config without ``draft_vocab_size`` (or null) takes the checkpoint's ``d2t`` length; a
    wrong one stated is still refused by the head's shape."""
    ref = js.load_draft(case_dir(next(c for c in HEADS if c["name"] == "eagle3_midlayer")), target("llama3"))
    d = _copy(tmp_path, "eagle3_midlayer")
    _edit(d, draft_vocab_size=None)
    draft = js.load_draft(d, target("llama3"))
    assert draft.config.model.draft_vocab_size == 96
    np.testing.assert_array_equal(np.asarray(draft.params["hot_ids"]), np.asarray(ref.params["hot_ids"]))
    _edit(d, draft_vocab_size=128)
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \(96, 64\), expected \(128, 64\)"):
        js.load_draft(d, target("llama3"))


def test_standalone_draft_with_another_vocabulary_is_refused(tmp_path):
    import shutil

    src = next(c for c in cases("target") if c["name"] == "qwen2")
    d = tmp_path / "qwen2"
    shutil.copytree(case_dir(src), d)
    _edit(d, vocab_size=300)
    with pytest.raises(ValueError, match="standalone draft vocab_size 300 does not match the target's 256"):
        js.load_draft(d, target("llama3"))
    shutil.copytree(case_dir(src), tmp_path / "ok")
    draft = js.load_draft(tmp_path / "ok", target("llama3"))
    assert draft.kind == "standalone"
