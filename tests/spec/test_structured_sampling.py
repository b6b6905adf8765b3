"""Speculative sampling under a structured-output constraint has exactly the target's distribution
restricted to the tokens the grammar allows at each position (computed by enumeration with the
``regex`` oracle on a 5-token vocabulary), for chain rejection sampling and tree target-only
sampling; a broken verify that masks every node with the root's automaton state (not its own
path's) fails the same test."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
import jaxspec.spec.step as step_mod  # where verify computes each node's automaton state
from jaxspec.model.checkpoints.tokenizer import Tokenizer
from jaxspec.sampling.distributions import RowSampling, target_probs
from jaxspec.model.targets import forward_sequence
from tests.spec.test_spec_sampling import K_TOKENS, P_VALUE_MIN, PROMPT, V, chi_square_p, drafts, sample_counts, target
from tests.structured.vocab import oracle_allowed

# After "b" only "c" or "d"; "e" never twice in a row: each node's allowed set depends on its own path.
PATTERN = r"(a|b[cd]|e(a|b[cd]))*e?"
LETTERS = ["a", "b", "c", "d", "e"]  # token i is LETTERS[i]


@functools.cache
def constrained_target():
    from tokenizers import Tokenizer as HFTokenizer, decoders, models

    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(LETTERS)}, merges=[]))
    tok.decoder = decoders.Fuse()
    return dataclasses.replace(target(), tokenizer=Tokenizer(tok))


@functools.cache
def exact_joint(sampling: js.SamplingParams) -> np.ndarray:
    """P(t1..tk): at each position the target's distribution over the tokens the oracle allows."""
    prefixes = list(itertools.product(range(V), repeat=K_TOKENS - 1))
    logits, _, _ = forward_sequence(target(), np.asarray([PROMPT + list(p) for p in prefixes]))
    n = len(PROMPT)
    joint = np.zeros([V] * K_TOKENS)
    for i, pre in enumerate(prefixes):
        prob = 1.0
        for j in range(K_TOKENS):
            text = "".join(LETTERS[t] for t in pre[:j])
            allowed = np.asarray(oracle_allowed(PATTERN, text, LETTERS))
            masked = jnp.where(allowed, logits[i, n - 1 + j], -jnp.inf)
            one = jnp.ones(())
            settings = RowSampling(temperature=one * sampling.temperature, top_k=jnp.int32(sampling.top_k),
                                   top_p=one * sampling.top_p, min_p=one * 0.0)
            p = np.asarray(target_probs(masked, settings, min_p=False), np.float64)
            if j == K_TOKENS - 1:
                joint[pre] += prob * p
            else:
                prob *= p[pre[j]]
    return joint.reshape(-1)


HOT = js.SamplingParams(temperature=1.0, max_new_tokens=K_TOKENS, regex=PATTERN)


@pytest.mark.parametrize("draft,spec", [
    ("perturbed", js.SpecConfig.chain(3)),
    ("eagle3", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)),
], ids=["chain_rejection", "tree_target_only"])
def test_constrained_sampling_has_the_restricted_distribution(draft, spec):
    probs = exact_joint(HOT)
    counts = sample_counts(drafts()[draft], spec, HOT, calls=24, model=constrained_target())
    assert chi_square_p(counts, probs) > P_VALUE_MIN
    assert counts[probs == 0].sum() == 0  # nothing the grammar forbids


def _root_states_only(grammar, tokens, parent, depth):
    """Wrong on purpose: every node masked with the row's state, not its own path's."""
    return jnp.broadcast_to(grammar.state[:, None], tokens.shape)


def test_verify_without_per_node_states_fails_the_same_test(monkeypatch):
    probs = exact_joint(HOT)
    monkeypatch.setattr(step_mod, "node_states", _root_states_only)
    jax.clear_caches()  # the compiled decode program must pick up the patched verify
    try:
        counts = sample_counts(drafts()["eagle3"], js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5), HOT,
                               calls=24, model=constrained_target())
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert chi_square_p(counts, probs) < 1e-6
