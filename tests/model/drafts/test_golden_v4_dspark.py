"""DeepSeek's own DSpark layout for DeepSeek-V4 (``mtp.{0..2}.*`` stages and ``dspark_*`` config fields in the
target's checkpoint) against an independent torch forward written from DeepSeek's documented one (goldens by
``scripts/goldens/deepseek_v4_dspark.py`` on the tiny V4 golden target, window 8):

* loading: detected by ``mtp.0.main_proj``, the stages, taps, block, noise token, Markov rank, confidence head;
* the block: the taps' context rows (main_x and every stage's K = V rows in its ring), the pre-norm hidden of
  the block, base logits, each slot's Markov bias and corrected logits, the greedy path, the confidence logits;
* the reference drafting loop's greedy tokens and per-step acceptance lengths (a ragged batch of three
  prompts, pages 1 and 16), and lossless greedy decoding under confidence scheduling;
* refusals by name: a missing ``dspark_*`` field, a compressed stage, a chain deeper than the block.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.kvcache.paging import AttentionInputs, PageTables, WindowTable
from jaxspec.model.config import ConfigError
from jaxspec.model.drafts.deepseek_v4_dspark import V4DSparkDraft
from jaxspec.model.drafts.dspark import markov_bias
from jaxspec.model.checkpoints.deepseek_v4_dspark import v4_dspark_config_from_hf
from tests.model.golden import GOLDEN

PATH = os.path.join(GOLDEN, "deepseek_v4_dspark")
TOL = dict(atol=2e-4, rtol=2e-4)


@functools.cache
def pair():
    target = js.load_model(PATH, dtype="float32", progress=False)
    return target, js.load_draft(PATH, target)


@functools.cache
def golden():
    return dict(np.load(os.path.join(PATH, "golden.npz")))


@functools.cache
def manifest():
    with open(os.path.join(PATH, "manifest.json")) as f:
        return json.load(f)


def test_loads_deepseeks_layout():
    target, d = pair()
    m = manifest()
    assert isinstance(d.config, V4DSparkDraft) and d.kind == "dspark"
    cfg = d.config.model
    assert (cfg.num_stages, cfg.block_size, cfg.mask_token_id, cfg.markov_rank) == (
        m["stages"], m["block_size"], m["noise_token"], m["markov_rank"])
    assert cfg.confidence_head and cfg.target == target.config
    assert d.config.aux_layers == tuple(l + 1 for l in m["target_layer_ids"])  # the layers' outputs
    assert d.config.kv_window == target.config.sliding_window


def block():
    """The golden's taps written as context at positions 0..C-1, then the block at C..C+Q-1."""
    _, d = pair()
    g, cfg = golden(), d.config.model
    taps = jnp.asarray(g["block/taps"]).reshape(len(g["block/taps"]), -1)[None]  # [C, n, N*H] -> [1, C, n*N*H]
    C, Q = taps.shape[1], cfg.block_size
    pool = d.config.create_pool(num_pages=2, page_size=32, dtype=jnp.float32)
    page = jnp.ones((1, 1), jnp.int32)
    tables = PageTables(full=page, window=WindowTable(pages=page, first=jnp.zeros(1, jnp.int32)))
    pos = jnp.arange(C, dtype=jnp.int32)[None]
    main_x, pool = d.config.write_context(d.params, taps, pos, pool,
                                          AttentionInputs.build(tables, jnp.zeros(1, jnp.int32), pos, 32))
    anchor = jnp.asarray([int(g["block/anchor"])], jnp.int32)
    tokens = jnp.concatenate([anchor[:, None], jnp.full((1, Q - 1), cfg.mask_token_id, jnp.int32)], axis=1)
    bpos = C + jnp.arange(Q, dtype=jnp.int32)[None]
    hidden, _ = d.config.block_forward(d.params, tokens, bpos, pool,
                                       AttentionInputs.build(tables, jnp.full((1,), C, jnp.int32), -jnp.ones_like(bpos), 32))
    return main_x, pool, hidden, anchor


