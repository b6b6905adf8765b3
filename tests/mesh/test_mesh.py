"""Tensor and data parallelism on 4 virtual CPU devices, in a subprocess (``run_cases.py``) so
the rest of the suite keeps one device. Every speculative greedy run on a mesh equals plain
greedy on one device (float32, ragged batch of 3), and the compiled decode step has exactly
the collectives Megatron's layout predicts, with no all-gather of weights or KV pools."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.background import ROOT, Job, exhaustive_run
from tests.mesh.run_cases import CASES, EXHAUSTIVE

pytestmark = pytest.mark.slow

# Started when collection selects this module (tests/conftest.py): it runs beside the rest of the suite,
# the cases of run_cases.EXHAUSTIVE only under ``pytest --exhaustive`` (their tests are marked so).
RUN = [name for name in CASES if exhaustive_run() or name not in EXHAUSTIVE]
BACKGROUND_JOB = Job([sys.executable, "-m", "tests.mesh.run_cases", *RUN], timeout=1500, env=dict(
    os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip(),
    JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))


@pytest.fixture(scope="module")
def results() -> dict:
    proc = BACKGROUND_JOB.result()
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[r["case"]] = r
    assert out, f"the mesh worker printed nothing (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return out


def case(results, name) -> dict:
    r = results.get(name)
    assert r is not None, f"case {name} did not run"
    assert r["ok"], r.get("error")
    return r


def cases(*params):
    """Parameter tuples, their first item a case name; the exhaustive cases marked so."""
    return [pytest.param(*p, marks=pytest.mark.exhaustive) if p[0] in EXHAUSTIVE else p for p in params]


@pytest.mark.parametrize("name,kind", cases(
    ("llama_tp4_tree_eagle3", "eagle3"),  # TP=4 over 2 KV heads (replicated), tree, page 16
    ("llama_tp4_tree_perturbed", "standalone"),  # the same with a partly accepted draft: compaction moves KV
    ("qwen2_tp2_chain_standalone", "standalone"),  # Qwen2 q/k/v bias, TP=2, chain, page 1
    ("deepseek_moe_tp2_tree_mtp", "mtp"),  # MLA + MoE (experts split) + its MTP layer, TP=2, tree, page 16
    # DSA: index_topk 8 over contexts to 64, the indexer replicated on both shards, MTP with its own indexer
    ("deepseek_v32_tp2_tree_mtp", "mtp"),
    ("llama_tp2_dp2_chain", "standalone"),  # TP=2 x DP=2: rows and pages split over data, chain, page 1
    # the same mesh with n-gram drafting (no params; history per data shard), in a small pool per data shard
    # with forced preemption and the prefix cache (prompts behind a shared prefix)
    ("llama_tp2_dp2_ngram", "ngram"),
    ("qwen3_tp2_chain_dflash", "dflash"),  # a DFlash block draft (replicated) over a TP=2 Qwen3 target, page 16
    # DSpark with its own 192-token vocabulary (d2t), confidence-scheduled, page 1
    ("qwen3_tp2_chain_dspark", "dspark"),
    # Sliding-window targets, both KV pools split by KV head (Gemma 4's full layers: 1 KV head, repeated),
    # every request running past the window (goldens: tests/data/golden/sliding_window):
    ("gemma4_tp2_tree_assistant_plain", "frozen_kv"),  # the plain-head assistant, tree, page 16
    ("mistral_swa_tp2_tree_perturbed", "standalone"),  # all layers sliding (a zero-layer full part), page 16
    # TP=2 x DP=2: each data shard's rows take window pages from the shard's own allocator
    ("gemma4_tp2_dp2_chain_assistant", "frozen_kv"),  # the assistant over split pools, chain, page 16
    ("gemma4_tp2_dp2_tree_perturbed", "standalone"),  # partly accepted tree, compaction per data shard, page 1
    ("gemma4_moe_tp2_tree_perturbed", "standalone"),  # Gemma 4 with MoE blocks: its 8 experts split 4 + 4, page 16
    # the same through the grouped-matmul kernel: each shard's tiles hold its own experts' rows, page 1
    ("gemma4_moe_tp2_chain_grouped_kernel", "standalone"),
    # the E2B kind: per-layer inputs (their table split by vocabulary rows), K/V-sharing layers reading the
    # split pools of earlier layers, double-wide MLPs split like the others; a partly accepted tree, page 1
    ("gemma4_ple_tp2_tree_perturbed", "standalone"),
    # A hybrid (Qwen3.5) target: Gated DeltaNet heads and their recurrent state split over model, rows over data
    ("qwen3_5_tp2_tree_perturbed", "standalone"),  # a hybrid draft's tree, partly accepted, page 16
    ("qwen3_5_tp2_dp2_chain_mtp", "qwen_mtp"),  # its MTP layer, TP=2 x DP=2, page 1
    # DeepSeek-V4 (CSA / sliding / HCA layers, hyper-connections): query heads and experts split, the K = V head,
    # compressors and compressed pools whole on both shards; its MTP layer, tree, page 16
    ("deepseek_v4_tp2_tree_mtp", "v4_mtp"),
    ("deepseek_v4_tp2_chain_dspark", "dspark"),  # DeepSeek's DSpark stages stored with it, confidence-scheduled
))
def test_speculative_greedy_on_a_mesh_equals_one_device(results, name, kind):
    r = case(results, name)
    assert r["draft_kind"] == kind
    assert r["plain_equal"] in (None, True), "plain greedy on the mesh differs from one device"
    assert r["equal"], "speculative greedy on the mesh differs from plain greedy on one device"
    assert r["pages_back"]
    assert r["wo_spec"] == "P(None, 'model', None)"  # row-parallel output projection, stacked over layers
    if name.endswith("_perturbed"):
        assert 1.3 < r["mean_accept"] < 4.0, r["mean_accept"]  # trees accepted partly: paths get compacted
    if name == "llama_tp2_dp2_ngram":
        assert r["preemptions"] > 0 and r["cached"] > 0, r
    if "window_pool_spec" in r:  # pages over data, KV heads over model; every window page came back
        assert r["window_pool_spec"] == "P(None, 'data', 'model', None)"
        assert r["window_pages_back"]
    if name.startswith("gemma4_moe"):  # both layer types' experts split over model by expert
        assert r["experts_specs"] == ["P(None, 'model', None, None)"], r["experts_specs"]
    if "state_spec" in r:  # rows over data, value heads over model
        assert r["state_spec"] == "P(None, 'data', 'model', None, None)"
    if name == "llama_tp2_dp2_ngram":
        assert r["mean_accept"] > 1.0, r["mean_accept"]  # some looked-up tokens verified and accepted on the mesh


# Collectives of one compiled decode step at TP=2, batch 2 (the layers run in a scan, so each
# layer group's body appears once):
#   per layer: 1 all-reduce after attention (row-parallel o_proj) + 1 after the MLP (row-parallel
#   down_proj; for MoE the routed experts' psum and the shared experts' down_proj fuse into one);
#   embedding: 1 all-reduce (vocab-parallel lookup: one shard holds each row);
#   greedy head: 2 all-gathers of [batch, shards] (each shard's max logit and its index), never
#   the logits.
EXPECTED = {
    "collectives_llama": dict(groups=1),  # 7 Llama layers in one scan
    "collectives_deepseek": dict(groups=2),  # a dense layer group and a MoE layer group
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_collectives_are_those_of_the_megatron_layout(results, name):
    r = case(results, name)
    groups = EXPECTED[name]["groups"]
    assert r["counts"] == {"all-reduce": 2 * groups + 1, "all-gather": 2, "reduce-scatter": 0, "all-to-all": 0,
                           "collective-permute": 0}
    assert sorted(r["all_gather_shapes"]) == ["f32[2,2]{0,1}", "s32[2,2]{0,1}"]


def test_gemma4_assistant_on_a_mesh_matches_hf(results):
    """The HF-layout assistant given a TP=2 target's split pools: logits and returned hidden
    against HF (tests/model/targets/test_golden_sliding.py's check), its own weights whole on every shard."""
    r = case(results, "gemma4_assistant_tp2_golden")
    assert r["steps"] == 4
    assert all("model" not in spec for spec in r["draft_specs"]), r["draft_specs"]
    assert r["embed_spec"] == "P('model', None)"  # the target's vocab-parallel embedding, read per shard


def test_forward_sequence_on_a_mesh_matches_hf(results):
    """``forward_sequence`` of a Llama placed on TP=2 x DP=2 (its per-shard embedding lookup and
    attention need a compiled program under the mesh): logits, final hidden state and EAGLE-3 taps
    against HF, each prompt alone and the three as one batch."""
    r = case(results, "llama_tp2_dp2_forward_sequence")
    assert r["batches"] == 4


def test_window_pages_are_cached_per_data_shard_on_a_mesh(results):
    """Gemma 4 on TP=2 x DP=2 with the prefix cache (tests/engine/test_prefix_cache_window.py's system
    prompt and questions): the third question hits the second's window checkpoint, outputs equal to
    one device without the cache."""
    r = case(results, "gemma4_tp2_dp2_window_cache")
    assert r["shards"] == 2 and r["equal"], r
    assert r["cached"] == [0, 0, 24] and r["checkpoints"] > 0 and r["window_hits"] > 0, r


def test_recurrent_state_snapshots_per_data_shard_on_a_mesh(results):
    """Qwen3.5 + MTP on TP=2 x DP=2 with the prefix cache (tests/engine/test_prefix_cache_recurrent.py's
    system prompt and questions): the third question hits the snapshot the second saved; the snapshot
    slots split over data and their heads over model like the rows' state; outputs equal one device
    without the cache."""
    r = case(results, "qwen3_5_tp2_dp2_snapshots")
    assert r["shards"] == 2 and r["equal"], r
    assert r["cached"] == [0, 0, 64] and r["hits"] == 1 and r["written"] >= 3, r
    assert r["snapshot_spec"] == "P(None, 'data', 'model')", r


def test_compressed_kv_is_cached_per_data_shard_on_a_mesh(results):
    """DeepSeek-V4 + DSpark on TP=2 x DP=2 with the prefix cache (tests/engine/test_prefix_cache_compressed.py's
    system prompt and questions): the third question hits inside an entry page of each rate and copies
    it; outputs equal one device without the cache."""
    r = case(results, "deepseek_v4_tp2_dp2_cache")
    assert r["shards"] == 2 and r["equal"], r
    assert r["cached"] == [0, 0, 80] and r["copies"] == [1, 1], r


def test_bad_meshes_are_refused_before_device_work(results):
    r = case(results, "errors")
    assert "= 8 devices, but only 4 are present" in r["too_many_devices"]
    assert "needs jax.distributed.initialize() on every host before make_mesh" in r["too_many_devices"]
    assert "num_attention_heads 4 is not divisible by tensor_parallel 3" in r["heads_not_divisible"]
    assert "vocab_size" not in r["heads_not_divisible"]  # any vocabulary is padded
    # The exact mode on TP=2: the all-reduce's order is the collective's, so it is refused.
    assert "EngineConfig(exact=True) runs on one device" in r["exact_on_a_mesh"]


@pytest.mark.parametrize("name,runs", cases(
    ("odd_vocab_tp2_dp2", {"plain", "sampled", "eagle3_d2t_chain", "eagle3_d2t_sampled"}),
    ("odd_vocab_tp4", {"plain", "sampled", "eagle3_tree", "standalone_tree", "dspark_chain"}),
))
def test_an_odd_vocabulary_is_padded_on_a_mesh(results, name, runs):
    """Vocabulary 251 split over 2 and 4 model shards: embedding and head padded to 256 rows
    (config.vocab_size stays 251); greedy, sampled and speculative output (EAGLE-3 over a d2t
    vocabulary, greedy and sampled; EAGLE-3 with its own embedding and head, a standalone draft's
    tree) and raw
    log-probabilities equal one device's, so the padding never takes probability."""
    r = case(results, name)
    assert (r["vocab_size"], r["padded"], r["embed_shape"]) == (251, 256, [256, 32])
    assert r["embed_spec"] == "P('model', None)"
    assert r["equal"] == dict.fromkeys(runs, True), r["equal"]
    assert r["logprob_err"] < 1e-4 and r["top_ids_equal"], r
