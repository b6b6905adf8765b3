"""The MTP head as a draft: paged incremental steps equal a one-shot run (its own one-layer MLA
pool, any page size), chained steps feed back the pre-norm output, V3.2 heads write indexer keys."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.targets.deepseek_config import deepseek_config_from_hf
from jaxspec.model.drafts.mtp import MtpConfig, create_mtp_pool, mtp_forward, mtp_logits
from jaxspec.model.checkpoints.mtp import init_mtp_params
from tests.model.targets.test_golden_deepseek import V32_RAW


@functools.cache
def head(moe: bool, indexer: bool):
    target = deepseek_config_from_hf(V32_RAW if indexer else {**V32_RAW, "model_type": "deepseek_v3",
                                                             "architectures": ["DeepseekV3ForCausalLM"]})
    cfg = MtpConfig(target=target, moe=moe, indexer=indexer, layer_index=target.num_layers)
    return cfg, init_mtp_params(cfg, jax.random.PRNGKey(int(moe) + 2 * int(indexer)), scale=0.3)


def one_shot(cfg, params, tokens, feature):  # [T], [T, H] -> hidden [T, H], pool
    T = len(tokens)
    pool = create_mtp_pool(cfg, num_pages=2, page_size=T, dtype=jnp.float32)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    attn = AttentionInputs.build(jnp.array([[1]], jnp.int32), jnp.zeros(1, jnp.int32), pos, T)
    h, pool = mtp_forward(params, cfg, jnp.asarray(tokens)[None], jnp.asarray(feature)[None], pos, pool, attn)
    return np.asarray(h[0]), pool


def test_config_properties():
    cfg, _ = head(moe=True, indexer=False)
    assert cfg.num_layers == 1 and cfg.hidden_size == 32 and cfg.vocab_size == 64
    hash(cfg)
    pool = create_mtp_pool(cfg, num_pages=3, page_size=4, dtype=jnp.float32)
    assert pool.kv.shape == (1, 12, 20) and pool.index_k is None
    cfg32, _ = head(moe=False, indexer=True)
    assert create_mtp_pool(cfg32, num_pages=3, page_size=4, dtype=jnp.float32).index_k.shape == (1, 12, 8)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("moe, indexer", [(True, False), (False, True)], ids=["moe", "dense+indexer"])
def test_extend_then_chained_steps_equal_one_shot(page_size, moe, indexer):
    """Draft-extend over 6 rows, then 3 chained single-row steps (feature = own previous
    output) on scrambled pages, equal one pass over all 9 rows with the same features."""
    cfg, params = head(moe, indexer)
    H, n0, steps = cfg.hidden_size, 6, 3
    rng = np.random.default_rng(page_size)
    tokens = rng.integers(0, cfg.vocab_size, size=n0 + steps).astype(np.int32)
    target_feat = rng.standard_normal((n0, H)).astype(np.float32)
    W = -(-(n0 + steps) // page_size)
    table = jnp.asarray((1 + rng.permutation(W)).reshape(1, W).astype(np.int32))
    pool = create_mtp_pool(cfg, num_pages=W + 1, page_size=page_size, dtype=jnp.float32)
    pos = jnp.arange(n0, dtype=jnp.int32)[None]
    attn = AttentionInputs.build(table, jnp.zeros(1, jnp.int32), pos, page_size)
    h, pool = mtp_forward(params, cfg, jnp.asarray(tokens[:n0])[None], jnp.asarray(target_feat)[None], pos, pool, attn,
                          from_target=True)
    outs, feats = [np.asarray(h[0])], [target_feat]
    last = h[:, -1:]  # [1, 1, H] pre-norm output feeds the next step
    for i in range(steps):
        p = n0 + i
        feats.append(np.asarray(last[0]))
        pos = jnp.array([[p]], jnp.int32)
        attn = AttentionInputs.build(table, jnp.array([p], jnp.int32), pos, page_size)
        last, pool = mtp_forward(params, cfg, jnp.asarray(tokens[p : p + 1])[None], last, pos, pool, attn,
                                 from_target=False)
        outs.append(np.asarray(last[0]))
    ref, ref_pool = one_shot(cfg, params, tokens, np.concatenate(feats))
    np.testing.assert_allclose(np.concatenate(outs), ref, atol=2e-5, rtol=2e-5)
    slots = np.asarray(table)[0, np.arange(n0 + steps) // page_size] * page_size + np.arange(n0 + steps) % page_size
    n = n0 + steps
    np.testing.assert_allclose(np.asarray(pool.kv[0, slots]), np.asarray(ref_pool.kv[0, n : 2 * n]), atol=2e-5)
    if indexer:
        got = np.asarray(pool.index_k[0, slots])
        assert np.all(np.any(got != 0, axis=-1))
        np.testing.assert_allclose(got, np.asarray(ref_pool.index_k[0, n : 2 * n]), atol=2e-5)
    logits = mtp_logits(params, cfg, jnp.asarray(ref))
    assert logits.shape == (n, cfg.vocab_size) and logits.dtype == jnp.float32