def test_context_rows_and_block_outputs():
    """main_x of the taps, every stage's context rows of the last W positions in its ring, the block's
    hidden (hc_head of the last stage, before the norm) and the base logits."""
    _, d = pair()
    g, W = golden(), d.config.model.window
    main_x, pool, hidden, _ = block()
    np.testing.assert_allclose(np.asarray(main_x[0]), g["block/main_x"], **TOL)
    C = main_x.shape[1]
    ring = np.asarray(pool.window.kv)  # [S, slots, D]: page 1 holds positions 0..31 at slots 32..63
    np.testing.assert_allclose(ring[:, 32 + C - W:32 + C], g["block/context_rows"], **TOL)
    np.testing.assert_allclose(np.asarray(hidden[0]), g["block/hidden"], **TOL)
    np.testing.assert_allclose(np.asarray(d.config.base_logits(d.params, hidden)[0]), g["block/base_logits"], **TOL)


def test_markov_path_and_confidence():
    """The greedy path through the Markov head, each slot's bias (W2 W1[prev]) and corrected logits, and
    the confidence head's logits on [h, W1[prev]] along that path."""
    _, d = pair()
    g, cfg = golden(), d.config.model
    _, _, hidden, anchor = block()
    path = g["block/path"]
    tokens, _ = d.config.candidates(d.params, d.config.proposal_hidden(hidden, None), anchor, 1)
    np.testing.assert_array_equal(np.asarray(tokens[0, :, 0]), path)
    _, corrected = d.config.slot_logits(d.params, hidden, anchor, lambda t, logits: jnp.asarray(path[t:t + 1]))
    np.testing.assert_allclose(np.asarray(corrected[0]), g["block/logits"], **TOL)
    prev = np.concatenate([[int(anchor[0])], path[:-1]])
    for k in range(cfg.block_size):
        bias, _, _ = markov_bias(d.params, cfg, jnp.asarray(prev[k:k + 1]), hidden[:, k], None)
        np.testing.assert_allclose(np.asarray(bias[0]), g["block/markov_bias"][k], **TOL)
    conf = d.config.confidence(d.params, hidden, anchor, jnp.asarray(path)[None])
    np.testing.assert_allclose(np.asarray(conf[0]), 1 / (1 + np.exp(-g["block/confidence"])), **TOL)


def _generate(spec, page, max_batch=4, **engine):
    target, d = pair()
    g = dict(np.load(os.path.join(GOLDEN, "deepseek_v4", "golden.npz")))
    prompts = [g[f"prompt_{i}"].tolist() for i in range(3)]
    out = js.generate(target, prompts, draft=d, spec=spec, sampling=js.SamplingParams(max_new_tokens=24),
                      progress=False, engine=js.EngineConfig(page_size=page, max_batch=max_batch, max_seq_len=96,
                                                             check_pages=True, **engine))
    for i in range(3):
        assert out.token_ids[i] == g[f"greedy_{i}"].tolist(), i  # the target's own greedy tokens
    assert out.kv_pages_free == out.kv_pages_total
    return out


@pytest.mark.parametrize("page", [1, 16])
def test_reference_tokens_and_acceptance_lengths(page):
    """A chain of the block's 4 slots on a ragged batch of three prompts: the reference loop's tokens and
    the accept length of every step before the last (both run whole blocks; the output is cut at 24)."""
    out = _generate(js.SpecConfig.chain(4), page)
    g = golden()
    for i, s in enumerate(out.stats):
        want = g[f"generate/p{i}/accept"].tolist()
        assert list(s.accept_lens)[:-1] == want[:len(s.accept_lens) - 1], i
        assert len(want) - 1 <= len(s.accept_lens) <= len(want), i  # the prefill's token: one step fewer at most
    assert 1 < np.mean(np.concatenate([s.accept_lens for s in out.stats])) < 4  # partly accepted


def test_confidence_scheduling_is_lossless():
    """A confidence-scheduled chain (each row verifies the prefix its confidence head predicts, threshold
    0.5), its requests preempted every 2 steps and resumed by prefill: the target's greedy tokens, every
    page of both pools back, fewer tokens verified. (Trees of this draft run through the same block
    proposer as every DSpark's, tested in tests/spec/test_dspark.py; the V4 target's tree verify in
    tests/spec/test_v4_spec.py.)"""
    out = _generate(js.SpecConfig.chain(4, confidence_threshold=0.5), 4, preempt_every=2)
    assert sum(s.preemptions for s in out.stats) > 0
    verified = np.concatenate([s.verify_lens for s in out.stats])
    assert verified.min() < 5 and (verified <= 5).all(), verified


