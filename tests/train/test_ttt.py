"""The training-time test (TTT) unroll against its definition and against inference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import KVPool
from jaxspec.model.drafts.eagle import eagle3_config_for, eagle_forward
from jaxspec.model.targets import Model
from jaxspec.train.forward import dense_forward
from jaxspec.model.checkpoints.eagle import eagle_table
from jaxspec.model.checkpoints.llama import init_llama_params
from jaxspec.model.checkpoints.name_tables import init_params
from jaxspec.train.ttt import ttt_forward, ttt_loss, ttt_mask
from tests.conftest import TINY


def tiny_model() -> Model:
    return Model(config=TINY, params=init_llama_params(TINY, 0, scale=0.3), dtype=np.dtype(np.float32))


def visible_loop(T: int, step: int) -> set[tuple[int, int]]:
    """(key step, key position) pairs each row sees, written as the inference schedule:
    a chain rooted at position r = p - step: the extend prefix [0, r], then one key per
    draft step j at position r + j, up to the row itself."""
    out = set()
    for p in range(T):
        r = p - step
        for q in range(0, r + 1):
            out.add((p, 0, q))
        for j in range(1, step + 1):
            if r + j >= 0:
                out.add((p, j, r + j))
    return out


@pytest.mark.parametrize("T,step", [(6, 0), (6, 1), (7, 3), (5, 4)])
def test_ttt_mask_matches_loop_definition(T, step):
    mask = ttt_mask(T, step)
    assert mask.shape == (T, (step + 1) * T)
    got = {(p, c // T, c % T) for p, c in zip(*np.nonzero(mask))}
    assert got == visible_loop(T, step)
    assert mask[np.arange(T), step * T + np.arange(T)].all()  # every row sees itself (no empty row)


@functools.partial(jax.jit, static_argnames=("cfg", "from_target"))
def _extend_or_step(params, cfg, tokens, feature, pos, pool, attn, from_target):
    return eagle_forward(params, cfg, tokens, feature, pos, pool, attn, from_target=from_target)


@functools.partial(jax.jit, static_argnums=(1, 3))
def _dense(params, cfg, tokens, aux_layers):
    return dense_forward(params, cfg, tokens, aux_layers=aux_layers)


def _head(target, draft_vocab_size=None):
    cfg = eagle3_config_for(target.config, draft_vocab_size=draft_vocab_size)
    params = dict(init_params(eagle_table(cfg), 3, scale=0.2), embed=target.params["embed"])
    if draft_vocab_size:
        params["hot_ids"] = jnp.asarray(np.sort(np.random.default_rng(3).choice(
            TINY.vocab_size, draft_vocab_size, replace=False)).astype(np.int32))
    return cfg, params


def test_ttt_forward_equals_inference_chain():
    """Step k, row p of the unroll == draft step k of a chain rooted at p - k, run through the
    serving path (paged KV): extend over the prefix with target features, then k draft steps
    feeding back the head's own output."""
    target = tiny_model()
    cfg, params = _head(target)
    T, K = 12, 4
    x = jnp.asarray(np.random.default_rng(4).integers(0, TINY.vocab_size, (1, T + 1)), jnp.int32)
    _, aux = _dense(target.params, TINY, x, cfg.aux_layers)
    outs = jax.jit(ttt_forward, static_argnums=(1, 4))(params, cfg, x[:, 1:], aux[:, :T], K)
    page = 16
    table = jnp.asarray([[1]], jnp.int32)
    for root in (3, 7):
        pool = KVPool.create(num_layers=1, num_pages=2, page_size=page, num_kv_heads=cfg.num_kv_heads,
                             head_dim=cfg.head_dim, dtype=jnp.float32)
        pos = jnp.arange(root + 1, dtype=jnp.int32)[None]
        attn = AttentionInputs.build(table, jnp.zeros((1,), jnp.int32), pos, page)
        h, pool = _extend_or_step(params, cfg, x[:, 1:root + 2], aux[:, :root + 1], pos, pool, attn, True)
        np.testing.assert_allclose(np.asarray(h[0]), np.asarray(outs[0][0, :root + 1]), atol=1e-4, rtol=1e-5)
        h = h[:, -1:]
        for k in range(1, K):
            p = root + k
            if p >= T:
                break
            pos = jnp.asarray([[p]], jnp.int32)
            attn = AttentionInputs.build(table, jnp.full((1,), p, jnp.int32), pos, page)
            h, pool = _extend_or_step(params, cfg, x[:, p + 1:p + 2], h, pos, pool, attn, False)
            np.testing.assert_allclose(np.asarray(h[0, 0]), np.asarray(outs[k][0, p]), atol=1e-4, rtol=1e-5,
                                       err_msg=f"root {root}, step {k}")


def test_ttt_loss_gradients_and_row_mask():
    target = tiny_model()
    cfg, params = _head(target, draft_vocab_size=48)
    hot_ids = params.pop("hot_ids")
    B, T, K = 2, 10, 3
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.integers(0, TINY.vocab_size, (B, T + 1)), jnp.int32)
    _, aux = _dense(target.params, TINY, x, cfg.aux_layers)
    logits = jnp.asarray(rng.standard_normal((B, T, TINY.vocab_size), np.float32) * 3)

    @jax.jit
    def losses(p, rows):
        def f(p, label):
            return ttt_loss(dict(p, hot_ids=hot_ids), cfg, x[:, 1:], aux[:, :T], logits, rows,
                            num_steps=K, label=label)
        return jax.value_and_grad(f, has_aux=True)(p, "soft"), f(p, "greedy")

    ((loss, m), grads), (greedy, mg) = losses(params, jnp.ones((B, T), bool))
    for value, metrics in ((loss, m), (greedy, mg)):
        assert np.isfinite(float(value)) and float(value) > 0
        assert metrics["acc"].shape == (K,) and metrics["loss"].shape == (K,)
        assert ((np.asarray(metrics["acc"]) >= 0) & (np.asarray(metrics["acc"]) <= 1)).all()
    np.testing.assert_allclose(m["acc"], mg["acc"])  # agreement does not depend on the label kind
    # The loss reaches every trainable weight.
    assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves({k: v for k, v in grads.items() if k != "embed"}))
    ((loss, _), grads), (greedy, _) = losses(params, jnp.zeros((B, T), bool))
    assert float(loss) == 0.0 and float(greedy) == 0.0 and all(float(jnp.abs(g).sum()) == 0 for g in jax.tree.leaves(grads))
