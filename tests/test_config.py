import dataclasses

import pytest

import jaxspec as js

BAD_SPECS = [
    (dict(num_steps=0, topk=1, num_draft_tokens=1), "num_steps must be a positive int"),
    (dict(num_steps=3, topk=0, num_draft_tokens=4), "topk must be a positive int"),
    (dict(num_steps=3, topk=1, num_draft_tokens=5), "chain .* num_steps \\+ 1"),
    (dict(num_steps=2, topk=2, num_draft_tokens=8), "exceeds the 6 candidates"),
    (dict(num_steps=3, topk=2, num_draft_tokens=1), "num_draft_tokens must be >= 2"),
    (dict(num_steps=2.5, topk=2, num_draft_tokens=4), "num_steps must be a positive int"),
]


@pytest.mark.parametrize("kwargs,match", BAD_SPECS, ids=[str(k) for k, _ in BAD_SPECS])
def test_spec_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        js.SpecConfig(**kwargs)


@pytest.mark.parametrize("S,K,n", [(1, 1, 2), (5, 1, 6), (5, 4, 8), (2, 2, 7), (1, 8, 9), (5, 16, 64)])
def test_spec_config_accepts_and_hashes(S, K, n):
    spec = js.SpecConfig(num_steps=S, topk=K, num_draft_tokens=n)
    assert hash(spec) == hash(js.SpecConfig(num_steps=S, topk=K, num_draft_tokens=n))
    assert spec.num_candidates == K + (S - 1) * K * K
    assert js.SpecConfig.chain(S) == js.SpecConfig(num_steps=S, topk=1, num_draft_tokens=S + 1)


BAD_SAMPLING = [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "finite"),
    (dict(top_p=0.0), "top_p must be in \\(0, 1\\]"),
    (dict(top_p=1.5), "top_p must be in \\(0, 1\\]"),
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive int"),
    (dict(stop_token_ids=(3, -1)), "stop_token_ids"),
    (dict(seed=-2), "seed"),
]


@pytest.mark.parametrize("kwargs,match", BAD_SAMPLING, ids=[str(k) for k, _ in BAD_SAMPLING])
def test_sampling_params_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        js.SamplingParams(**kwargs)


BAD_ENGINE = [
    (dict(page_size=0), "page_size"),
    (dict(max_batch=0), "max_batch"),
    (dict(min_prefill_rows=0), "min_prefill_rows must be a positive int"),
    (dict(num_pages=1), "num_pages must be >= 2"),
    (dict(implementation="cuda"), "implementation"),
    (dict(implementation={"flash_attention": "pallas"}), "unknown op 'flash_attention'"),
    (dict(implementation={"kv_move": "triton"}), "implementation for kv_move"),
    (dict(implementation=["pallas"]), "implementation"),
    (dict(compiler_options={"xla_no_such_option": True}), "compiler_options: option 'xla_no_such_option'"),
]


@pytest.mark.parametrize("kwargs,match", BAD_ENGINE, ids=[str(k) for k, _ in BAD_ENGINE])
def test_engine_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        js.EngineConfig(**kwargs)


def test_engine_config_takes_a_per_op_implementation_mapping():
    # A mapping is stored as sorted (op, choice) pairs: hashable (a jit-static plan holds it),
    # order-independent, and stable under dataclasses.replace (which re-runs __post_init__).
    a = js.EngineConfig(implementation={"kv_move": "xla", "paged_attention": "pallas", "mla_attention": None})
    b = js.EngineConfig(implementation={"paged_attention": "pallas", "mla_attention": None, "kv_move": "xla"})
    pairs = (("kv_move", "xla"), ("mla_attention", None), ("paged_attention", "pallas"))
    assert a.implementation == b.implementation == pairs
    assert hash(a) == hash(b) and a == b
    assert dataclasses.replace(a, page_size=4).implementation == pairs
    assert js.EngineConfig(implementation=pairs) == a
    assert js.EngineConfig(implementation="xla").implementation == "xla"
