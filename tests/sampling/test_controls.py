"""Generation controls as pure functions: the logit processing of every tree node against a plain
numpy statement of vLLM's rule (counts built by walking each node's path), the raw log-probabilities,
min-p, and the validation of ``SamplingParams``."""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp
import jaxspec as js
from jaxspec.spec import tree as tree_lib
from jaxspec.sampling.controls import Controls, apply_controls, steer, token_logprobs
from jaxspec.sampling.distributions import RowSampling, target_probs


def reference_process(logits, prompt, output, bias, rep, pres, freq):
    """One row, one position: numpy, in vLLM v1's order."""
    x = logits.astype(np.float64) + bias
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(x)) if len(output) else np.zeros(len(x))
    seen = np.isin(np.arange(len(x)), prompt) | (counts > 0)
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    return x - freq * counts - pres * (counts > 0)


def path_of(parent, i):
    """Node i's path below the root, root side first."""
    out = []
    while i > 0:
        out.append(i)
        i = parent[i]
    return out[::-1]


def random_tree(rng, n, vocab):
    """A random tree whose nodes reuse few tokens (so paths repeat tokens and the prompt's)."""
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    tokens = rng.integers(0, vocab, n)
    return np.asarray(parent, np.int32), tokens.astype(np.int32)


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_every_node_is_processed_with_the_counts_of_its_own_path(n):
    rng = np.random.default_rng(n)
    B, V = 3, 7
    logits = rng.normal(0, 2, (B, n, V)).astype(np.float32)
    prompts = [rng.integers(0, V, 4) for _ in range(B)]
    outputs = [rng.integers(0, V, k) for k in (0, 3, 6)]  # committed output, the root last
    bias = rng.normal(0, 1, (B, V)).astype(np.float32) * (rng.random((B, V)) < 0.4)
    rep = np.asarray([1.3, 0.8, 1.0], np.float32)
    pres = np.asarray([0.5, -1.0, 2.0], np.float32)
    freq = np.asarray([0.25, 1.5, -0.75], np.float32)
    trees = [random_tree(rng, n, V) for _ in range(B)]
    parent = np.stack([t[0] for t in trees])
    tokens = np.stack([t[1] for t in trees])
    tree = tree_lib.link_tree(jnp.asarray(tokens), jnp.asarray(parent), max_depth=n)
    counts = np.zeros((B, V), np.int32)
    in_prompt = np.zeros((B, V), bool)
    for b in range(B):
        np.add.at(counts[b], outputs[b], 1)
        in_prompt[b, prompts[b]] = True
    controls = Controls(repetition=jnp.asarray(rep), presence=jnp.asarray(pres), frequency=jnp.asarray(freq),
                        bias=jnp.asarray(bias), in_prompt=jnp.asarray(in_prompt), counts=jnp.asarray(counts))
    got = np.asarray(apply_controls(jnp.asarray(logits), controls, tree.tokens, tree.mask))
    for b in range(B):
        for i in range(n):
            output = list(outputs[b]) + [int(tokens[b, j]) for j in path_of(parent[b], i)]
            want = reference_process(logits[b, i], prompts[b], output, bias[b], rep[b], pres[b], freq[b])
            np.testing.assert_allclose(got[b, i], want, rtol=1e-5, atol=1e-5, err_msg=f"row {b} node {i}")


def test_controls_off_leave_the_logits_alone():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 5)), jnp.float32)
    tree = tree_lib.chain_tree(jnp.asarray([1, 2]), jnp.asarray([[3, 3], [4, 1]]))
    assert apply_controls(logits, Controls.empty(2, 0), tree.tokens, tree.mask) is logits


def test_min_p_drops_tokens_below_its_share_of_the_best():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.12, 0.08]]))
    ones = jnp.ones((1,))
    settings = lambda min_p: RowSampling(temperature=ones, top_k=jnp.zeros((1,), jnp.int32), top_p=ones,  # noqa: E731
                                         min_p=jnp.asarray([min_p]))
    p = np.asarray(target_probs(logits, settings(0.2)))
    np.testing.assert_allclose(p[0], [0.5 / 0.92, 0.3 / 0.92, 0.12 / 0.92, 0.0], rtol=1e-6)  # 0.08 < 0.2 * 0.5
    off = np.asarray(target_probs(logits, settings(0.0)))
    np.testing.assert_allclose(off[0], [0.5, 0.3, 0.12, 0.08], rtol=1e-6)


