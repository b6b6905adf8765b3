"""Speculative decoding on hybrid targets (Qwen3.5 / Qwen3-Next: Gated DeltaNet layers with recurrent
state): greedy output equals plain greedy output with the checkpoint's MTP layer(s), a perturbed copy
of the target as a standalone draft (itself hybrid: it drafts trees over its own recurrent state) and
n-gram drafts, as chains and trees, pages 1 and 16, a ragged batch of 4 with prompts past the conv
kernel and several prefill chunks, and steps that accept part of a path (so the committed state is a
proper prefix's). The recurrent state stays one per request: the compiled step's transient memory
grows with the tree by the nodes' vectors, far below a state per node."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.spec.plan import Plan
from jaxspec.spec.proposers import proposer_for
from jaxspec.engine.programs import decode_program
from jaxspec.engine.state import DecodeState
from jaxspec.kvcache import layout
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.drafts import standalone_draft
from jaxspec.model.drafts.base import DraftContext, DraftSeed
from jaxspec.model.drafts.dflash import dflash_config_for
from jaxspec.model.drafts.eagle import eagle3_config_for
from jaxspec.model.checkpoints.dflash import export_dflash, init_dflash_params
from jaxspec.model.checkpoints.eagle import export_eagle3, init_eagle_params
from jaxspec.model.checkpoints.hybrid import init_hybrid_params
from jaxspec.model.targets import Model, create_target_pool, forward_sequence, target_forward
from jaxspec.model.targets.hybrid_config import FULL, LINEAR, GatedDeltaConfig, HybridConfig
from jaxspec.model.config import RopeConfig
from jaxspec.train.forward import frozen_target_forward
from tests.conftest import engine
from tests.model.targets.test_golden_hybrid import ROOT, golden, target

MAX_NEW = 24


def prompts(name: str) -> list[list[int]]:
    g = golden(name)
    return [g[f"prompt_{i}"].tolist() for i in range(3)] + [[7, 3]]


@functools.cache
def plain(name: str, page: int):
    out = js.generate(target(name), prompts(name), sampling=js.SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=()),
                      engine=engine(page, 4, max_seq_len=256), progress=False)
    return out.token_ids


@functools.cache
def perturbed(name: str):
    """The target with every weight scaled by 1 + 0.01 N(0, 1): it accepts about 3 of 4 tokens."""
    m = target(name)
    keys = iter(np.asarray(jax.random.split(jax.random.PRNGKey(2), 500)))  # numpy: iterating a jax.Array compiles
    params = jax.tree.map(lambda x: x * (1 + 0.01 * jax.random.normal(next(keys), x.shape, x.dtype)), m.params)
    return standalone_draft(Model(config=m.config, params=params, dtype=m.dtype))


def draft_of(name: str, kind: str):
    if kind == "mtp":
        return js.load_draft(os.path.join(ROOT, name), target(name))
    if kind == "perturbed":
        return perturbed(name)
    return js.NgramDraft(max_ngram=2)


TREE = js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)


@pytest.mark.parametrize("name,kind,spec,page", [
    ("qwen3_5_dense", "mtp", js.SpecConfig.chain(3), 1),
    ("qwen3_5_dense", "mtp", TREE, 16),
    ("qwen3_5_dense", "perturbed", js.SpecConfig.chain(3), 16),
    ("qwen3_5_dense", "perturbed", js.SpecConfig(num_steps=3, topk=3, num_draft_tokens=8), 1),
    ("qwen3_5_dense", "ngram", js.SpecConfig.chain(4), 1),
    ("qwen3_5_dense", "ngram", TREE, 16),
    ("qwen3_next", "mtp", TREE, 16),  # its fused projections; hybrid drafting trees: qwen3_5_dense above
    ("qwen3_5_moe_condgen", "mtp", js.SpecConfig.chain(3), 16),  # two MTP layers, used in turn
], ids=lambda x: x if isinstance(x, (str, int)) else f"S{x.num_steps}k{x.topk}n{x.num_draft_tokens}")
def test_speculative_greedy_equals_plain_greedy(name, kind, spec, page):
    out = js.generate(target(name), prompts(name), draft=draft_of(name, kind), spec=spec,
                      sampling=js.SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=()),
                      engine=engine(page, 4, max_seq_len=256), progress=False)
    assert out.token_ids == plain(name, page)
    assert out.kv_pages_free == out.kv_pages_total
    lens = np.concatenate([s.accept_lens for s in out.stats])
    if kind == "perturbed":  # whole, partial and no acceptance: the state commits proper prefixes
        assert (lens == spec.max_accept).any() and ((lens > 1) & (lens < spec.max_accept)).any(), lens


def test_plain_decoding_matches_hf_past_the_golden_prefix():
    """The engine's plain run (the reference of every test here) starts with HF's greedy tokens."""
    g = golden("qwen3_5_dense")
    assert [t[:16] for t in plain("qwen3_5_dense", 16)[:3]] == [g[f"greedy_{i}"].tolist() for i in range(3)]


# ----------------------------------------------------------------------------- memory


def wide_config(head_dim: int) -> HybridConfig:
    """A small hybrid whose Gated DeltaNet heads are ``head_dim`` wide (keys and values)."""
    return HybridConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=4,
                        layer_types=(LINEAR, LINEAR, LINEAR, FULL), mlp_types=("dense",) * 4, num_heads=2,
                        num_kv_heads=1, head_dim=32, rope=RopeConfig(theta=1e4), rotary_dim=8,
                        gdn=GatedDeltaConfig(num_k_heads=2, num_v_heads=4, head_k_dim=head_dim, head_v_dim=head_dim))


def transient_bytes(model: Model, spec: js.SpecConfig) -> int:
    """Temporary bytes of the compiled decode program (one n-gram-drafted step per call) for ``spec``."""
    draft = js.NgramDraft(max_ngram=2)
    plan = Plan(target=model.config, draft=draft.config, spec=spec, page_size=16, steps_per_call=1)
    B, W = 2, 8
    tpool = create_target_pool(model.config, num_pages=B * W + 1, page_size=16, dtype=jnp.float32, rows=B)
    dpool = plan.draft.create_pool(num_pages=B * W + 1, page_size=16, dtype=jnp.float32, rows=B)
    state = DecodeState.empty(batch=B, out_width=64, num_stop=1,
                              seed=draft.config.empty_seed(B, dtype=jnp.float32, max_len=W * 16))
    table = jnp.asarray(1 + np.arange(B * W, dtype=np.int32).reshape(B, W))
    lowered = decode_program.lower(plan, model.params, draft.params, state, tpool, dpool, table)
    return int(lowered.compile().memory_analysis().temp_size_in_bytes)


def test_the_verify_step_keeps_no_state_per_tree_node():
    """Growing the verified tree from 8 to 32 nodes adds the nodes' vectors (k, u, G, conv inputs),
    logits and KV: with heads 4x wider (a recurrent state 16x larger) that growth is about 4x, not the
    16x of a state per node, and stays a small fraction of 24 states per layer. The state pool's shape
    does not depend on the tree."""
    small = js.SpecConfig(num_steps=4, topk=2, num_draft_tokens=8)
    large = js.SpecConfig(num_steps=8, topk=4, num_draft_tokens=32)
    growth = {}
    for D in (32, 128):
        cfg = wide_config(D)
        model = Model(config=cfg, params=init_hybrid_params(cfg, seed=0, scale=0.1), dtype=np.dtype(np.float32))
        growth[D] = transient_bytes(model, large) - transient_bytes(model, small)
        pool = create_target_pool(cfg, num_pages=9, page_size=16, dtype=jnp.float32, rows=2)
        assert pool.state.ssm.shape == (cfg.num_linear_layers, 2, 4, D, D)  # whatever the tree
    state_per_node = 3 * 2 * 4 * 128 * 128 * 4  # linear layers x rows x heads x Dk x Dv x f32
    assert growth[128] < 5 * growth[32], growth
    assert growth[128] < 0.25 * 24 * state_per_node, (growth, state_per_node)


# ----------------------------------------------------------------------------- feature drafts


@pytest.mark.parametrize("kind,spec,page", [("eagle3", TREE, 1), ("dflash", js.SpecConfig.chain(3), 16)])
def test_feature_drafts_tap_the_hybrid_target(tmp_path, kind, spec, page):
    """An EAGLE-3 head (taps (2, 3, 3): the outputs of Gated DeltaNet and attention layers) and a DFlash
    draft (taps of layers 1 and 4), exported in their published layouts and loaded for the hybrid
    target: their features are the target's, and decoding stays lossless."""
    name = "qwen3_5_dense"
    m = target(name)
    if kind == "eagle3":
        cfg = eagle3_config_for(m.config, draft_vocab_size=96)
        export_eagle3(str(tmp_path), init_eagle_params(cfg, 1, m.params, scale=0.3), cfg,
                      target_num_layers=m.config.num_layers)
    else:
        cfg = dflash_config_for(m.config, num_layers=1, block_size=4, mask_token_id=159, target_layer_ids=(1, 4))
        export_dflash(str(tmp_path), init_dflash_params(cfg, 2, m.params, scale=0.3), cfg)
    draft = js.load_draft(str(tmp_path), m)
    assert draft.kind == ("eagle3" if kind == "eagle3" else "dflash")
    out = js.generate(m, prompts(name), draft=draft, spec=spec,
                      sampling=js.SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=()),
                      engine=engine(page, 4, max_seq_len=256), progress=False)
    assert out.token_ids == plain(name, page)


