"""Speculative sampling with a Gemma 4 assistant is exact: the joint distribution of the first
tokens matches the target's (test_spec_sampling's enumeration and chi-square test, on a V = 5
Gemma 4 target whose window of 3 is shorter than the sequences). The ordered-embeddings head
gives q zero mass outside its 2 selected tokens, and the same q samples and accepts. (Chain
rejection sampling only: tree sampling is target-only, its q plays no part; the plain head's tree
case was cut for test time.)"""

from __future__ import annotations

import functools

import pytest

import jaxspec as js
from tests.spec.test_spec_sampling import HOT, P_VALUE_MIN, V, chi_square_p, exact_joint, sample_counts
from tests.model.sliding_golden import tiny_gemma4, tiny_gemma4_assistant


@functools.cache
def gemma():
    return tiny_gemma4(vocab=V, window=3, seed=3, scale=0.1)  # a spread-out target distribution


@functools.cache
def gemma_assistant(ordered: bool):
    return tiny_gemma4_assistant(gemma(), ordered=ordered)


CASES = [
    pytest.param(True, js.SpecConfig.chain(2), HOT, id="chain_S2_rejection_ordered_head"),
]


@pytest.mark.parametrize("ordered,spec,sampling", CASES)
def test_assistant_sampling_matches_target_distribution(ordered, spec, sampling):
    probs = exact_joint(sampling, gemma())
    counts = sample_counts(gemma_assistant(ordered), spec, sampling, calls=32, model=gemma())
    assert chi_square_p(counts, probs) > P_VALUE_MIN
