"""The exact mode (``EngineConfig(exact=True)``) in bf16, with the kernels in interpret mode at the
tiles a GPU uses: a row's logits are the same bits whether computed alone in a decode step, as a row
of a verify chain, in a batch of another size or order, in a prefill of the whole prompt or of an
uncached tail; greedy speculative output equals plain greedy output bit for bit, tokens and
log-probabilities, with the default path (the same kernels' GPU path) showing why it is needed; the
refusals name what the mode does not cover. The full matrix (every draft kind, chain and tree, pages
1 and 16, preemption and the prefix cache) is ``scripts/check_exact.py``."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.checkpoints.checkpoint import read_config
from jaxspec.model.checkpoints.loader import target_family
from jaxspec.model.layers import padded_tokens
from jaxspec.model.targets import Model, create_target_pool, exact_support, target_forward, target_logits
from jaxspec.pallas import dispatch
from tests.conftest import PROMPTS_4, TINY, tiny_model
from tests.spec.test_lossless import drafts

P = 16
PROMPT = [5, 17, 33, 2, 9, 41, 7, 60, 3, 14, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 88, 13, 21, 34]


@functools.cache
def bf16_target() -> Model:
    """The tiny Llama in bf16, with soft distributions (small weights: near-ties happen)."""
    t = tiny_model(scale=0.05)
    return Model(config=t.config, params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), t.params),
                 dtype=np.dtype(jnp.bfloat16), eos_token_ids=())


def _row_logits(exact: bool, implementation=None) -> dict:
    """Logits (f32 bits) of the prompt's last 6 positions computed in several ways, from one fresh
    pool per way: each position's decode step alone; a verify chain of 6 and of 3 + 3; a prefill of
    the whole prompt; a prefill of the uncached tail after a 16-token prefix; a batch of 3 rows with
    the prompt's request in the middle."""
    model = bf16_target()
    cfg, params = model.config, model.params
    n = len(PROMPT)
    table = jnp.asarray([[1, 2, 3, 4]], jnp.int32)

    # Jitted as the engine runs it (one program a shape, where op by op compiled hundreds).
    @jax.jit
    def fwd(params, tokens, pos, pool, attn):
        out = target_forward(cfg, params, tokens, pos, pool, attn, implementation=implementation, exact=exact)
        return target_logits(cfg, params, out.hidden, exact=exact), out.pool

    def run(pool, tokens, start, rows=None):  # tokens [B, T] at positions start..; returns (logits, pool)
        tokens = np.asarray(tokens, np.int32)
        T = tokens.shape[1]
        pos = jnp.asarray(start)[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        tab = table if rows is None else jnp.asarray(rows, jnp.int32)
        attn = AttentionInputs.build(tab, jnp.asarray(start, jnp.int32), pos, P)
        logits, pool = fwd(params, jnp.asarray(tokens, jnp.int32), pos, pool, attn)
        return np.asarray(logits), pool

    def pool():
        return create_target_pool(cfg, num_pages=16, page_size=P, dtype=jnp.bfloat16)

    ways = {}
    logits, p = run(pool(), [PROMPT[:n - 6]], [0])
    decode = []
    for t in range(n - 6, n):  # one token a step, each after the last
        lg, p = run(p, [[PROMPT[t]]], [t])
        decode.append(lg[0, 0])
    ways["decode"] = np.stack(decode)
    base, p0 = run(pool(), [PROMPT[:n - 6]], [0])
    ways["verify 6"] = run(p0, [PROMPT[n - 6:]], [n - 6])[0][0]
    lg1, p1 = run(p0, [PROMPT[n - 6:n - 3]], [n - 6])
    ways["verify 3 + 3"] = np.concatenate([lg1[0], run(p1, [PROMPT[n - 3:]], [n - 3])[0][0]])
    ways["prefill"] = run(pool(), [PROMPT], [0])[0][0, n - 6:]
    _, pc = run(pool(), [PROMPT[:16]], [0])
    ways["prefill after a cached prefix"] = run(pc, [PROMPT[16:]], [16])[0][0, n - 6 - 16:]
    other = [PROMPT[::-1][:n - 6], PROMPT[3:n - 3]]
    rows = [[5, 6, 7, 8], [1, 2, 3, 4], [9, 10, 11, 12]]
    _, pb = run(pool(), [other[0], PROMPT[:n - 6], other[1]], [0, 0, 0], rows)
    toks = [other[0][:6], PROMPT[n - 6:], other[1][:6]]
    ways["row 1 of a batch of 3"] = run(pb, toks, [n - 6] * 3, rows)[0][1]
    return ways


def test_a_rows_logits_are_the_same_bits_however_it_is_computed():
    ways = _row_logits(exact=True)
    ref = ways.pop("decode")
    for name, lg in ways.items():
        np.testing.assert_array_equal(lg, ref, err_msg=name)


def test_padded_rows_change_no_bit():
    """With a GPU's row padding (``layers.padded_tokens``: a verify of 6 or 3 rows runs over 8), every
    way still gives the decode's bits. (``rows_padded_to``, not a patched ``product_rows``: the other
    tests' programs, traced unpadded, would be reused.)"""
    with dispatch.rows_padded_to(8):
        assert padded_tokens(1, 6) == 8 and padded_tokens(1, 3) == 8
        ways = _row_logits(exact=True)
    ref = ways.pop("decode")
    for name, lg in ways.items():
        np.testing.assert_array_equal(lg, ref, err_msg=name)


def test_the_default_kernels_are_not_bit_exact():
    """The same comparison on the default path with the Pallas kernels (a GPU's path, in interpret
    mode here): a verify row does not reproduce its decode's bits, which is what the mode fixes."""
    ways = _row_logits(exact=False, implementation="pallas")
    ref = ways.pop("decode")
    assert not all(np.array_equal(lg, ref) for lg in ways.values())


GREEDY = js.SamplingParams(max_new_tokens=20, logprobs=2)


@functools.cache
def plain(page: int, **engine):
    eng = js.EngineConfig(page_size=page, max_batch=4, max_seq_len=128, steps_per_call=4, exact=True, **engine)
    return js.generate(bf16_target(), PROMPTS_4, sampling=GREEDY, engine=eng)


CASES = [  # (draft, spec, page, engine extras): chain and tree, pages 1 and 16, preemption
    ("eagle3", js.SpecConfig.chain(3), 16, {}),
    ("perturbed", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=4), 1, {}),
    ("ngram", js.SpecConfig.chain(3), 1, dict(preempt_every=1, steps_per_call=2)),
]
def assert_same_bits(out, ref):
    assert out.token_ids == ref.token_ids
    for a, b in zip(out.logprobs, ref.logprobs):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("draft,spec,page,extra", CASES, ids=["eagle3-chain-p16", "tree-p1", "ngram-preempt-p1"])