def test_training_features_of_a_hybrid_target_are_the_serving_ones():
    """Draft training reads a frozen hybrid target through the serving forward (fresh pool): the
    features it trains on are those drafts see while serving."""
    m = target("qwen3_5_dense")
    tokens = jnp.asarray([golden("qwen3_5_dense")["prompt_1"]])
    hidden, aux = frozen_target_forward(m.params, m.config, tokens, aux_layers=(2, 3, 6))
    _, ref_hidden, ref_aux = forward_sequence(m, tokens, aux_layers=(2, 3, 6))
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(ref_hidden), atol=1e-6)
    np.testing.assert_allclose(np.asarray(aux), np.asarray(ref_aux), atol=1e-6)
    assert aux.shape[-1] == 3 * m.config.hidden_size


def test_adaptive_depth_and_continuous_batching_over_recurrent_state():
    """Two slots for four ragged requests (each finished request's state slot is taken by the next,
    whose prefill must start from a zero state), the MTP layer drafting chains whose depth the
    controller moves between calls: the output is plain greedy's."""
    name = "qwen3_5_dense"
    spec = js.SpecConfig.chain(3, adaptive_steps=(1, 3, 5))
    out = js.generate(target(name), prompts(name), draft=draft_of(name, "mtp"), spec=spec,
                      sampling=js.SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=()),
                      engine=engine(16, 2, max_seq_len=256, steps_per_call=1), progress=False)
    assert out.token_ids == plain(name, 16)
    assert out.kv_pages_free == out.kv_pages_total
    assert len(set(out.steps_per_call)) > 1, out.steps_per_call


