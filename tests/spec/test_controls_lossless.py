"""Generation controls under speculation: with logit bias, repetition / presence / frequency
penalties and min-p on (each alone and all together, mixed in one ragged batch), greedy speculative
output equals plain greedy output for every draft kind, chains and trees, pages 1 and 16; plain
greedy output with controls equals an HF + torch oracle of vLLM's processing order
(``tests/data/golden/controls``, made by ``scripts/goldens/controls.py``); raw log-probabilities
equal HF's log-softmax and are the same with and without speculation; and changing the controls from
call to call compiles nothing new."""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest

import jaxspec as js
from jaxspec.engine.programs import compiled_programs
from jaxspec.model.drafts import standalone_draft
from tests.conftest import PROMPTS_4, engine
from tests.spec import test_dflash, test_frozen_kv, test_mla_spec
from tests.spec.test_lossless import drafts as tiny_drafts
from tests.model.drafts import test_golden_dflash, test_golden_heads
from tests.model.golden import GOLDEN, case_dir, cases

MAX_NEW = 24
SP = js.SamplingParams
# One control per row and all of them on the last (bias ids fit every vocabulary used here).
MIXED = [
    SP(max_new_tokens=MAX_NEW, repetition_penalty=1.4, logprobs=3, stop_token_ids=()),
    SP(max_new_tokens=MAX_NEW, presence_penalty=1.2, frequency_penalty=0.6, stop_token_ids=()),
    SP(max_new_tokens=MAX_NEW, logit_bias={7: 3.0, 12: -4.0, 40: 2.0}, min_p=0.3, stop_token_ids=()),
    SP(max_new_tokens=MAX_NEW, repetition_penalty=0.8, presence_penalty=0.4, frequency_penalty=-0.3,
       logit_bias={7: 1.5, 33: 2.5}, logprobs=0, stop_token_ids=()),
]
ALL = [SP(max_new_tokens=MAX_NEW, repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.5,
          logit_bias={7: 2.0, 12: -1.0}, min_p=0.1, logprobs=2, stop_token_ids=())] * 4
CONTROLS = {"mixed": MIXED, "all": ALL}


@functools.cache
def plain(target, prompts: tuple, controls: str | None, page: int, max_len: int = 128):
    sampling = CONTROLS[controls] if controls else SP(max_new_tokens=MAX_NEW, stop_token_ids=())
    return js.generate(target, [list(p) for p in prompts], sampling=sampling,
                       engine=engine(page, 4, max_seq_len=max_len), progress=False)


def check_equals_plain(target, prompts, draft, spec, page, controls="mixed", max_len=128):
    ref = plain(target, tuple(map(tuple, prompts)), controls, page, max_len)
    unprocessed = plain(target, tuple(map(tuple, prompts)), None, page, max_len)
    out = js.generate(target, prompts, draft=draft, spec=spec, sampling=CONTROLS[controls],
                      engine=engine(page, 4, max_seq_len=max_len), progress=False)
    assert out.token_ids == ref.token_ids
    assert out.kv_pages_free == out.kv_pages_total
    # The controls change the output (else equality would prove nothing about them).
    assert sum(a != b for a, b in zip(ref.token_ids, unprocessed.token_ids)) >= 2
    for i, s in enumerate(CONTROLS[controls]):
        if s.logprobs is None:
            assert out.logprobs[i] is None and out.top_logprobs[i] is None
            continue
        np.testing.assert_allclose(out.logprobs[i], ref.logprobs[i], atol=1e-4)
        assert all(len(d) == s.logprobs for d in out.top_logprobs[i])
        assert [list(d) for d in out.top_logprobs[i]] == [list(d) for d in ref.top_logprobs[i]]
    return out


TREE = js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)


@pytest.mark.parametrize("draft,spec,page,controls", [
    ("eagle3", js.SpecConfig.chain(3), 1, "mixed"),
    ("eagle3", js.SpecConfig(num_steps=3, topk=4, num_draft_tokens=8), 16, "mixed"),
    ("perturbed", TREE, 1, "mixed"),
    ("perturbed", TREE, 16, "all"),
    ("assistant", TREE, 1, "mixed"),
    ("ngram", js.SpecConfig.chain(3), 1, "mixed"),
    ("ngram", TREE, 16, "mixed"),
    ("hybrid", js.SpecConfig(num_steps=2, topk=1, num_draft_tokens=7, ngram_tokens=4), 16, "mixed"),
], ids=lambda x: str(x) if not isinstance(x, js.SpecConfig) else f"S{x.num_steps}k{x.topk}n{x.num_draft_tokens}")
def test_tiny_target_drafts_equal_plain_with_controls(tiny_target, draft, spec, page, controls):
    made = {
        "eagle3": lambda: tiny_drafts(tiny_target)["eagle3"],
        "perturbed": lambda: tiny_drafts(tiny_target)["perturbed"],
        "same": lambda: tiny_drafts(tiny_target)["same"],
        "assistant": lambda: test_frozen_kv.assistant(tiny_target),
        "ngram": lambda: js.NgramDraft(max_ngram=3),
        "hybrid": lambda: js.HybridDraft(tiny_drafts(tiny_target)["eagle3"], js.NgramDraft(max_ngram=3)),
    }[draft]()
    out = check_equals_plain(tiny_target, PROMPTS_4, made, spec, page, controls)
    lens = np.concatenate([s.accept_lens for s in out.stats])
    if draft == "perturbed":  # partial acceptance: compaction moves real paths
        assert lens.mean() > 1.2 and (lens < spec.max_accept).any(), lens
    if draft == "same":
        # The target drafting for itself, steered by the same controls over the committed counts,
        # proposes what the processed target picks (unsteered it would accept about 3.0 here).
        assert lens.mean() > 3.6, lens


