"""Speculative sampling at temperature > 0 is exact: the joint distribution of the first
generated tokens matches the target's, computed by enumeration on a tiny vocabulary.

Many independent samples come cheaply from one batch of identical prompts (each row has
its own PRNG key). A deliberately biased sampler (on rejection, resample from p instead of
norm(max(0, p - q))) must fail the same test, so the test can fail."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxspec as js
import jaxspec.spec.shape as shape_mod  # where acceptance calls the sampler
import jaxspec.spec.step as step_mod  # where verify applies the controls
from jaxspec.spec import verify as verify_mod
from jaxspec.sampling.distributions import RowSampling, sample_with_uniform, target_probs
from jaxspec.model.targets.llama_config import LlamaConfig
from jaxspec.model.drafts import eagle_draft, standalone_draft
from jaxspec.model.drafts.eagle import eagle3_config_for
from jaxspec.model.checkpoints.eagle import init_eagle_params
from jaxspec.model.targets import Model
from jaxspec.model.config import RopeConfig
from jaxspec.model.checkpoints.hybrid import init_hybrid_params
from jaxspec.model.targets import forward_sequence
from jaxspec.model.targets.hybrid_config import FULL, LINEAR, GatedDeltaConfig, HybridConfig
from tests.conftest import tiny_model

V, K_TOKENS, ROWS = 5, 4, 256
PROMPT = [1, 2, 3, 4]
CFG = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=2,
                  num_kv_heads=1, head_dim=16)
P_VALUE_MIN = 1e-3  # a correct sampler fails this with probability 1e-3 per check


@functools.cache
def target() -> Model:
    return tiny_model(seed=3, scale=0.25, cfg=CFG)


@functools.cache
def drafts():
    t = target()
    keys = iter(np.asarray(jax.random.split(jax.random.PRNGKey(4), 64)))  # numpy: iterating a jax.Array compiles
    noisy = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape, x.dtype), t.params)
    ecfg = eagle3_config_for(CFG, draft_vocab_size=4)
    eagle = eagle_draft(ecfg, init_eagle_params(ecfg, jax.random.PRNGKey(5), t.params, scale=0.3))
    return {
        "perturbed": standalone_draft(Model(config=CFG, params=noisy, dtype=t.dtype)),
        "eagle3": eagle,
        # One-hot proposals from the request's history (every token of V recurs in it).
        "ngram": js.NgramDraft(max_ngram=2, min_ngram=1),
    }


def exact_joint(sampling: js.SamplingParams, model: Model | None = None) -> np.ndarray:
    """P(t1..tk) by enumeration: [V**k] (``model``: a target with vocabulary V, default ``target()``)."""
    prefixes = list(itertools.product(range(V), repeat=K_TOKENS - 1))
    seqs = np.asarray([PROMPT + list(p) for p in prefixes])
    logits, _, _ = forward_sequence(model or target(), seqs)
    n = len(PROMPT)
    lg = logits[:, n - 1:]  # [N, k, V]: distribution of t1..tk
    ones = jnp.ones(lg.shape[:-1])
    settings = RowSampling(temperature=ones * sampling.temperature, top_k=(ones * sampling.top_k).astype(jnp.int32),
                           top_p=ones * sampling.top_p, min_p=ones * 0.0)
    p = np.asarray(target_probs(lg, settings, min_p=False), np.float64)
    joint = np.zeros([V] * K_TOKENS)
    for i, pre in enumerate(prefixes):
        prob = 1.0
        for j, tok in enumerate(pre):
            prob *= p[i, j, tok]
        joint[pre] = prob * p[i, K_TOKENS - 1]
    return joint.reshape(-1)


def sample_counts(draft, spec, sampling, calls: int, seed0: int = 0, model: Model | None = None) -> np.ndarray:
    counts = np.zeros(V**K_TOKENS, np.int64)
    eng = js.EngineConfig(page_size=4, max_batch=ROWS, max_seq_len=32, steps_per_call=4)
    for c in range(calls):
        out = js.generate(model or target(), [PROMPT] * ROWS, draft=draft, spec=spec, sampling=sampling, engine=eng,
                          seed=seed0 + c, progress=False)
        for toks in out.token_ids:
            assert len(toks) == K_TOKENS
            counts[np.ravel_multi_index(toks, [V] * K_TOKENS)] += 1
    return counts


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit, with outcomes of expected count < 5 pooled into one bin."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def total_variation(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


HOT = js.SamplingParams(temperature=1.0, max_new_tokens=K_TOKENS)
FILTERED = js.SamplingParams(temperature=0.8, top_k=4, top_p=0.9, max_new_tokens=K_TOKENS)
CASES = [
    pytest.param(None, None, HOT, id="plain"),
    pytest.param("perturbed", js.SpecConfig.chain(2), HOT, id="chain_S2_rejection"),
    pytest.param("perturbed", js.SpecConfig.chain(3), FILTERED, id="chain_S3_rejection_topk_topp"),
    pytest.param("eagle3", js.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4), HOT, id="tree_k2_n4_target_only"),
    pytest.param("perturbed", js.SpecConfig(num_steps=3, topk=3, num_draft_tokens=6), FILTERED,
                 id="tree_k3_n6_target_only_topk_topp"),
    pytest.param("ngram", js.SpecConfig.chain(3), HOT, id="ngram_chain_S3_one_hot_rejection"),
]


@pytest.mark.parametrize("draft,spec,sampling", CASES)
def test_speculative_sampling_matches_target_distribution(draft, spec, sampling):
    probs = exact_joint(sampling)
    d = drafts()[draft] if draft else None
    counts = sample_counts(d, spec, sampling, calls=48)
    assert chi_square_p(counts, probs) > P_VALUE_MIN
    # More samples, closer to p.
    few = sample_counts(d, spec, sampling, calls=2, seed0=1000)
    assert total_variation(counts, probs) < total_variation(few, probs)


def test_drafts_are_partially_accepted_at_temperature_one():
    """The sampling tests exercise rejections, not only full accepts or full rejects."""
    out = js.generate(target(), [PROMPT] * 64, draft=drafts()["perturbed"], spec=js.SpecConfig.chain(3),
                      sampling=js.SamplingParams(temperature=1.0, max_new_tokens=12),
                      engine=js.EngineConfig(page_size=4, max_batch=64, max_seq_len=32), progress=False)
    lens = np.concatenate([s.accept_lens for s in out.stats])
    assert 1.3 < lens.mean() < 3.7 and (lens == 1).any() and (lens == 4).any()


def _biased_chain_rejection(tokens, draft_probs, probs, coins, coin_final, limit=None):
    """Wrong on purpose: after a rejection, draws from p instead of norm(max(0, p - q))."""
    accept_index, accept_lens, predict = verify_mod.verify_chain_rejection(tokens, draft_probs, probs, coins,
                                                                           coin_final, limit)
    num_ok = accept_lens - 1
    p_last = jnp.take_along_axis(probs, num_ok[:, None, None], axis=1)[:, 0]
    wrong = sample_with_uniform(p_last, coin_final)
    idx = jnp.arange(tokens.shape[1])[None, :]
    return accept_index, accept_lens, jnp.where(idx == num_ok[:, None], wrong[:, None], predict)


def test_biased_sampler_fails_the_same_test(monkeypatch):
    sampling = HOT
    probs = exact_joint(sampling)
    monkeypatch.setattr(shape_mod, "verify_chain_rejection", _biased_chain_rejection)
    jax.clear_caches()  # the compiled decode program must pick up the patched sampler
    try:
        counts = sample_counts(drafts()["perturbed"], js.SpecConfig.chain(2), sampling, calls=48)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert chi_square_p(counts, probs) < 1e-6


@pytest.mark.parametrize("spec", [js.SpecConfig.chain(3), js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)],
                         ids=["chain", "tree"])
def test_same_seed_same_output(spec):
    sampling = js.SamplingParams(temperature=0.9, max_new_tokens=12)
    eng = js.EngineConfig(page_size=4, max_batch=4, max_seq_len=32)
    runs = [js.generate(target(), [PROMPT, [3, 2], [4], [1, 1, 1]], draft=drafts()["perturbed"], spec=spec,
                        sampling=sampling, engine=eng, seed=s, progress=False).token_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1] != runs[2]


def test_lossy_thresholds_are_accepted_and_validated():
    spec = js.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4, accept_threshold_single=0.5, accept_threshold_acc=0.5)
    assert not spec.exact_sampling
    out = js.generate(target(), [PROMPT] * 4, draft=drafts()["eagle3"], spec=spec,
                      sampling=js.SamplingParams(temperature=1.0, max_new_tokens=8),
                      engine=js.EngineConfig(page_size=4, max_batch=4, max_seq_len=32), progress=False)
    assert all(len(t) == 8 for t in out.token_ids)
    with pytest.raises(ValueError, match="accept_threshold_acc must be in \\(0, 1\\]"):
        js.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4, accept_threshold_acc=0.0)


# ----------------------------------------------------------------- with generation controls

# Strong penalties on a 5-token vocabulary: every token's distribution depends on the ones before.
CONTROLLED = js.SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.8,
                               logit_bias={0: 1.0, 3: -1.5}, min_p=0.12, max_new_tokens=K_TOKENS)
CONTROLLED_FILTERED = dataclasses.replace(CONTROLLED, temperature=0.8, top_k=4, top_p=0.95)


def reference_probs(logits: np.ndarray, output: list[int], s: js.SamplingParams) -> np.ndarray:
    """vLLM v1's processing of one position, in numpy: bias, repetition (prompt and output),
    frequency and presence (output), temperature, min-p, top-k, top-p."""
    x = logits.astype(np.float64).copy()
    for t, b in s.logit_bias or ():
        x[t] += b
    counts = np.bincount(np.asarray(output, np.int64), minlength=V)
    seen = np.isin(np.arange(V), PROMPT) | (counts > 0)
    x = np.where(seen, np.where(x > 0, x / s.repetition_penalty, x * s.repetition_penalty), x)
    x = x - s.frequency_penalty * counts - s.presence_penalty * (counts > 0)
    p = np.exp((x - x.max()) / s.temperature)
    p /= p.sum()
    p = np.where(p < s.min_p * p.max(), 0.0, p)
    if s.top_k:
        p = np.where(p >= np.sort(p)[::-1][s.top_k - 1], p, 0.0)
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros(V, bool)
    keep[order[before < s.top_p * p.sum()]] = True
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def exact_joint_controlled(sampling: js.SamplingParams) -> np.ndarray:
    """P(t1..tk) under the processed target distribution, by enumeration (numpy oracle)."""
    prefixes = list(itertools.product(range(V), repeat=K_TOKENS - 1))
    logits, _, _ = forward_sequence(target(), np.asarray([PROMPT + list(p) for p in prefixes]))
    lg = np.asarray(logits)[:, len(PROMPT) - 1:]  # [N, k, V]
    joint = np.zeros([V] * K_TOKENS)
    for i, pre in enumerate(prefixes):
        prob = 1.0
        for j in range(K_TOKENS - 1):
            prob *= reference_probs(lg[i, j], list(pre[:j]), sampling)[pre[j]]
        joint[pre] = prob * reference_probs(lg[i, K_TOKENS - 1], list(pre), sampling)
    return joint.reshape(-1)


CONTROLLED_CASES = [
    pytest.param(None, None, CONTROLLED, id="plain"),
    pytest.param("perturbed", js.SpecConfig.chain(3), CONTROLLED, id="chain_S3_rejection"),
    pytest.param("perturbed", js.SpecConfig(num_steps=3, topk=3, num_draft_tokens=6), CONTROLLED_FILTERED,
                 id="tree_k3_n6_target_only_filtered"),
]


@pytest.mark.parametrize("draft,spec,sampling", CONTROLLED_CASES)
def test_sampling_with_controls_matches_the_processed_distribution(draft, spec, sampling):
    probs = exact_joint_controlled(sampling)
    assert total_variation_of(probs, exact_joint(dataclasses.replace(sampling, min_p=0.0))) > 0.2  # controls matter
    counts = sample_counts(drafts()[draft] if draft else None, spec, sampling, calls=32)
    assert chi_square_p(counts, probs) > P_VALUE_MIN


def total_variation_of(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(p - q).sum())


@pytest.mark.parametrize("spec", [js.SpecConfig.chain(3), js.SpecConfig(num_steps=3, topk=3, num_draft_tokens=6)],
                         ids=["chain", "tree"])
def test_penalties_counted_without_the_tree_path_fail_the_same_test(monkeypatch, spec):
    """Wrong on purpose: each node judged with the committed counts only, not its own path."""
    original = step_mod.apply_controls
    monkeypatch.setattr(step_mod, "apply_controls", lambda logits, c, tokens, path: original(
        logits, c, tokens, None if path is None else path & False))
    jax.clear_caches()
    try:
        counts = sample_counts(drafts()["perturbed"], spec, CONTROLLED, calls=32)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert chi_square_p(counts, exact_joint_controlled(CONTROLLED)) < 1e-6


# ----------------------------------------------------------------- a hybrid (recurrent-state) target


@functools.cache
def hybrid_target() -> Model:
    """A Qwen3.5-style target over the same 5 tokens: two Gated DeltaNet layers and a gated attention
    layer, so every sampled token also advances a recurrent state."""
    cfg = HybridConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=3,
                       layer_types=(LINEAR, LINEAR, FULL), mlp_types=("dense",) * 3, num_heads=2, num_kv_heads=1,
                       head_dim=16, rope=RopeConfig(theta=1e4), rotary_dim=4,
                       gdn=GatedDeltaConfig(num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8))
    return Model(config=cfg, params=init_hybrid_params(cfg, seed=5, scale=0.4), dtype=np.dtype(np.float32))


@functools.cache
def hybrid_perturbed():
    t = hybrid_target()
    keys = iter(np.asarray(jax.random.split(jax.random.PRNGKey(6), 200)))  # numpy: iterating a jax.Array compiles
    params = jax.tree.map(lambda x: x * (1 + 0.1 * jax.random.normal(next(keys), x.shape, x.dtype)), t.params)
    return standalone_draft(Model(config=t.config, params=params, dtype=t.dtype))


@pytest.mark.parametrize("spec", [None, js.SpecConfig.chain(3), js.SpecConfig(num_steps=3, topk=3, num_draft_tokens=6)],
                         ids=["plain", "chain_S3_rejection", "tree_k3_n6_target_only"])
def test_sampling_on_a_hybrid_target_matches_its_distribution(spec):
    model = hybrid_target()
    probs = exact_joint(HOT, model=model)
    counts = sample_counts(hybrid_perturbed() if spec else None, spec, HOT, calls=32, model=model)
    assert chi_square_p(counts, probs) > P_VALUE_MIN