# ----------------------------------------------------------------------------- the draft-scratch layout

def _propose_tree(model: Model, spec: js.SpecConfig, prompt: list[int], bonus: int, page: int):
    """One propose of ``model`` as a standalone draft (its pool holding ``prompt + [bonus]``), traced
    afresh (a new ``jax.jit``, so a patched layout helper reaches the trace): (tree, draft pool)."""
    draft = standalone_draft(model)
    cfg = model.config
    plan = Plan(target=cfg, draft=draft.config, spec=spec, page_size=page)
    pages = 8
    table = jnp.asarray(1 + np.arange(pages, dtype=np.int32))[None]
    seq = jnp.asarray([prompt + [bonus]], jnp.int32)
    positions = jnp.arange(seq.shape[1], dtype=jnp.int32)[None]
    seed = jax.random.normal(jax.random.PRNGKey(5), (1, cfg.hidden_size), jnp.float32)  # the root's draft output
    state = dataclasses.replace(
        DecodeState.empty(batch=1, out_width=8, num_stop=1, hidden_size=cfg.hidden_size),
        seq_lens=jnp.asarray([len(prompt)], jnp.int32), bonus=jnp.asarray([bonus], jnp.int32),
        active=jnp.ones(1, bool), seed=DraftSeed(hidden=seed))

    def run(params, state):
        pool = draft.config.create_pool(num_pages=pages + 1, page_size=page, dtype=jnp.float32, rows=1)
        attn = AttentionInputs.build(table, jnp.zeros(1, jnp.int32), positions, page)
        pool = target_forward(cfg, params, seq, positions, pool, attn).pool  # the draft's prefill
        rows = state.step_rows()
        ctx = DraftContext(table, rows.seq_lens, None)  # a standalone draft reads no target pool
        tree, _, _, pool = proposer_for(plan).propose(plan, params, rows, pool, ctx)
        return tree, pool

    return jax.jit(run)(model.params, state)