def test_speculative_greedy_equals_plain_greedy_bit_for_bit(draft, spec, page, extra):
    target = bf16_target()
    d = js.NgramDraft() if draft == "ngram" else drafts(target)[draft]
    eng = js.EngineConfig(**{**dict(page_size=page, max_batch=4, max_seq_len=128, steps_per_call=4, exact=True),
                             **extra})
    out = js.generate(target, PROMPTS_4, draft=d, spec=spec, sampling=GREEDY, engine=eng)
    assert_same_bits(out, plain(page))
    if extra.get("preempt_every"):
        assert sum(s.preemptions for s in out.stats) > 0


def test_requests_joining_a_running_core_equal_plain_bit_for_bit():
    """The serving core in the exact mode (its general plan: sampling, filters, controls and top
    log-probabilities compiled in): three requests at once and a fourth that joins the running
    batch, each equal to plain greedy decoding bit for bit, tokens and log-probabilities."""
    from jaxspec.engine.core import EngineCore

    target = bf16_target()
    eng = js.Engine(target, draft=drafts(target)["perturbed"], spec=js.SpecConfig.chain(3),
                    engine=js.EngineConfig(page_size=P, max_batch=4, max_seq_len=128, steps_per_call=4, exact=True))
    ref = plain(P)
    with EngineCore(eng) as core:
        first = [core.add(p, GREEDY) for p in PROMPTS_4[:3]]
        head = next(iter(first[0]))  # the batch is running: the fourth joins it
        late = core.add(PROMPTS_4[3], GREEDY).result()
        results = [h.result() for h in first]  # the head event, read above, included
    assert results[0].token_ids[:len(head.token_ids)] == head.token_ids
    for i, r in enumerate(results + [late]):
        assert r.token_ids == ref.token_ids[i], i
        np.testing.assert_array_equal(np.asarray(r.logprobs, np.float32), np.asarray(ref.logprobs[i], np.float32))


