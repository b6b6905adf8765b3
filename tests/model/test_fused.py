"""Joined projections (``jaxspec.model.fused``): the per-shard column order, and a Llama layer running
four products (q/k/v, o, gate/up, down) where it ran seven. The joined arrays the loader builds are
checked against the checkpoints in tests/model/checkpoints/test_name_tables.py; the logits against HF
by the golden tests; tensor parallelism by tests/mesh."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.model.fused import column_shards, fuse_columns, split_columns


@pytest.mark.parametrize("shards", [1, 2])
def test_each_shards_parts_sit_together(shards):
    q, k, v = (np.arange(n)[None] + base for n, base in ((8, 100), (4, 200), (4, 300)))  # [1, width]
    joined = fuse_columns([q, k, v], shards)
    if shards == 1:
        want = [*range(100, 108), *range(200, 204), *range(300, 304)]
    else:  # [q_0 k_0 v_0 | q_1 k_1 v_1]
        want = [*range(100, 104), 200, 201, 300, 301, *range(104, 108), 202, 203, 302, 303]
    assert joined[0].tolist() == want
    for got, part in zip(split_columns(jnp.asarray(joined), (8, 4, 4), shards), (q, k, v)):
        np.testing.assert_array_equal(np.asarray(got), part)
    assert column_shards((8, 4, 6), 4) == 1  # a part that does not divide: the one-shard order


def _weight_products(jaxpr, weights: set) -> int:
    """dot_generals (at any depth) with an operand among ``weights`` (the scanned layer weights)."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and any(v in weights for v in eqn.invars):
            n += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _weight_products(sub, weights)
    return n


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_llama_layer_runs_four_products(arch):
    """One decode step's layer body: q/k/v as one product, o, gate/up as one, down (seven before)."""
    from jaxspec.model.checkpoints.llama import init_llama_params
    from jaxspec.model.targets import forward_fresh
    from jaxspec.model.targets.llama_config import LlamaConfig

    cfg = LlamaConfig(arch=arch, vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, attention_bias=arch == "qwen2", qk_norm=arch == "qwen3")
    params = init_llama_params(cfg)
    closed = jax.make_jaxpr(lambda p, t: forward_fresh(cfg, p, t, dtype=jnp.float32)[0])(params, jnp.zeros((2, 1), jnp.int32))
    scans = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1
    body = scans[0].params["jaxpr"].jaxpr
    # One layer's [in, out] weights (float, 2-D; the carry and pools are not, and the norms' stacked
    # [L, H] weights come whole: stacked_rms_norm indexes them by layer).
    weights = {v for v in body.invars
               if len(v.aval.shape) == 2 and jnp.issubdtype(v.aval.dtype, jnp.floating)
               and v.aval.shape != (cfg.num_layers, cfg.hidden_size)}
    assert len(weights) == 4
    assert _weight_products(body, weights) == 4
