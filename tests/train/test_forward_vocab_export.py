"""Training forward == serving forward; draft vocabulary; exporters round-trip through the loaders."""

import jax
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.targets.llama_config import LlamaConfig
from jaxspec.model.drafts.eagle import eagle3_config_for
from jaxspec.model.layers import lm_head
from jaxspec.model.targets import Model
from jaxspec.model.targets import forward_sequence
from jaxspec.model.checkpoints.eagle import export_eagle3
from jaxspec.model.checkpoints.llama import export_llama
from jaxspec.train.forward import dense_forward
from jaxspec.model.checkpoints.eagle import eagle_table
from jaxspec.model.checkpoints.llama import init_llama_params
from jaxspec.model.checkpoints.name_tables import init_params
from jaxspec.train.vocab import build_draft_vocab, token_counts
from tests.conftest import TINY


def tiny_model(cfg=TINY) -> Model:
    return Model(config=cfg, params=init_llama_params(cfg, 0, scale=0.3), dtype=np.dtype(np.float32))

# Every optional feature at once: QKV bias (Qwen2), q/k norms and an explicit head_dim (Qwen3),
# tied embeddings, 7 layers (distinct default EAGLE-3 taps).
ALL_FEATURES = LlamaConfig(arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=7,
                           num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, attention_bias=True,
                           tie_word_embeddings=True)


@pytest.mark.parametrize("cfg", [TINY, ALL_FEATURES], ids=["llama", "qwen-features"])
def test_dense_forward_equals_forward_sequence(cfg):
    model = tiny_model(cfg=cfg)
    # Distinct taps (the default (2, L//2, L-3) repeats a layer for L < 7).
    aux_layers = (0, 1, 2) if cfg.num_layers < 7 else cfg.eagle3_aux_layers()
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 11)).astype(np.int32)
    serve = jax.jit(lambda params, t: forward_sequence(
        Model(config=cfg, params=params, dtype=model.dtype), t, aux_layers=aux_layers, implementation="xla"))
    logits, hidden, aux = serve(model.params, tokens)
    h2, aux2 = jax.jit(dense_forward, static_argnums=1, static_argnames="aux_layers")(
        model.params, cfg, tokens, aux_layers=aux_layers)
    np.testing.assert_allclose(np.asarray(h2), np.asarray(hidden), atol=2e-5, rtol=2e-5)
    # The taps reach |20|: float32 sums fused in another order move an entry by a few 1e-5.
    np.testing.assert_allclose(np.asarray(aux2), np.asarray(aux), atol=1e-4, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lm_head(model.params, h2)), np.asarray(logits), atol=5e-5, rtol=5e-5)


def test_draft_vocab_from_frequencies():
    stream = np.array([5, 5, 5, 2, 2, 9, 9, 9, 9, 1, 7, 7, 0])
    counts = token_counts(stream, 10)
    assert counts.tolist() == [1, 1, 2, 0, 0, 3, 0, 2, 0, 4]
    d2t, t2d, hot = build_draft_vocab(counts, 4)
    assert hot.tolist() == [2, 5, 7, 9]  # 9 (4x), 5 (3x), then 2 and 7 (2x each)
    assert (np.arange(4) + d2t).tolist() == hot.tolist() and d2t.dtype == np.int64
    assert np.flatnonzero(t2d).tolist() == [2, 5, 7, 9] and t2d.shape == (10,)
    _, _, tie = build_draft_vocab(counts, 5)  # ties (0 and 1, once each) go to the lower id
    assert tie.tolist() == [0, 2, 5, 7, 9]
    d2t, t2d, hot = build_draft_vocab(counts, 10)
    assert (d2t == 0).all() and t2d.all()
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(counts, 11)
    with pytest.raises(ValueError, match="outside"):
        token_counts(np.array([10]), 10)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_llama_round_trip(tmp_path, dtype):
    params = init_llama_params(TINY, 0)
    export_llama(str(tmp_path), params, TINY, dtype=dtype, bos_token_id=0, eos_token_id=0)
    model = js.load_model(str(tmp_path), dtype="float32", progress=False)
    assert model.config == TINY and model.eos_token_ids == (0,)
    tol = 0 if dtype == "float32" else 1e-2
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=tol)


def test_export_eagle3_round_trip(tmp_path):
    target = tiny_model()
    cfg = eagle3_config_for(TINY, draft_vocab_size=40, intermediate_size=96)
    params = dict(init_params(eagle_table(cfg), 2, scale=0.1), embed=target.params["embed"],
                  hot_ids=np.arange(0, 80, 2, dtype=np.int32))
    export_eagle3(str(tmp_path), params, cfg, target_num_layers=TINY.num_layers)
    draft = js.load_draft(str(tmp_path), target)
    assert draft.kind == "eagle3" and draft.config.model == cfg
    np.testing.assert_array_equal(np.asarray(draft.params["hot_ids"]), np.asarray(params["hot_ids"]))
    for key in ("fc", "norm", "lm_head"):
        np.testing.assert_array_equal(np.asarray(draft.params[key]), np.asarray(params[key]))
    for key, value in params["layer"].items():
        np.testing.assert_array_equal(np.asarray(draft.params["layer"][key]), np.asarray(value))
    assert draft.params["embed"] is target.params["embed"]  # shared, not exported


def test_export_eagle3_custom_taps(tmp_path):
    target = tiny_model()
    cfg = eagle3_config_for(TINY)
    import dataclasses

    cfg = dataclasses.replace(cfg, aux_layers=(1, 2, 3))
    export_eagle3(str(tmp_path), init_params(eagle_table(cfg), 2), cfg,
                  target_num_layers=TINY.num_layers)
    assert js.load_draft(str(tmp_path), target).config.aux_layers == (1, 2, 3)
