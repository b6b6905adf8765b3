"""generate(): batching, stops, limits, continuous batching, steady-state compilation, errors."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

import jaxspec as js
from jaxspec.engine.programs import compiled_programs
from jaxspec.model.drafts import standalone_draft
from tests.conftest import PROMPTS_4, engine, tiny_model
from tests.model.golden import GOLDEN

GREEDY = js.SamplingParams(max_new_tokens=24)
TREE = js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=4)


def plain(model, prompts=PROMPTS_4, sampling=GREEDY, eng=None):
    return js.generate(model, prompts, sampling=sampling, engine=eng or engine(16, 4))


def test_batched_equals_one_by_one(tiny_target):
    batched = plain(tiny_target).token_ids
    for i, p in enumerate(PROMPTS_4):
        assert js.generate(tiny_target, [p], sampling=GREEDY, engine=engine(16, 4)).token_ids[0] == batched[i]


@pytest.mark.parametrize("spec", [None, js.SpecConfig.chain(3), TREE], ids=["plain", "chain", "tree"])
def test_stop_tokens_end_requests_and_are_not_emitted(tiny_target, spec):
    ref = plain(tiny_target).token_ids
    stop = ref[0][5]  # a token the first request emits at position 5
    sampling = js.SamplingParams(max_new_tokens=24, stop_token_ids=(stop,))
    draft = standalone_draft(tiny_target) if spec else None
    out = js.generate(tiny_target, PROMPTS_4, draft=draft, spec=spec, sampling=sampling, engine=engine(16, 4))
    for r, o in zip(ref, out.token_ids):
        cut = r.index(stop) if stop in r else len(r)
        assert o == r[:cut]
        assert stop not in o


@pytest.mark.parametrize("spec", [None, js.SpecConfig.chain(3), TREE], ids=["plain", "chain", "tree"])
def test_max_new_tokens_per_request_is_exact(tiny_target, spec):
    limits = [1, 5, 24, 7]
    sampling = [js.SamplingParams(max_new_tokens=m) for m in limits]
    draft = standalone_draft(tiny_target) if spec else None
    out = js.generate(tiny_target, PROMPTS_4, draft=draft, spec=spec, sampling=sampling, engine=engine(16, 4))
    ref = plain(tiny_target).token_ids
    for m, r, o in zip(limits, ref, out.token_ids):
        assert o == r[:m]


def test_continuous_batching_and_page_accounting(tiny_target):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 96, size=int(n)).tolist() for n in rng.integers(1, 30, size=9)]
    limits = rng.integers(1, 20, size=9)
    sampling = [js.SamplingParams(max_new_tokens=int(m)) for m in limits]
    eng = engine(4, max_batch=2, num_pages=40)
    out = js.generate(tiny_target, prompts, sampling=sampling, engine=eng)
    assert out.kv_pages_free == out.kv_pages_total == 39
    # Admitting as rows free up gives what one big batch gives.
    at_once = js.generate(tiny_target, prompts, sampling=sampling, engine=engine(4, max_batch=16))
    assert out.token_ids == at_once.token_ids
    assert [len(o) for o in out.token_ids] == limits.tolist()
    spec_out = js.generate(tiny_target, prompts, draft=standalone_draft(tiny_target), spec=TREE, sampling=sampling,
                           engine=eng)
    assert spec_out.token_ids == out.token_ids
    assert spec_out.kv_pages_free == spec_out.kv_pages_total


def test_steady_state_does_not_recompile(tiny_target):
    eng = engine(16, 4)
    draft = standalone_draft(tiny_target)
    js.generate(tiny_target, PROMPTS_4, draft=draft, spec=TREE, sampling=GREEDY, engine=eng)
    before = compiled_programs()
    other = [[t + 1 for t in p] for p in PROMPTS_4]  # new contents, same length buckets
    js.generate(tiny_target, other, draft=draft, spec=TREE, sampling=GREEDY, engine=eng)
    js.generate(tiny_target, PROMPTS_4[::-1], draft=draft, spec=TREE, sampling=GREEDY, engine=eng)
    assert compiled_programs() == before


def test_sampling_is_seeded(tiny_target):
    hot = js.SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=16)
    a = plain(tiny_target, sampling=hot, eng=engine(16, 4))
    b = js.generate(tiny_target, PROMPTS_4, sampling=hot, engine=engine(16, 4), seed=0)
    c = js.generate(tiny_target, PROMPTS_4, sampling=hot, engine=engine(16, 4), seed=1)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    # A per-request seed fixes that request's output wherever it sits in the batch.
    own = js.SamplingParams(temperature=1.0, max_new_tokens=16, seed=1234)
    first = js.generate(tiny_target, [PROMPTS_4[1], PROMPTS_4[0]], sampling=[own, hot], engine=engine(16, 4))
    second = js.generate(tiny_target, [PROMPTS_4[2], PROMPTS_4[1]], sampling=[hot, own], engine=engine(16, 4))
    assert first.token_ids[0] == second.token_ids[1]


def test_mixed_greedy_and_sampled_rows(tiny_target):
    hot = js.SamplingParams(temperature=1.0, max_new_tokens=24)
    out = js.generate(tiny_target, PROMPTS_4, sampling=[GREEDY, hot, GREEDY, hot], engine=engine(16, 4))
    ref = plain(tiny_target).token_ids
    assert out.token_ids[0] == ref[0] and out.token_ids[2] == ref[2]


def test_stats_are_reported(tiny_target):
    out = js.generate(tiny_target, PROMPTS_4, draft=standalone_draft(tiny_target), spec=js.SpecConfig.chain(3),
                      sampling=GREEDY, engine=engine(16, 4))
    for s, toks in zip(out.stats, out.token_ids):
        assert s.num_tokens == len(toks)
        assert s.mean_accept_len == pytest.approx(np.mean(s.accept_lens))
        assert s.tokens_per_s > 0
        # Every verify step emits accept_len tokens; the prefill emits the first one.
        assert sum(s.accept_lens) + 1 >= len(toks)
    assert out.mean_accept_len == 4.0


BAD_INPUTS = [
    (lambda m: dict(prompts=[]), "prompts is empty"),
    (lambda m: dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    (lambda m: dict(prompts=[[1, 96]]), "token id 96 outside the vocabulary"),
    (lambda m: dict(prompts=[[-1]]), "token id -1 outside"),
    (lambda m: dict(prompts=["hello"]), "no tokenizer"),
    (lambda m: dict(prompts=[[1] * 120], sampling=js.SamplingParams(max_new_tokens=20)), "> max_seq_len 128"),
    (lambda m: dict(prompts=[[1]], draft=standalone_draft(m)), "without a SpecConfig"),
    (lambda m: dict(prompts=[[1]], spec=TREE), "without a draft"),
    (lambda m: dict(prompts=[[1], [2]], sampling=[GREEDY]), "list of 2 SamplingParams"),
    (lambda m: dict(prompts=[[1] * 40], engine=engine(4, num_pages=5)), "KV cache too small"),
    (lambda m: dict(prompts="abc"), "list of strings"),
    (lambda m: dict(prompts=[1, 2, 3]), "prompt 0 is a token id"),
    (lambda m: dict(prompts=[{"role": "user", "content": "hi"}]), "is one chat"),
]


@pytest.mark.parametrize("make,match", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_raises_clear_error(tiny_target, make, match):
    kwargs = dict(sampling=GREEDY, engine=engine(16, 4)) | make(tiny_target)
    prompts = kwargs.pop("prompts")
    with pytest.raises(ValueError, match=match):
        js.generate(tiny_target, prompts, **kwargs)


def test_draft_that_does_not_fit_is_refused(tiny_target):
    other = tiny_model(cfg=tiny_target.config.__class__(**{**tiny_target.config.__dict__, "vocab_size": 80}))
    with pytest.raises(ValueError, match="vocabulary \\(80\\) does not match the target's \\(96\\)"):
        js.generate(tiny_target, [[1]], draft=standalone_draft(other), spec=TREE, sampling=GREEDY, engine=engine())


def _tiny_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, speculative decoding in jax"], trainer)
    tok.save(os.path.join(path, "tokenizer.json"))


def test_string_prompts_with_a_tokenizer(tmp_path):
    shutil.copytree(os.path.join(GOLDEN, "llama3"), tmp_path / "m")
    _tiny_tokenizer(str(tmp_path / "m"))
    model = js.load_model(tmp_path / "m", dtype="float32")
    assert model.tokenizer is not None and model.eos_token_ids == (2,)
    tok = js.load_tokenizer(tmp_path / "m")
    out = js.generate(model, ["hello world"], sampling=js.SamplingParams(max_new_tokens=8), engine=engine(16, 4))
    ids = js.generate(model, [tok.encode("hello world")], sampling=js.SamplingParams(max_new_tokens=8),
                      engine=engine(16, 4))
    assert out.token_ids == ids.token_ids
    # The text is decoded as it streams: a character whose bytes the last tokens left incomplete is not
    # in it (a full decode shows it as U+FFFD); the random model here emits such byte tokens.
    full = tok.decode(out.token_ids[0])
    assert out.texts[0] == full.rstrip("\ufffd") and len(full) - len(out.texts[0]) <= 1


def _copy_golden(tmp_path, name="llama3"):
    dst = tmp_path / name
    shutil.copytree(os.path.join(GOLDEN, name), dst)
    return dst


LOAD_ERRORS = [
    ("missing_dir", lambda d: shutil.rmtree(d), FileNotFoundError, "checkpoint directory not found"),
    ("missing_config", lambda d: os.remove(d / "config.json"), FileNotFoundError, "config.json"),
    ("missing_weights", lambda d: os.remove(d / "model.safetensors"), FileNotFoundError, "no weights in"),
    ("unsupported_arch", lambda d: _edit(d, architectures=["GPT2LMHeadModel"], model_type="gpt2"), ValueError,
     "unsupported architecture"),
    ("bad_field", lambda d: _edit(d, hidden_size="big"), ValueError, "hidden_size"),
    ("bad_rope", lambda d: _edit(d, rope_scaling={"rope_type": "dynamic-ntk-xyz", "factor": 2.0},
                                 rope_parameters=None), ValueError, "unsupported rope scaling"),
    ("misshaped", lambda d: _edit(d, intermediate_size=99), ValueError, "has shape .* expected"),
    ("missing_tensor", lambda d: _edit(d, num_hidden_layers=8), ValueError, "missing tensor 'model.layers.7"),
]


def _edit(d, **fields):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in fields.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("name,corrupt,exc,match", LOAD_ERRORS, ids=[e[0] for e in LOAD_ERRORS])
def test_load_model_errors(tmp_path, name, corrupt, exc, match):
    d = _copy_golden(tmp_path)
    corrupt(d)
    with pytest.raises(exc, match=match):
        js.load_model(d, dtype="float32")


def test_load_model_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        js.load_model(_copy_golden(tmp_path), dtype="int3")


def test_load_model_bfloat16(tmp_path):
    model = js.load_model(_copy_golden(tmp_path), dtype="bfloat16")
    assert model.params["embed"].dtype == jax.numpy.bfloat16
    out = js.generate(model, [[1, 2, 3]], sampling=js.SamplingParams(max_new_tokens=4), engine=engine(16, 4))
    assert len(out.token_ids[0]) == 4


def test_a_prefill_floor_of_rows_and_length_compiles_one_prefill_program(tiny_target):
    """Six prompts of 2 to 40 tokens through 4 rows, the first four prefilled together and the last
    two when rows free up: with ``min_prefill_rows`` at the batch and ``min_prefill_bucket`` past the
    longest prompt both prefills run one program, where the defaults compile another for 2 rows
    of 32 positions; the output is the same."""
    prompts = [[(7 * i + 3 * j) % 90 + 3 for j in range(n)] for i, n in enumerate((2, 40, 7, 3, 25, 12))]  # no shared prefix
    sampling = [js.SamplingParams(max_new_tokens=n) for n in (4, 6, 3, 5, 6, 4)]
    sizes = dict(page_size=8, max_batch=4, max_seq_len=96, steps_per_call=2)
    before = compiled_programs()["prefill"]
    floored = js.generate(tiny_target, prompts, sampling=sampling, progress=False,
                          engine=js.EngineConfig(**sizes, min_prefill_rows=4, min_prefill_bucket=64))
    assert compiled_programs()["prefill"] - before == 1
    before = compiled_programs()["prefill"]
    default = js.generate(tiny_target, prompts, sampling=sampling, progress=False, engine=js.EngineConfig(**sizes))
    assert compiled_programs()["prefill"] - before >= 1
    assert floored.token_ids == default.token_ids


def test_live_kv_buckets_equal_full_width_and_stop_compiling(tiny_target):
    """With a small ``min_kv_bucket`` each call attends over a page table cut to a power-of-two
    bucket of the live context: the output equals full-width attention, several buckets are
    compiled on the way, and a second run of the same shapes compiles nothing new."""
    draft = standalone_draft(tiny_target)
    spec = js.SpecConfig.chain(1)
    sampling = js.SamplingParams(max_new_tokens=64)
    prompts = [[11, 22, 33, 44, 55]]
    full = js.generate(tiny_target, prompts, draft=draft, spec=spec, sampling=sampling,
                       engine=engine(4, 1, steps_per_call=2))
    before = compiled_programs()
    small = engine(4, 1, steps_per_call=2, min_kv_bucket=8)
    live = js.generate(tiny_target, prompts, draft=draft, spec=spec, sampling=sampling, engine=small)
    assert live.token_ids == full.token_ids
    assert compiled_programs()["decode"] - before["decode"] >= 3  # 4, 8, 16 (and 32) pages
    after = compiled_programs()
    js.generate(tiny_target, [[12, 23, 34, 45, 56]], draft=draft, spec=spec, sampling=sampling, engine=small)
    assert compiled_programs() == after