def test_token_logprobs_are_the_raw_log_softmax():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (2, 3, 11)).astype(np.float32)
    tokens = rng.integers(0, 11, (2, 3)).astype(np.int32)
    lp = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), 4)
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lp.chosen), np.take_along_axis(ref, tokens[..., None], -1)[..., 0],
                               atol=1e-5)
    order = np.argsort(-ref, axis=-1)[..., :4]
    np.testing.assert_array_equal(np.asarray(lp.top_ids), order)
    np.testing.assert_allclose(np.asarray(lp.top), np.take_along_axis(ref, order, -1), atol=1e-5)


@pytest.mark.parametrize("kwargs,message", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty must be in \\[-2, 2\\]"),
    (dict(frequency_penalty=-2.01), "frequency_penalty must be in \\[-2, 2\\]"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty"),
    (dict(min_p=1.5), "min_p must be in \\[0, 1\\]"),
    (dict(min_p=-0.1), "min_p"),
    (dict(logit_bias={3: float("nan")}), "logit_bias\\[3\\] must be a finite number"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids"),
    (dict(logit_bias={"x": 1.0}), "logit_bias keys must be token ids"),
    (dict(logit_bias=[1, 2]), "logit_bias must map token ids to numbers"),
    (dict(logprobs=21), "logprobs must be None or an int in \\[0, 20\\]"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=True), "logprobs"),
], ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}={v}" for k, v in x.items()))
def test_bad_controls_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        js.SamplingParams(**kwargs)


def test_logit_bias_is_normalized_and_hashable():
    a = js.SamplingParams(logit_bias={5: 1, 2: -3.5})
    b = js.SamplingParams(logit_bias=[(2, -3.5), (5, 1.0)])
    c = js.SamplingParams(logit_bias={"5": 1.0, "2": -3.5})  # as a JSON object would give it
    assert a.logit_bias == ((2, -3.5), (5, 1.0)) and a == b == c and hash(a) == hash(b)
    assert js.SamplingParams(logit_bias={}).logit_bias is None
    assert a.uses_penalties and not js.SamplingParams().uses_penalties


def test_controls_checked_against_the_vocabulary_before_device_work(tiny_target):
    with pytest.raises(ValueError, match="logit_bias of request 1 names token id 96 outside the vocabulary"):
        js.generate(tiny_target, [[1, 2], [3]], sampling=[js.SamplingParams(), js.SamplingParams(logit_bias={96: 1.0})])


def test_steer_processes_a_draft_vocabulary_through_its_target_ids():
    rng = np.random.default_rng(2)
    B, R, V, Vd = 2, 3, 11, 5
    ids = np.asarray([7, 0, 3, 10, 4], np.int32)  # draft column -> target id (an EAGLE-3 d2t subset)
    logits = rng.normal(0, 2, (B, R, Vd)).astype(np.float32)
    counts = rng.integers(0, 3, (B, V)).astype(np.int32)
    in_prompt = rng.random((B, V)) < 0.3
    bias = rng.normal(0, 1, (B, V)).astype(np.float32)
    c = Controls(repetition=jnp.asarray([1.5, 0.7]), presence=jnp.asarray([0.3, -0.4]),
                 frequency=jnp.asarray([0.2, 1.0]), bias=jnp.asarray(bias), in_prompt=jnp.asarray(in_prompt),
                 counts=jnp.asarray(counts))
    got = np.asarray(steer(jnp.asarray(logits), c, jnp.asarray(ids)))
    for b in range(B):
        output = np.repeat(np.arange(V), counts[b])
        for r in range(R):
            full = np.full(V, -50.0)
            full[ids] = logits[b, r]
            want = reference_process(full, np.flatnonzero(in_prompt[b]), output, bias[b], float(c.repetition[b]),
                                     float(c.presence[b]), float(c.frequency[b]))[ids]
            np.testing.assert_allclose(got[b, r], want, rtol=1e-5, atol=1e-5)
    x = jnp.asarray(logits)
    assert steer(x, Controls.empty(B, 0), jnp.asarray(ids)) is x  # controls off: untouched
