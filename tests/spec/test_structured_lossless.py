"""Structured output: constrained greedy decoding equals a plain-Python oracle, and speculation
changes nothing.

- On the demo target (its real byte-level tokenizer), regex-constrained plain greedy output is, at
  every step, the argmax over the tokens the ``regex`` module's partial matching allows over the
  whole vocabulary (EOS only where the text fully matches), and ends where the oracle ends;
- constrained speculative greedy output equals constrained plain greedy output for every draft kind
  (EAGLE-3, DFlash, n-gram, hybrid on the demo pair; EAGLE and MTP on tiny golden targets with a
  small character tokenizer), chains and trees, pages 1 and 16, ragged batches, and under forced
  preemption (a resumed request restarts its automaton where its output left it); a request ends
  with finish reason "stop" at a complete match and "length" when max_new_tokens runs out first;
- JSON-schema outputs parse and validate (bounds included), identically with and without
  speculation; constrained and free requests mix in one batch (the free ones unchanged);
- a different constraint of the same size compiles nothing new; bad constraints are refused
  before any device work.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import jaxspec as js
from jaxspec.demo import DEMO_DRAFT, DEMO_TARGET
from jaxspec.engine.programs import compiled_programs
from jaxspec.model.targets import forward_sequence
from jaxspec.train.corpus import file_prompts, spread_by_package, stdlib_files
from tests.conftest import engine
from tests.spec import test_mla_spec
from tests.model.drafts import test_golden_dspark, test_golden_heads
from tests.model.golden import case_dir, cases
from tests.structured.vocab import char_tokenizer, oracle_allowed, oracle_final, token_texts

MAX_NEW = 24
# A function signature: the demo model (trained on the standard library) has opinions about it.
SIGNATURE = r"def [a-z_]{1,16}\((self|cls)?(, [a-z_]{1,10}){0,3}\):"
SP = functools.partial(js.SamplingParams, max_new_tokens=MAX_NEW)
DEMO_DFLASH = DEMO_DRAFT.replace("eagle3", "dflash")


@functools.cache
def demo():
    target = js.load_model(DEMO_TARGET, dtype="float32", progress=False)
    prompts = file_prompts(target.tokenizer, spread_by_package(stdlib_files("heldout")), 3, 40)
    prompts = [p[: 40 - 11 * i] for i, p in enumerate(prompts)]  # ragged: 40, 29, 18 tokens
    return target, prompts


@functools.cache
def demo_draft(kind: str):
    target, _ = demo()
    if kind == "ngram":
        return js.NgramDraft(max_ngram=3)
    if kind == "hybrid":
        return js.HybridDraft(js.load_draft(DEMO_DRAFT, target), js.NgramDraft(max_ngram=3))
    return js.load_draft(DEMO_DFLASH if kind == "dflash" else DEMO_DRAFT, target)


def run(target, prompts, sampling, *, draft=None, spec=None, page=16, max_len=128, **kw):
    return js.generate(target, prompts, draft=draft, spec=spec, sampling=sampling,
                       engine=js.EngineConfig(page_size=page, max_batch=4, max_seq_len=max_len, steps_per_call=4, **kw),
                       progress=False)


@functools.cache
def demo_plain(key: str):
    target, prompts = demo()
    return run(target, prompts, SAMPLINGS[key])


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "size": {"type": "integer", "minimum": 10, "maximum": 99},
    "ok": {"type": "boolean"},
}, "required": ["name", "size"], "additionalProperties": False}
SAMPLINGS = {
    "signature": SP(regex=SIGNATURE),
    "json": SP(max_new_tokens=40, json_schema=SCHEMA),
    # Constrained and free rows in one batch.
    "mixed": [SP(regex=SIGNATURE), SP(), SP(max_new_tokens=40, json_schema=SCHEMA)],
    "free": SP(),
}


def test_regex_greedy_equals_the_partial_matching_oracle():
    target, prompts = demo()
    out = demo_plain("signature")
    tok, V = target.tokenizer, target.config.vocab_size
    vocab_text = token_texts(tok, V)
    eos = target.eos_token_ids[0]
    margins = []
    for prompt, tokens, stats in zip(prompts, out.token_ids, out.stats):
        logits = np.asarray(forward_sequence(target, jnp.asarray([prompt + tokens]))[0][0])  # [T, V]
        text = ""
        for j in range(len(tokens) + 1):
            allowed = np.asarray(oracle_allowed(SIGNATURE, text, vocab_text))
            allowed[eos] = oracle_final(SIGNATURE, text)
            if j == len(tokens):  # it ended: by max_new_tokens, at EOS, or where nothing is allowed
                if len(tokens) < MAX_NEW:
                    assert stats.finish_reason == "stop"
                    row = np.where(allowed, logits[len(prompt) + j - 1], -np.inf)
                    assert allowed[eos] and np.argmax(row) == eos  # EOS, or the only token left
                break
            row = np.where(allowed, logits[len(prompt) - 1 + j], -np.inf)
            assert np.argmax(row) == tokens[j], (text, vocab_text[tokens[j]])
            top2 = np.sort(row)[-2:]
            margins.append(top2[1] - top2[0])
            text += vocab_text[tokens[j]]
        assert re.fullmatch(SIGNATURE, text) or len(tokens) == MAX_NEW
    assert min(margins) > 1e-4  # no exact near-ties decide the comparison
    assert any(s.finish_reason == "stop" for s in out.stats)  # some output completed its match


# (EAGLE-3 chains at page 16: the preemption and compile tests below; n-gram chains: the tiny targets.)
DEMO_CASES = [
    ("eagle3", js.SpecConfig(num_steps=4, topk=4, num_draft_tokens=10), 1, "mixed"),
    ("dflash", js.SpecConfig.chain(7), 1, "json"),
    ("dflash", js.SpecConfig(num_steps=7, topk=2, num_draft_tokens=10), 16, "signature"),
    ("ngram", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 1, "signature"),
    ("hybrid", js.SpecConfig(num_steps=3, topk=1, num_draft_tokens=8, ngram_tokens=4), 16, "mixed"),
]


@pytest.mark.parametrize("draft,spec,page,sampling", DEMO_CASES,
                         ids=[f"{d}-{'chain' if s.is_chain else 'tree'}-page{p}-{k}" for d, s, p, k in DEMO_CASES])
def test_demo_drafts_equal_plain_under_constraints(draft, spec, page, sampling):
    target, prompts = demo()
    out = run(target, prompts, SAMPLINGS[sampling], draft=demo_draft(draft), spec=spec, page=page)
    assert out.token_ids == demo_plain(sampling).token_ids
    reasons = lambda o: [(s.finish_reason, s.stop_reason) for s in o.stats]  # noqa: E731
    assert reasons(out) == reasons(demo_plain(sampling))
    assert out.kv_pages_free == out.kv_pages_total
    if draft in ("eagle3", "dflash"):
        assert out.mean_accept_len > 1.3  # drafts propose what the grammar allows: they are accepted


def test_json_outputs_validate_and_free_rows_are_unchanged():
    target, prompts = demo()
    json_out, mixed, free = demo_plain("json"), demo_plain("mixed"), demo_plain("free")
    validator = jsonschema.Draft202012Validator(SCHEMA)
    complete = 0
    for text, stats in zip(json_out.texts + [mixed.texts[2]], json_out.stats + [mixed.stats[2]]):
        if stats.finish_reason == "stop":
            validator.validate(json.loads(text))
            complete += 1
        else:  # ran out of tokens: a prefix of a valid document
            assert stats.finish_reason == "length" and stats.num_tokens == 40
    assert complete >= 2
    # In the mixed batch each row is what it is alone: constrained rows as in their own batches,
    # the free row as in a batch with no constraint.
    assert mixed.token_ids[0] == demo_plain("signature").token_ids[0]
    assert mixed.token_ids[1] == free.token_ids[1]
    assert mixed.token_ids[2] == json_out.token_ids[2]
    assert free.token_ids != demo_plain("signature").token_ids  # the constraint changes the output


def test_preempted_requests_resume_their_automaton():
    target, prompts = demo()
    out = run(target, prompts, SAMPLINGS["mixed"], draft=demo_draft("eagle3"), spec=js.SpecConfig.chain(4),
              preempt_every=2, check_pages=True)
    assert out.token_ids == demo_plain("mixed").token_ids
    assert sum(s.preemptions for s in out.stats) >= 1


def test_another_constraint_of_the_same_size_compiles_nothing_new():
    target, prompts = demo()
    draft = demo_draft("eagle3")
    run(target, prompts, SP(regex=r"[0-9]{1,4}(, [0-9]{1,4})*"), draft=draft, spec=js.SpecConfig.chain(4))
    before = compiled_programs()
    out = run(target, prompts, SP(regex=r"[a-f]{1,4}(; [a-f]{1,4})*"), draft=draft, spec=js.SpecConfig.chain(4))
    assert compiled_programs() == before
    assert all(set(t) <= set("abcdef; ") for t in out.texts)


# ----------------------------------------------------------------------------- tiny golden targets


@functools.cache
def with_chars(target):
    """A golden target with a small character tokenizer (its vocabulary has no text of its own)."""
    return dataclasses.replace(target, tokenizer=char_tokenizer(target.config.vocab_size), eos_token_ids=(0,))


TINY_REGEX = r"[a-z]{2,6}( [a-z]{2,6}){1,3}\."


@functools.cache
def tiny_setup(kind: str):
    """(target with the character tokenizer, draft, prompts) of a tiny golden case."""
    if kind in ("eagle1", "ngram"):
        base = test_golden_heads.target("llama3")
        draft = js.load_draft(case_dir(next(c for c in cases("eagle1"))), base) if kind == "eagle1" else \
            js.NgramDraft(max_ngram=3)
        prompts = [[40, 41, 42, 43, 44], [50, 60], [70, 71, 72, 73, 74, 75, 76, 77]]
    elif kind == "dspark":  # the speculators goldens' DSpark (every slot drafting) on the DFlash goldens' target
        base = test_golden_dspark.target()
        draft = test_golden_dspark.draft("dspark_vanilla")
        prompts = [p[:8] for p in test_golden_dspark.case("dspark_vanilla")["prompts"]]
    else:
        case, base, draft, _ = test_mla_spec.golden("deepseek_v3_dense")
        prompts = [p[:8] for p in case["prompts"]] + [case["prompts"][0][:3]]
    return with_chars(base), draft, prompts


def tiny_sampling(n: int) -> list:
    # Row 1 cannot complete a match in 3 tokens (it needs at least 4): it ends by max_new_tokens.
    return [SP(regex=TINY_REGEX), SP(regex=TINY_REGEX, max_new_tokens=3)] + [SP()] * (n - 2)


@functools.cache
def tiny_plain(kind: str, page: int):
    target, _, prompts = tiny_setup(kind)
    return run(target, prompts, tiny_sampling(len(prompts)), page=page, max_len=64)


TINY_CASES = [
    ("eagle1", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 1),
    ("eagle1", js.SpecConfig.chain(3), 1),
    ("mtp", js.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4), 16),
    ("mtp", js.SpecConfig.chain(2), 16),
    ("ngram", js.SpecConfig.chain(3), 1),
    ("dspark", js.SpecConfig.chain(5, confidence_threshold=0.3), 16),  # Markov scan masked slot by slot
]


@pytest.mark.parametrize("kind,spec,page", TINY_CASES,
                         ids=[f"{k}-{'chain' if s.is_chain else 'tree'}-page{p}" for k, s, p in TINY_CASES])
def test_tiny_golden_drafts_equal_plain_under_constraints(kind, spec, page):
    target, draft, prompts = tiny_setup(kind)
    plain = tiny_plain(kind, page)
    out = run(target, prompts, tiny_sampling(len(prompts)), draft=draft, spec=spec, page=page, max_len=64)
    assert out.token_ids == plain.token_ids
    assert [s.finish_reason for s in out.stats] == [s.finish_reason for s in plain.stats]
    for text, s, sp in zip(plain.texts[:2], plain.stats[:2], tiny_sampling(len(prompts))):
        if s.finish_reason == "stop":  # a complete match (the regex allows nothing after its ".")
            assert re.fullmatch(TINY_REGEX, text), text
        else:  # max_new_tokens ran out before a complete match
            assert s.finish_reason == "length" and s.num_tokens == sp.max_new_tokens, (s, text)
            assert not re.fullmatch(TINY_REGEX, text), text
    assert plain.stats[1].finish_reason == "length" and len(plain.texts[1]) > 0
    assert out.stats[0].mean_accept_len > 1  # the constrained row accepted drafted tokens


# ----------------------------------------------------------------------------- bad input


def test_bad_constraints_are_refused_before_device_work():
    target, prompts = demo()
    with pytest.raises(ValueError, match="at most one of regex and json_schema"):
        js.SamplingParams(regex="a", json_schema={"type": "null"})
    with pytest.raises(ValueError, match="SamplingParams of request 1: .*lookahead"):
        run(target, prompts[:2], [SP(), SP(regex="(?=a)a")])
    with pytest.raises(ValueError, match="'uniqueItems'"):
        run(target, prompts[:1], SP(json_schema={"type": "array", "uniqueItems": True}))
    # The failing request is named whatever the message holds: a schema error does not quote the
    # schema, a long schema is not quoted at all, and a constraint shared by requests names them all.
    long_bad = dict(SCHEMA, properties=dict(SCHEMA["properties"], note={"type": "string", "minLength": 9,
                                                                       "maxLength": 3, "description": "x" * 300}))
    with pytest.raises(ValueError, match=r"SamplingParams of request 2: json_schema.note: minLength 9 > maxLength 3"):
        run(target, prompts, [SP(json_schema=SCHEMA), SP(), SP(json_schema=long_bad)])
    with pytest.raises(ValueError, match=r"SamplingParams of request 1: json_schema \(root\): 'enum' value 1"):
        run(target, prompts[:2], [SP(regex="a"), SP(json_schema={"type": "string", "enum": ["a", 1]})])
    with pytest.raises(ValueError, match="SamplingParams of requests 0, 2: .*backreference"):
        run(target, prompts, [SP(regex=r"(a)\1"), SP(regex="a"), SP(regex=r"(a)\1")])
    with pytest.raises(ValueError, match="not valid JSON"):
        js.SamplingParams(json_schema="{")
    bare = dataclasses.replace(target, tokenizer=None)
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        run(bare, prompts[:1], SP(regex="a+"))
    tiny = with_chars(test_golden_heads.target("llama3"))
    with pytest.raises(ValueError, match="no string of its language can be spelled"):
        run(tiny, [[1, 2]], SP(regex="\u00e9+"))  # the character tokenizer has no byte of "é"
