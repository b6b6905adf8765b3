"""``jaxspec train-draft`` end to end on a tiny random target saved as an HF checkpoint:
train a few steps, resume, export, load with ``load_draft``, and decode losslessly."""

import json

import pytest

import jaxspec as js
from jaxspec.cli import main
from tests.train.tiny_hf import make_tiny_hf, make_tiny_hybrid_hf

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_draft")
    target_dir, corpus = make_tiny_hf(root)
    return root, corpus, target_dir


def test_train_resume_export_load_lossless(setup):
    root, corpus, target_dir = setup
    out, run = root / "head", root / "run"
    argv = ["train-draft", "--target", str(target_dir), "--corpus", str(corpus), "--out", str(out),
            "--run-dir", str(run), "--batch", "2", "--seq-len", "32", "--ttt-steps", "3", "--eval-every", "2",
            "--eval-prompts", "1", "--prompt-tokens", "8", "--eval-max-new-tokens", "8",
            "--draft-vocab-size", "200", "--heldout-percent", "40", "--self-distill", "1"]
    assert main(argv + ["--steps", "2"]) == 0
    log = (run / "log.txt").read_text()
    assert "held-out acc/step" in log and "mean accept length" in log
    assert "self-distillation: 1 windows" in log and (run / "self_distill.npy").exists()
    assert main(argv + ["--steps", "3"]) == 0  # resumes at step 2, trains one more
    assert "resumed" in (run / "log.txt").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and len(summary["final"]["eval_acc"]) == 3

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 200
    target = js.load_model(str(target_dir), dtype="float32", progress=False)
    draft = js.load_draft(str(out), target)
    assert draft.kind == "eagle3" and draft.config.aux_layers == (2, 3, 4)
    # The trainer's report shapes (chain S=5, one 8-token prompt, 8 new tokens), so the
    # speculative program compiled for the report is reused.
    prompts = [target.tokenizer.encode("def add(a, b):\n    return")[:8]]
    sampling = js.SamplingParams(max_new_tokens=8, stop_token_ids=())
    engine = js.EngineConfig(page_size=16, max_batch=1, max_seq_len=32)
    plain = js.generate(target, prompts, sampling=sampling, engine=engine)
    spec = js.generate(target, prompts, draft=draft, spec=js.SpecConfig.chain(5), sampling=sampling, engine=engine)
    assert spec.token_ids == plain.token_ids and len(plain.token_ids[0]) == 8


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_train_draft_for_a_hybrid_target(tmp_path, method):
    """``train-draft`` on a Qwen3.5 hybrid target (Gated DeltaNet layers among the taps): it trains on
    the serving forward's features, exports, loads for the target and decodes losslessly."""
    target_dir, corpus = make_tiny_hybrid_hf(tmp_path)
    out = tmp_path / "draft"
    argv = ["train-draft", "--method", method, "--target", str(target_dir), "--corpus", str(corpus),
            "--out", str(out), "--run-dir", str(tmp_path / "run"), "--batch", "2", "--seq-len", "32",
            "--eval-every", "2", "--eval-prompts", "1", "--prompt-tokens", "8", "--eval-max-new-tokens", "8",
            "--heldout-percent", "40", "--steps", "2"]
    argv += (["--ttt-steps", "3", "--draft-vocab-size", "100"] if method == "eagle3" else
             ["--block-size", "4", "--draft-layers", "1", "--num-anchors", "4", "--target-layer-ids", "0,4"])
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    target = js.load_model(str(target_dir), dtype="float32", progress=False)
    draft = js.load_draft(str(out), target)
    if method == "eagle3":  # taps: layers 1 and 2 are Gated DeltaNet, 3 (index 2) full attention
        assert config["draft_vocab_size"] == 100 and draft.config.aux_layers == (2, 3, 3)
    else:
        assert config["dflash_config"]["target_layer_ids"] == [0, 4] and draft.config.aux_layers == (1, 5)
    prompts = [target.tokenizer.encode("def add(a, b):\n    return")[:8]]
    sampling = js.SamplingParams(max_new_tokens=8, stop_token_ids=())
    engine = js.EngineConfig(page_size=16, max_batch=1, max_seq_len=32)
    spec = js.SpecConfig.chain(5 if method == "eagle3" else 3)  # the trainer's report shapes: reused
    plain = js.generate(target, prompts, sampling=sampling, engine=engine)
    out_spec = js.generate(target, prompts, draft=draft, spec=spec, sampling=sampling, engine=engine)
    assert out_spec.token_ids == plain.token_ids and len(plain.token_ids[0]) == 8