def test_a_pard_draft_with_its_own_kv_equals_plain_bit_for_bit():
    """PARD (a draft LM with its own paged KV, proposing a block per step) on the PARD goldens'
    checkpoints loaded in bf16, ragged token-id prompts, page 16 (EAGLE-1 and the demo's kinds:
    ``scripts/check_exact.py``)."""
    from tests.model.golden import GOLDEN

    target = js.load_model(os.path.join(GOLDEN, "dflash", "target"), dtype="bfloat16", progress=False)
    draft = js.load_draft(os.path.join(GOLDEN, "pard", "pard_llama"), target)
    prompts = PROMPTS_4  # ragged: 7, 3, 12 and 1 tokens
    eng = js.EngineConfig(page_size=P, max_batch=4, max_seq_len=128, steps_per_call=4, exact=True)
    out = js.generate(target, prompts, draft=draft, spec=js.SpecConfig.chain(3), sampling=GREEDY, engine=eng)
    assert_same_bits(out, js.generate(target, prompts, sampling=GREEDY, engine=eng))
    assert max(np.concatenate([s.accept_lens for s in out.stats])) > 1  # proposals were accepted


def test_prefix_cache_hits_change_no_bit():
    """A persistent engine's second call finds the first call's prompt pages (one page of a
    shared 26-token prefix): its chain output equals plain greedy without a cache, bit for bit."""
    target = bf16_target()
    prompts = [PROMPT + p for p in PROMPTS_4]
    cfg = js.EngineConfig(page_size=P, max_batch=4, max_seq_len=128, steps_per_call=4, exact=True)
    engine = js.Engine(target, draft=drafts(target)["perturbed"], spec=js.SpecConfig.chain(2),
                       engine=dataclasses.replace(cfg, prefix_cache=True))
    engine.generate(prompts[:1], sampling=GREEDY)
    out = engine.generate(prompts, sampling=GREEDY)
    assert sum(s.cached_tokens for s in out.stats) >= len(prompts) * P
    assert_same_bits(out, js.generate(target, prompts, sampling=GREEDY, engine=dataclasses.replace(cfg, prefix_cache=False)))


@pytest.mark.parametrize("cfg,match", [
    (dataclasses.replace(TINY, sliding_window=8), "sliding-window"),
])
def test_what_the_mode_does_not_cover_is_refused_by_name(cfg, match):
    assert exact_support(TINY) is None
    assert match in exact_support(cfg)
    model = tiny_model(cfg=cfg)
    with pytest.raises(ValueError, match=match):
        js.Engine(model, engine=js.EngineConfig(exact=True))
    # A mesh is refused too: tests/mesh/test_mesh.py::test_bad_meshes_are_refused_before_device_work.


GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "golden")


@pytest.mark.parametrize("case,name", [
    ("sliding_window/gemma4_text", "Gemma4Config"),
    ("sliding_window/mistral_swa", "sliding-window"),
    ("deepseek_v3_moe", "DeepseekConfig"),
    ("deepseek_v32_dense", "DeepseekConfig"),
    ("deepseek_v4", "DeepseekV4Config"),
    ("hybrid/qwen3_5_dense", "HybridConfig"),
    ("hybrid/qwen3_next", "HybridConfig"),
])
def test_other_families_are_refused_by_name(case, name):
    """Every family the mode does not cover is refused when the engine is built, naming it (the
    checkpoints' own configs; nothing runs)."""
    path = os.path.join(GOLDEN, case)
    raw = read_config(path)
    family = target_family(raw, path)
    cfg = family.parse(raw, path)
    model = Model(config=cfg, params={}, dtype=np.dtype(jnp.bfloat16), eos_token_ids=())
    with pytest.raises(ValueError, match=name):
        js.Engine(model, engine=js.EngineConfig(exact=True))
