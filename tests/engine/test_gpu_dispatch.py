"""On a GPU, with the default dispatch (``implementation=None``), every step kind reads its KV through
the paged-attention kernel: prefill, the plain decode, the tree verify, the draft's extend after a
verify and its tree steps. Shown on the CPU with the dispatch told it runs on an H200 (the kernels
interpreted): each attention call is counted by the shape class the block table sees, the XLA
path refuses to run, and the output still equals plain greedy decoding (computed before, on the XLA
path). The kernel streams only the positions below each row's length, read at run time inside it
(its prefix loop's trip count), so ragged rows compile no variant of their own."""

from __future__ import annotations

import collections

import pytest

import jaxspec as js
from jaxspec.pallas import block_table, dispatch
from jaxspec.pallas import paged_attention as pa
from tests.conftest import PROMPTS_4, engine
from tests.spec.test_lossless import MAX_NEW, drafts, plain_greedy


@pytest.fixture
def as_on_an_h200(monkeypatch):
    """The dispatch of an H200 (Pallas where the table and the shape allow it), kernels interpreted;
    returns the attention calls traced, by phase."""
    phases = collections.Counter()
    phases.rows = collections.Counter()  # (phase, query rows a request)
    kernel = pa.paged_attention_pallas

    def counted(q, k_pool, v_pool, layer, page_table, prefix_lens, block_mask, **kw):
        cls = block_table.attention_class_of("paged_attention", rows=q.shape[1], block_mask=block_mask,
                                             head_dim=q.shape[3], page_size=kw["page_size"])
        phases[cls.split("/")[1]] += 1
        phases.rows[cls.split("/")[1], q.shape[1]] += 1
        return kernel(q, k_pool, v_pool, layer, page_table, prefix_lens, block_mask, **kw)

    def refused(*args, **kwargs):
        raise AssertionError("the XLA attention path ran where a GPU would run the paged kernel")

    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(dispatch, "interpret_mode", lambda: True)
    monkeypatch.setattr(dispatch, "_local_gpu_kind", lambda: "h200")
    monkeypatch.setattr(pa, "paged_attention_pallas", counted)
    monkeypatch.setattr(pa, "paged_attention_xla", refused)
    return phases


@pytest.mark.slow
def test_every_step_kind_reads_kv_through_the_paged_kernel_on_a_gpu(tiny_target, request):
    want = plain_greedy(tiny_target, 16, 4)  # the XLA path, before the dispatch is told it runs on a GPU
    phases = request.getfixturevalue("as_on_an_h200")
    # steps_per_call=3: a plan no other test compiles, so every program is traced under this dispatch
    cfg = engine(16, 4, steps_per_call=3)
    sampling = js.SamplingParams(max_new_tokens=MAX_NEW)
    plain = js.generate(tiny_target, PROMPTS_4, sampling=sampling, engine=cfg)
    # the prompt (64 rows), then the decode: 4 rows, each request's token padded to 2 rows so no
    # product has rows to pad (``padded_tokens``), a causal block of 2 in the prefill class
    assert set(phases.rows) == {("prefill", 64), ("prefill", 2)}, phases.rows
    tree = js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=4)
    out = js.generate(tiny_target, PROMPTS_4, draft=drafts(tiny_target)["eagle3"], spec=tree, sampling=sampling,
                      engine=cfg)
    # verify: the tree over its own nodes; draft: a tree step over the draft's scratch block;
    # prefill: the prompt, and the draft's extend over the accepted tokens (causal rows)
    assert set(phases) == {"prefill", "verify", "draft"}, phases
    assert plain.token_ids == want and out.token_ids == want