def test_hybrid_draft_tree_is_the_same_under_any_scratch_layout(monkeypatch):
    """One draft-scratch layout (docs/architecture.md#draft-scratch-layout), every path at once: a hybrid standalone draft drafting a tree (3 branches x 4 steps)
    writes its scratch KV where the layout helper says (``draft_scratch_positions``) and reads it back
    through the same helper, in its attention masks (``draft_ancestor_mask``) and its Gated DeltaNet
    layers' ancestors and conv inputs (``draft_scratch_steps``). Swapping the helper's layout (step-major,
    ``base + i * K + j``, for ``base + j * S + i``) moves every write (the KV of branch j, step i lands at the
    new position) and every read with it: the drafted tree is the same to the bit. A path keeping its own
    copy of the layout would read other nodes' columns and draft another tree."""
    cfg = wide_config(16)
    model = Model(config=cfg, params=init_hybrid_params(cfg, seed=1, scale=0.3), dtype=np.dtype(np.float32))
    spec = js.SpecConfig(num_steps=4, topk=3, num_draft_tokens=10)
    K, S, page = spec.topk, spec.num_steps, 4
    prompt, bonus = [5, 9, 2, 31, 7, 12], 40
    base = len(prompt) + 1  # a standalone draft's scratch follows the bonus
    tree, pool = _propose_tree(model, spec, prompt, bonus, page)

    monkeypatch.setattr(layout, "_scratch_offsets",
                        lambda topk, num_steps: np.arange(topk * num_steps, dtype=np.int32).reshape(num_steps, topk).T)
    moved_tree, moved_pool = _propose_tree(model, spec, prompt, bonus, page)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(moved_tree)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # The writes moved: branch j, step i (i < S - 1: the last level runs no forward) from base + j*S + i
    # to base + i*K + j; slot = 4 + position (page p of the table is pool page p + 1).
    old = np.asarray([base + j * S + i for j in range(K) for i in range(S - 1)])
    new = np.asarray([base + i * K + j for j in range(K) for i in range(S - 1)])
    assert not np.array_equal(old, new)
    for x, y in ((pool.kv.k, moved_pool.kv.k), (pool.kv.v, moved_pool.kv.v)):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_array_equal(x[:, page + old], y[:, page + new])
        assert np.abs(x[:, page + old]).sum() > 0
        np.testing.assert_array_equal(x[:, :page + base], y[:, :page + base])  # the prefill: untouched