@pytest.mark.parametrize("spec,page", [(TREE, 1)], ids=["tree"])  # chains: the EAGLE-3 cases above (same loop)
def test_eagle1_head_equals_plain_with_controls(spec, page):
    target = test_golden_heads.target("llama3")
    head = next(c for c in cases("eagle1"))
    check_equals_plain(target, golden_prompts(), js.load_draft(case_dir(head), target), spec, page)


@pytest.mark.parametrize("spec,page", [(js.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4), 16)],
                         ids=["tree"])  # chains: the EAGLE-3 cases above (the same recurrent loop)
def test_mtp_equals_plain_with_controls(spec, page):
    case, target, draft, _ = test_mla_spec.golden("deepseek_v3_dense")
    check_equals_plain(target, [p[:8] for p in case["prompts"]] + [case["prompts"][0][:3]], draft, spec, page,
                       max_len=64)


@pytest.mark.parametrize("spec,page", [(js.SpecConfig.chain(7), 16), (js.SpecConfig(num_steps=7, topk=3,
                                                                                    num_draft_tokens=12), 1)],
                         ids=["chain", "tree"])
def test_dflash_equals_plain_with_controls(spec, page):
    check_equals_plain(test_golden_dflash.target(), test_dflash.PROMPTS_4, test_golden_dflash.draft("dflash"), spec,
                       page, max_len=80)


# ----------------------------------------------------------------------------- against HF


@functools.cache
def controls_golden() -> dict:
    with open(os.path.join(GOLDEN, "controls", "golden.json")) as f:
        return json.load(f)


def golden_prompts() -> list[list[int]]:
    return controls_golden()["prompts"] + [controls_golden()["prompts"][0][:2]]


def golden_sampling(case: dict) -> SP:
    g = controls_golden()
    return SP(max_new_tokens=g["new_tokens"], stop_token_ids=(), logprobs=g["top"], **case["controls"])


@pytest.mark.parametrize("run", ["plain", "eagle1-tree", "ngram-chain"])
def test_controls_and_logprobs_equal_the_hf_oracle(run):
    """Every golden case (its controls on the golden prompts) in one ragged batch."""
    g = controls_golden()
    target = test_golden_heads.target("llama3")
    kw = {}
    if run == "eagle1-tree":
        kw = dict(draft=js.load_draft(case_dir(next(c for c in cases("eagle1"))), target), spec=TREE)
    elif run == "ngram-chain":
        kw = dict(draft=js.NgramDraft(max_ngram=2), spec=js.SpecConfig.chain(4))
    rows = [(case, i, row) for case in g["cases"] for i, row in enumerate(case["rows"])]
    out = js.generate(target, [g["prompts"][i] for _, i, _ in rows], sampling=[golden_sampling(c) for c, _, _ in rows],
                      engine=engine(16, 16), progress=False, **kw)
    for j, (case, i, row) in enumerate(rows):
        where = f"{case['name']}, prompt {i}"
        assert out.token_ids[j] == row["tokens"], where
        np.testing.assert_allclose(out.logprobs[j], row["logprobs"], atol=2e-4, err_msg=where)
        for got, ids, lps in zip(out.top_logprobs[j], row["top_ids"], row["top_logprobs"]):
            assert list(got) == ids, where
            np.testing.assert_allclose(list(got.values()), lps, atol=2e-4, err_msg=where)


# ----------------------------------------------------------------------------- compiles


def test_changing_controls_compiles_nothing_new(tiny_target):
    draft = standalone_draft(tiny_target)
    eng = engine(16, 4)
    first = [SP(max_new_tokens=12, repetition_penalty=1.2, logprobs=1), SP(max_new_tokens=12, min_p=0.2),
             SP(max_new_tokens=12, logit_bias={3: 1.0}), SP(max_new_tokens=12)]
    js.generate(tiny_target, PROMPTS_4, draft=draft, spec=TREE, sampling=first, engine=eng)
    before = compiled_programs()
    other = [SP(max_new_tokens=12, presence_penalty=-1.0, logit_bias={5: -2.0, 90: 4.0, 17: 0.5}, logprobs=20),
             SP(max_new_tokens=12, frequency_penalty=2.0, repetition_penalty=0.5),
             SP(max_new_tokens=12, logprobs=0), SP(max_new_tokens=12, min_p=0.9, logit_bias={1: 1.0})]
    out = js.generate(tiny_target, PROMPTS_4, draft=draft, spec=TREE, sampling=other, engine=eng)
    js.generate(tiny_target, PROMPTS_4, draft=draft, spec=TREE, sampling=first[::-1], engine=eng)
    assert compiled_programs() == before
    assert all(len(d) == 20 for d in out.top_logprobs[0]) and out.logprobs[1] is None
