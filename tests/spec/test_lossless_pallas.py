"""Lossless with the Pallas kernels: a subset of ``test_lossless`` rerun with
``implementation="pallas"`` (interpret mode on CPU, native on a GPU). Paged attention, the
KV-move compaction and the fused extras gather all run inside the speculative step; the
output must equal plain greedy decoding with the XLA path, token for token.

Interpret mode compiles every kernel instance into the step program, so the subset is small:
a chain with an EAGLE-3 head (the fused gather carries hidden states) and two trees with the
perturbed draft (partial acceptance: compaction moves scattered nodes), at both page sizes,
batch 4 with ragged prompts.
"""

from __future__ import annotations

import pytest

import jaxspec as js
from tests.spec.test_lossless import test_speculative_greedy_equals_plain_greedy as lossless_case

SUBSET = [
    # (spec, page_size, batch, draft): each is one of test_lossless.cases()
    pytest.param(js.SpecConfig.chain(3), 16, 4, "eagle3", id="S3_k1_n4-eagle3-page16-B4"),
    pytest.param(js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=4), 16, 4, "perturbed",
                 id="S3_k2_n4-perturbed-page16-B4"),
    pytest.param(js.SpecConfig(num_steps=4, topk=4, num_draft_tokens=8), 1, 4, "perturbed",
                 id="S4_k4_n8-perturbed-page1-B4"),
]


@pytest.mark.slow
@pytest.mark.parametrize("spec,page,batch,draft", SUBSET)
def test_speculative_greedy_with_pallas_equals_plain_greedy(tiny_target, spec, page, batch, draft):
    lossless_case(tiny_target, spec, page, batch, draft, implementation="pallas")
