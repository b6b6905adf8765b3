"""DFlash training: the block-parallel training forward equals the serving block forward (same
context, same block, through the paged pool) for every anchor; the loss weighs later block
positions less; ``jaxspec train-draft --method dflash`` trains, resumes, exports the published
layout, and the export loads and decodes losslessly."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.cli import main
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.drafts.dflash import DFlashConfig, dflash_draft
from jaxspec.model.checkpoints.dflash import init_dflash_params
from jaxspec.train.dflash_method import block_train_forward, position_weights, sample_anchors
from tests.conftest import tiny_model
from tests.train.tiny_hf import make_tiny_hf

COMMON = dict(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=96,
              num_target_layers=4, block_size=5, mask_token_id=95)
CONFIGS = {
    "dflash": DFlashConfig(version=1, num_layers=2, target_layer_ids=(1, 3), **COMMON),
    "mixed_causal_sliding": DFlashConfig(version=1, num_layers=3, target_layer_ids=(0, 2), layer_windows=(None, 3, None),
                                         layer_causal=(True, True, False), **COMMON),
    "dflash2": DFlashConfig(version=2, num_layers=2, target_layer_ids=(1, 2, 3), layer_windows=(4, 4),
                            layer_causal=(False, False), conv_kernel_size=3, conv_group_size=16, selector_rank=4,
                            selector_top_k=3, **COMMON),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_forward_equals_serving_block_forward(name):
    cfg = CONFIGS[name]
    target = tiny_model()
    d = dflash_draft(cfg, init_dflash_params(cfg, 3, target.params, scale=0.3))
    T = 12
    rng = np.random.default_rng(0)
    features = jnp.asarray(rng.standard_normal((1, T, cfg.feature_size)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 90, (1, T + 1)), jnp.int32)
    anchors = jnp.asarray([[1, 7, 11, 4]], jnp.int32)
    trained = block_train_forward(d.params, cfg, features, tokens, anchors)  # [1, nA, Q, H]
    Q, page = cfg.block_size, 4
    for i, a in enumerate(np.asarray(anchors[0]).tolist()):
        pool = d.config.create_pool(num_pages=1 + -(-(T + Q) // page), page_size=page, dtype=jnp.float32)
        table = jnp.arange(1, pool.num_slots // page, dtype=jnp.int32)[None]
        pos = jnp.arange(a, dtype=jnp.int32)[None]
        _, pool = d.config.write_context(d.params, features[:, :a], pos, pool,
                                         AttentionInputs.build(table, jnp.zeros(1, jnp.int32), pos, page))
        block = jnp.concatenate([tokens[:, a:a + 1], jnp.full((1, Q - 1), cfg.mask_token_id, jnp.int32)], axis=1)
        bpos = a + jnp.arange(Q, dtype=jnp.int32)[None]
        served, _ = d.config.block_forward(d.params, block, bpos, pool,
                                           AttentionInputs.build(table, jnp.full((1,), a, jnp.int32), bpos, page))
        np.testing.assert_allclose(np.asarray(trained[0, i]), np.asarray(served[0]), atol=2e-5, rtol=2e-5)


def test_position_weights_and_anchors():
    w = position_weights(8, 3.0)
    assert w.shape == (7,) and w[0] == 1.0 and np.all(np.diff(w) < 0)
    np.testing.assert_allclose(w[3], np.exp(-1.0), rtol=1e-6)
    a = sample_anchors(np.random.default_rng(0), 64, 16, seq_len=32, block_size=8)
    assert a.min() >= 1 and a.max() <= 32 - 8 + 2 and a.shape == (64, 16)
    with pytest.raises(ValueError, match="too short"):
        sample_anchors(np.random.default_rng(0), 1, 1, seq_len=4, block_size=8)


def test_train_resume_export_load_lossless(tmp_path):
    target_dir, corpus = make_tiny_hf(tmp_path)
    out, run = tmp_path / "dflash", tmp_path / "run"
    argv = ["train-draft", "--method", "dflash", "--block-size", "4", "--draft-layers", "2", "--num-anchors", "4",
            "--target", str(target_dir), "--corpus", str(corpus), "--out", str(out), "--run-dir", str(run),
            "--batch", "2", "--seq-len", "32", "--eval-every", "2", "--eval-prompts", "1", "--prompt-tokens", "8",
            "--eval-max-new-tokens", "8", "--heldout-percent", "40", "--lr", "1e-2", "--warmup", "1"]
    assert main(argv + ["--steps", "2"]) == 0
    log = (run / "log.txt").read_text()
    assert "DFlash draft: 2 layers" in log and "held-out acc/position" in log
    assert "generate chain S=3 mean accept length" in log
    assert main(argv + ["--steps", "3"]) == 0
    assert "resumed" in (run / "log.txt").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and len(summary["final"]["eval_acc"]) == 3
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["block_size"] == 4
    assert config["num_target_layers"] == 7 and config["dflash_config"]["target_layer_ids"] == [1, 4]
    target = js.load_model(str(target_dir), dtype="float32", progress=False)
    draft = js.load_draft(str(out), target)
    assert draft.kind == "dflash" and draft.block_size == 4 and draft.config.aux_layers == (2, 5)
    prompts = [target.tokenizer.encode("def add(a, b):\n    return")[:8]]
    sampling = js.SamplingParams(max_new_tokens=8, stop_token_ids=())
    engine = js.EngineConfig(page_size=16, max_batch=1, max_seq_len=32)
    plain = js.generate(target, prompts, sampling=sampling, engine=engine)
    spec = js.generate(target, prompts, draft=draft, spec=js.SpecConfig.chain(3), sampling=sampling, engine=engine)
    assert spec.token_ids == plain.token_ids and len(plain.token_ids[0]) == 8


def test_dflash_args_are_checked_before_training(tmp_path, capsys):
    """Checked before the target is read (the target directory here is empty)."""
    assert main(["train-draft", "--method", "dflash", "--block-size", "8", "--seq-len", "4", "--target",
                 str(tmp_path), "--corpus", str(tmp_path), "--out", str(tmp_path / "o"), "--steps", "1"]) == 2
    assert "error: --seq-len 4 must be >= --block-size 8" in capsys.readouterr().err

