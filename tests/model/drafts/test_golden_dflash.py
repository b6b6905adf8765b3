"""DFlash / DFlash 2 against the reference ``dflash`` package (goldens by
``scripts/goldens/dflash_qwen3.py``; see tests/data/golden/dflash/README.md): the target's features
at ``target_layer_ids``, the draft's block logits for given context features and block tokens,
DFlash 2's selector path, and ``dflash_generate``'s greedy tokens and per-step acceptance lengths
(drafts trained briefly, so acceptance varies)."""

from __future__ import annotations

import functools
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.targets import forward_sequence
from tests.conftest import DATA

ROOTS = ("dflash", "dflash_gemma4")  # a Qwen3 target with three drafts; a Gemma 4 target with one


@functools.cache
def manifest(root: str = "dflash") -> dict:
    with open(os.path.join(DATA, "golden", root, "manifest.json")) as f:
        return json.load(f)


@functools.cache
def golden(root: str = "dflash") -> dict:
    return dict(np.load(os.path.join(DATA, "golden", root, "golden.npz")))


@functools.cache
def target(root: str = "dflash"):
    return js.load_model(os.path.join(DATA, "golden", root, "target"), dtype="float32", progress=False)


@functools.cache
def draft(name: str, root: str = "dflash"):
    return js.load_draft(os.path.join(DATA, "golden", root, name), target(root))


def case(name: str, root: str = "dflash") -> dict:
    return next(c for c in manifest(root)["cases"] if c["name"] == name)


def tolerance(root: str) -> dict:
    return {"atol": manifest(root)["atol"], "rtol": manifest(root)["rtol"]}


def cases(trained_only: bool = False) -> list:
    return [pytest.param(root, c["name"], id=f"{root}-{c['name']}") for root in ROOTS for c in manifest(root)["cases"]
            if c["trained"] or not trained_only]


@pytest.mark.parametrize("root,name", cases())
def test_loads_as_its_kind(root, name):
    c, d = case(name, root), draft(name, root)
    assert d.kind == ("dflash2" if c["architecture"] == "DFlash2DraftModel" else "dflash")
    assert d.block_size == c["block_size"]
    assert list(d.config.model.target_layer_ids) == c["target_layer_ids"]


@pytest.mark.parametrize("root,name", cases())
def test_target_features_at_target_layer_ids(root, name):
    """The target's taps (the last layer included: HF's final normed state) equal the context
    the reference built from HF ``hidden_states``."""
    d, g = draft(name, root), golden(root)
    _, _, aux = forward_sequence(target(root), [case(name, root)["block_prompt"]], aux_layers=d.config.aux_layers)
    np.testing.assert_allclose(np.asarray(aux[0]), g[f"{name}/block/context"], **tolerance(root))


def block_forward(name: str, root: str = "dflash"):
    """Context K/V written at positions 0..C-1, then the block at C..C+Q-1, through the paged pool."""
    d, g = draft(name, root), golden(root)
    ctx = jnp.asarray(g[f"{name}/block/context"])[None]  # [1, C, F]
    tokens = jnp.asarray(g[f"{name}/block/block_tokens"])[None]  # [1, Q]
    C, Q = ctx.shape[1], tokens.shape[1]
    page = 4
    pool = d.config.create_pool(num_pages=1 + -(-(C + Q) // page), page_size=page, dtype=jnp.float32)
    table = jnp.arange(1, pool.num_slots // page, dtype=jnp.int32)[None]
    pos = jnp.arange(C, dtype=jnp.int32)[None]
    _, pool = d.config.write_context(d.params, ctx, pos, pool, AttentionInputs.build(table, jnp.zeros(1, jnp.int32), pos, page))
    bpos = C + jnp.arange(Q, dtype=jnp.int32)[None]
    attn = AttentionInputs.build(table, jnp.full((1,), C, jnp.int32), bpos, page)
    hidden, _ = d.config.block_forward(d.params, tokens, bpos, pool, attn)
    return hidden


@pytest.mark.parametrize("root,name", cases())
def test_block_logits(root, name):
    d, g = draft(name, root), golden(root)
    hidden = block_forward(name, root)
    np.testing.assert_allclose(np.asarray(hidden[0]), g[f"{name}/block/hidden"], **tolerance(root))
    np.testing.assert_allclose(np.asarray(d.config.logits(d.params, hidden)[0]), g[f"{name}/block/logits"],
                               **tolerance(root))


def test_dflash2_selector_path():
    d, g = draft("dflash2"), golden()
    hidden = block_forward("dflash2")
    anchor = jnp.asarray(g["dflash2/block/block_tokens"][:1])
    tokens, _ = d.config.candidates(d.params, hidden[:, 1:], anchor, 1)
    np.testing.assert_array_equal(np.asarray(tokens[0, :, 0]), g["dflash2/block/selector_path"])


@pytest.mark.parametrize("root,name", cases(trained_only=True))
@pytest.mark.parametrize("block", ["config", 4])
def test_generate_tokens_and_acceptance_lengths(root, name, block):
    """Greedy tokens and the accept length of every step whose block the reference ran whole (it
    shrinks the block near ``max_new_tokens``; jaxspec runs full blocks and cuts the output). The
    prompts are a ragged batch; the block sizes run at page sizes 16 and 1."""
    c = case(name, root)
    bs = c["block_size"] if block == "config" else block
    prompts, max_new = c["prompts"], c["max_new_tokens"]
    out = js.generate(target(root), prompts, draft=draft(name, root), spec=js.SpecConfig.chain(bs - 1),
                      sampling=js.SamplingParams(max_new_tokens=max_new, stop_token_ids=()),
                      engine=js.EngineConfig(page_size=16 if block == "config" else 1, max_batch=4, max_seq_len=96),
                      progress=False)
    g = golden(root)
    compared = 0
    for j, p in enumerate(prompts):
        assert out.token_ids[j] == g[f"{name}/generate/p{j}/b{bs}/tokens"].tolist()
        ref_acc = g[f"{name}/generate/p{j}/b{bs}/accept"].tolist()
        start, limit = len(p), len(p) + max_new
        for i, acc in enumerate(ref_acc):
            if start + bs >= limit:
                break
            assert out.stats[j].accept_lens[i] == acc, (j, i, out.stats[j].accept_lens, ref_acc)
            compared += 1
            start += acc
    accepted = [a for j in range(len(prompts)) for a in g[f"{name}/generate/p{j}/b{bs}/accept"]]
    assert compared >= 6 and min(accepted) == 1 and max(accepted) >= 3  # acceptance varies