def test_chain_deeper_than_the_block_is_refused():
    target, d = pair()
    with pytest.raises(ValueError, match="at most 4 draft tokens"):
        js.generate(target, [[1, 2, 3]], draft=d, spec=js.SpecConfig.chain(5),
                    sampling=js.SamplingParams(max_new_tokens=2), progress=False)


@pytest.mark.parametrize("edit,match", [
    (lambda raw: raw.pop("dspark_block_size"), "dspark_block_size"),
    (lambda raw: raw.update(dspark_noise_token_id=-1), "dspark_noise_token_id"),
    (lambda raw: raw.update(dspark_target_layer_ids=[]), "dspark_target_layer_ids"),
    (lambda raw: raw.update(n_mtp_layers=2), "n_mtp_layers 2"),
    (lambda raw: raw.update(compress_ratios=[0, 0, 0, 0, 0, 4, 0]), "only sliding-window"),
], ids=["no-block-size", "bad-noise", "no-taps", "stage-count", "compressed-stage"])
def test_bad_config_is_refused_by_name(edit, match):
    target, d = pair()
    with open(os.path.join(PATH, "config.json")) as f:
        raw = json.load(f)
    edit(raw)
    names = {f"mtp.{s}.attn_norm.weight" for s in range(3)} | {"mtp.0.main_proj.weight"}
    with pytest.raises(ConfigError, match=match):
        v4_dspark_config_from_hf(raw, names, target.config, "config.json")


def test_taps_outside_the_target_are_refused(tmp_path):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(PATH, name), tmp_path / name)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["dspark_target_layer_ids"] = [1, 2, 4]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    target, _ = pair()
    with pytest.raises(ValueError, match=r"dspark_target_layer_ids \[1, 2, 4\]"):
        js.load_draft(str(tmp_path), target)


def test_release_form_with_fp8_and_fp4_stages(tmp_path):
    """The form DeepSeek releases: published names, the legacy config (``compress_ratios`` listing the stages
    after the target's layers), the stages' dense linears FP8 with ue8m0 blocks and their routed experts FP4:
    the draft loads with every quantized weight equal to code x scale, the rest as in the golden."""
    from safetensors.numpy import save_file

    from jaxspec.model.checkpoints.checkpoint import CheckpointTensors
    from tests.model.targets.test_deepseek_v4 import BLOCK, legacy_form, published_from_mixed, quantize_as_released

    ckpt = CheckpointTensors(PATH)
    tensors, want = {}, {}
    for name in ckpt.keys():
        x = ckpt.get(name)
        if not quantize_as_released(name, x, "mtp.", tensors, want):
            tensors[published_from_mixed(name)] = x.astype(np.int32) if x.dtype == np.int64 else x
    with open(os.path.join(PATH, "config.json")) as f:
        raw = json.load(f)
    config = {**legacy_form(raw), "expert_dtype": "fp4",
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK],
                                      "scale_fmt": "ue8m0"}}
    config["compress_ratios"] = config["compress_ratios"][:-1] + [0] * 3  # the target's layers, then the stages
    config.pop("n_mtp_layers")  # the HF config leaves it out: the stages found count
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    target = js.load_model(str(tmp_path), dtype="float32", progress=False)
    d = js.load_draft(str(tmp_path), target)
    assert d.config.model.num_stages == 3
    st = d.params["stages"]["layers"]
    for name, got in [("mtp.0.attn.wq_b.weight", st["wq_b"][0]), ("mtp.2.attn.wo_b.weight", st["wo_b"][2]),
                      ("mtp.1.ffn.shared_experts.w2.weight", st["shared_down"][1]),
                      ("mtp.1.ffn.experts.2.w1.weight", st["experts_gate"][1, 2]),
                      ("mtp.2.ffn.experts.0.w2.weight", st["experts_down"][2, 0])]:
        np.testing.assert_array_equal(np.asarray(got).T, want[name], err_msg=name)
        assert np.abs(np.asarray(got).T - ckpt.get(name)).max() > 0, name  # it really was quantized
    _, golden_draft = pair()
    np.testing.assert_array_equal(np.asarray(d.params["markov"]["w2"]), np.asarray(golden_draft.params["markov"]["w2"]))
