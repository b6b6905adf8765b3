"""Frozen-KV MTP assistant (docs/architecture.md#frozen-kv-assistants): reads the target's KV, writes none, keeps RoPE at
seq_len - 1, and runs its seed step as iteration 0 of the draft loop inside one executable."""

import functools
import json
import re
import sys

import jax
import jax.numpy as jnp
import pytest

import jaxspec as js
from jaxspec.engine.programs import decode_program
from jaxspec.model.drafts.assistant import assistant_config_for
from jaxspec.model.checkpoints.assistant import init_assistant_params, save_assistant
from jaxspec.model.config import ConfigError
from jaxspec.model.drafts import assistant_draft
from tests.conftest import PROMPTS_4, engine
from tests.spec.test_lossless import MAX_NEW, drafts, plain_greedy


@functools.cache
def assistant(target):
    cfg = assistant_config_for(target.config, hidden_size=48, num_heads=4, kv_layers=(3, 1))
    return assistant_draft(cfg, init_assistant_params(cfg, jax.random.PRNGKey(7), target.params, scale=0.2))


@pytest.mark.parametrize(
    "spec,page",
    [(js.SpecConfig.chain(3), 1), (js.SpecConfig.chain(4), 16), (js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 16),
     (js.SpecConfig(num_steps=2, topk=4, num_draft_tokens=8), 1)],
    ids=["chain3-page1", "chain4-page16", "tree_k2_n6-page16", "tree_k4_n8-page1"],
)
def test_frozen_kv_is_lossless(tiny_target, spec, page):
    out = js.generate(tiny_target, PROMPTS_4, draft=assistant(tiny_target), spec=spec,
                      sampling=js.SamplingParams(max_new_tokens=MAX_NEW), engine=engine(page, 4))
    assert out.token_ids == plain_greedy(tiny_target, page, 4)
    assert out.kv_pages_free == out.kv_pages_total


def _ops_in_loop_root(target, draft, spec, eng) -> list[str]:
    """Matmuls that the compiled decode program runs inside its while loop, in the draft
    loop's root scope (where a frozen-KV assistant's seed step is iteration 0)."""
    hlo = decode_program.lower(*_example_args(target, draft, spec, eng)).compile().as_text()
    return re.findall(r'op_name="jit\(decode_steps\)/while/body/draft_root/[^"]*dot_general"', hlo)


def test_one_speculative_step_is_one_executable(tiny_target):
    """With steps_per_call=1, one call of the compiled decode program performs a whole step:
    the seed iteration, S-1 recurrent drafts, verify and accept, with no other launch."""
    spec = js.SpecConfig.chain(3)
    eng = engine(16, 4, steps_per_call=1)
    draft = assistant(tiny_target)
    calls = []
    gen = sys.modules["jaxspec.engine.host_loop"]  # where the host loop calls the decode program
    original = gen.decode_program

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    gen.decode_program = counting
    try:
        out = js.generate(tiny_target, PROMPTS_4[:1], draft=draft, spec=spec,
                          sampling=js.SamplingParams(max_new_tokens=9), engine=eng)
    finally:
        gen.decode_program = original
    steps = len(out.stats[0].accept_lens)
    assert len(calls) == steps  # one executable call per speculative step
    # The assistant's seed forward runs inside that call's loop body (iteration 0 of the draft
    # loop), not in a separate program: its matmuls sit in the loop's root scope. An EAGLE head,
    # whose root is computed by the previous step's extend, has none there.
    assert len(_ops_in_loop_root(tiny_target, draft, spec, eng)) >= 2 * len(draft.config.model.kv_layers)
    assert _ops_in_loop_root(tiny_target, drafts(tiny_target)["eagle3"], spec, eng) == []


def _example_args(target, draft, spec, eng):
    from jaxspec.spec.plan import Plan
    from jaxspec.engine.state import DecodeState
    from jaxspec.model.targets import create_target_pool

    plan = Plan(target=target.config, draft=draft.config, spec=spec, page_size=eng.page_size, steps_per_call=1)
    state = DecodeState.empty(batch=1, out_width=16, num_stop=1, hidden_size=draft.config.hidden_size,
                              hidden_dtype=jnp.float32)
    tpool = create_target_pool(target.config, num_pages=5, page_size=16, dtype=jnp.float32)
    dpool = draft.config.create_pool(num_pages=5, page_size=16, dtype=jnp.float32)
    return plan, target.params, draft.params, state, tpool, dpool, jnp.zeros((1, 4), jnp.int32)


def test_save_and_load_round_trip(tiny_target, tmp_path):
    draft = assistant(tiny_target)
    save_assistant(str(tmp_path / "asst"), draft.config.model, draft.params)
    loaded = js.load_draft(tmp_path / "asst", tiny_target)
    assert loaded.kind == "frozen_kv" and loaded.config.model == draft.config.model
    out_a = js.generate(tiny_target, PROMPTS_4, draft=draft, spec=js.SpecConfig.chain(3),
                        sampling=js.SamplingParams(max_new_tokens=8), engine=engine(16, 4))
    out_b = js.generate(tiny_target, PROMPTS_4, draft=loaded, spec=js.SpecConfig.chain(3),
                        sampling=js.SamplingParams(max_new_tokens=8), engine=engine(16, 4))
    assert [s.accept_lens for s in out_a.stats] == [s.accept_lens for s in out_b.stats]


def test_assistant_that_does_not_fit_is_refused(tiny_target, tmp_path):
    draft = assistant(tiny_target)
    save_assistant(str(tmp_path / "asst"), draft.config.model, draft.params)
    cfg = json.loads((tmp_path / "asst" / "config.json").read_text())
    cfg["kv_layer_map"] = [9]
    (tmp_path / "asst" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="kv_layer_map \\[9\\] is outside the target's 4 layers"):
        js.load_draft(tmp_path / "asst", tiny_target)
