"""DSpark training: the teacher-forced training forward (backbone, Markov bias from the true tokens,
confidence) equals serving's block forward and slot-by-slot drafting along the same tokens, for
every Markov head and either ``sample_from_anchor``; ``jaxspec train-draft --method dspark``
trains, resumes, exports the ``speculators`` layout, and the export loads and decodes losslessly,
with and without confidence scheduling."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.cli import main
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.drafts.dflash import DFlashConfig
from jaxspec.model.drafts.dspark import dspark_draft
from jaxspec.model.checkpoints.speculators import init_dspark_params
from jaxspec.train.dflash_method import block_train_forward
from jaxspec.train.dspark_method import dspark_config_for, slot_prev_tokens, teacher_forced_logits
from tests.conftest import tiny_model
from tests.train.tiny_hf import make_tiny_hf

BASE = DFlashConfig(version=1, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16,
                    vocab_size=96, num_target_layers=4, block_size=4, mask_token_id=95, num_layers=2,
                    target_layer_ids=(1, 3))
CONFIGS = {
    "vanilla_anchor": dspark_config_for(BASE, markov_rank=8, markov_head_type="vanilla"),
    "rnn_no_anchor": dspark_config_for(BASE, markov_rank=8, markov_head_type="rnn", sample_from_anchor=False),
    "gated_confidence_on_h": dspark_config_for(BASE, markov_rank=4, markov_head_type="gated",
                                               confidence_with_markov=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_teacher_forced_training_equals_serving(name):
    cfg = CONFIGS[name]
    target = tiny_model()
    d = dspark_draft(cfg, init_dspark_params(cfg, 3, target.params, scale=0.3))
    T = 12
    rng = np.random.default_rng(0)
    features = jnp.asarray(rng.standard_normal((1, T, cfg.feature_size)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 90, (1, T + 1)), jnp.int32)
    anchors = jnp.asarray([[1, 7, 8, 4]], jnp.int32)
    out = block_train_forward(d.params, cfg, features, tokens, anchors)[0]  # [nA, Q, H]
    prev = slot_prev_tokens(tokens, anchors, cfg)[0]
    trained, conf = teacher_forced_logits(d.params, cfg, out, prev)  # [nA, S, V], [nA, S]
    Q, s, page = cfg.block_size, cfg.first_draft_slot, 4
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
        truth = tokens[0, a + 1:a + 1 + Q - s]  # what each drafting slot predicts: chosen as the serving path
        _, logits = d.config.slot_logits(d.params, served, tokens[:, a], lambda t, _: truth[t:t + 1])
        np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(trained[i]), atol=3e-5, rtol=3e-5)
        served_conf = d.config.confidence(d.params, served, tokens[:, a], truth[None])
        np.testing.assert_allclose(np.asarray(served_conf[0]), np.asarray(1 / (1 + jnp.exp(-conf[i]))), atol=3e-5)


def test_train_resume_export_load_lossless(tmp_path):
    target_dir, corpus = make_tiny_hf(tmp_path)
    out, run = tmp_path / "dspark", tmp_path / "run"
    argv = ["train-draft", "--method", "dspark", "--block-size", "4", "--draft-layers", "1", "--num-anchors", "4",
            "--markov-rank", "8", "--markov-head", "gated", "--target", str(target_dir), "--corpus", str(corpus),
            "--out", str(out), "--run-dir", str(run), "--batch", "2", "--seq-len", "32", "--eval-every", "2",
            "--eval-prompts", "1", "--prompt-tokens", "8", "--eval-max-new-tokens", "8", "--heldout-percent", "40",
            "--lr", "1e-2", "--warmup", "1"]
    assert main(argv + ["--steps", "2"]) == 0
    log = (run / "log.txt").read_text()
    assert "DSpark draft: 1 layers" in log and "gated Markov head of rank 8" in log and "confidence error" in log
    assert "generate chain S=4 mean accept length" in log  # every slot drafts: 4 tokens from a block of 4
    assert main(argv + ["--steps", "3"]) == 0
    assert "resumed" in (run / "log.txt").read_text()
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["markov_head_type"] == "gated"
    assert config["aux_hidden_state_layer_ids"] == [4]  # HF hidden_states index: the output of layer 3
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    target = js.load_model(str(target_dir), dtype="float32", progress=False)
    draft = js.load_draft(str(out), target)
    assert draft.kind == "dspark" and draft.config.model.confidence_head and draft.config.aux_layers == (4,)
    prompts = [target.tokenizer.encode("def add(a, b):\n    return")[:8]]
    sampling = js.SamplingParams(max_new_tokens=8, stop_token_ids=())
    engine = js.EngineConfig(page_size=16, max_batch=1, max_seq_len=32)
    plain = js.generate(target, prompts, sampling=sampling, engine=engine)
    for c in (None, 0.5):
        spec = js.generate(target, prompts, draft=draft, spec=js.SpecConfig.chain(4, confidence_threshold=c),
                           sampling=sampling, engine=engine)
        assert spec.token_ids == plain.token_ids and len(plain.token_ids[0]) == 8
    # --init-from: a fresh run starting from that draft's arrays (all of them: the same shapes)
    warm = argv[:argv.index("--out")] + ["--out", str(tmp_path / "warm"), "--run-dir", str(tmp_path / "run2"),
                                         "--init-from", str(out)] + argv[argv.index("--batch"):]
    assert main(warm + ["--steps", "1"]) == 0
    log = (tmp_path / "run2" / "log.txt").read_text()
    m = re.search(r"initialized (\d+) of (\d+) arrays from (\S+)", log)
    assert m and m[1] == m[2] and int(m[1]) > 10 and m[3] == str(out), log


def test_dspark_args_are_checked_before_training(tmp_path, capsys):
    """Checked before the target is read (the target directory here is empty)."""
    base = ["train-draft", "--method", "dspark", "--target", str(tmp_path), "--corpus", str(tmp_path), "--out",
            str(tmp_path / "o"), "--steps", "1"]
    assert main(base + ["--block-size", "8", "--seq-len", "8"]) == 2
    assert "error: --seq-len 8 must be >= --block-size + 1 (9) when every slot drafts" in capsys.readouterr().err
    assert main(base + ["--draft-vocab-size", "64"]) == 2
    assert "DSpark training keeps the target's vocabulary" in capsys.readouterr().err
