"""The compiled programs update the KV pools in place: the pools (and the state) passed to
``prefill_program`` / ``decode_program`` are donated, aliased to the outputs and gone after the
call, so a step never copies a pool."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec as js
from jaxspec.spec.plan import Plan
from jaxspec.engine.prefill import request_arrays
from jaxspec.engine.programs import decode_program, prefill_program
from jaxspec.engine.state import DecodeState
from jaxspec.model.targets import create_target_pool
from tests.spec.test_lossless import drafts


def test_decode_program_donates_and_aliases_the_pools(tiny_target):
    draft = drafts(tiny_target)["eagle3"]
    plan = Plan(target=tiny_target.config, draft=draft.config, spec=js.SpecConfig.chain(2), page_size=4,
                steps_per_call=2)
    B, W = 2, 8
    tpool = create_target_pool(tiny_target.config, num_pages=B * W + 1, page_size=4, dtype=jnp.float32)
    dpool = draft.config.create_pool(num_pages=B * W + 1, page_size=4, dtype=jnp.float32)
    state = DecodeState.empty(batch=B, out_width=16, num_stop=1, hidden_size=draft.config.hidden_size,
                              hidden_dtype=jnp.float32)
    table = jnp.asarray(1 + np.arange(B * W, dtype=np.int32).reshape(B, W))
    req = request_arrays(B, max_new=8)
    tokens = jnp.asarray([[3, 4, 5, 0], [7, 8, 0, 0]], jnp.int32)
    state, tpool, dpool = prefill_program(plan, tiny_target.params, draft.params, state, tpool, dpool, table,
                                          jnp.arange(B, dtype=jnp.int32), tokens, jnp.asarray([3, 2]), req)
    args = (plan, tiny_target.params, draft.params, state, tpool, dpool, table)
    hlo = decode_program.lower(*args).compile().as_text()
    aliased = re.search(r"input_output_alias=\{([^\n]*)\}", hlo).group(1)
    # Every pool buffer (and every state array) is an aliased parameter.
    n_aliased = len(re.findall(r"\(\d+, \{\}", aliased))
    n_donated = len(jax.tree.leaves((state, tpool, dpool)))
    assert n_aliased == n_donated, (n_aliased, n_donated)
    old_pools = (tpool.k, tpool.v, dpool.k, dpool.v)
    state, tpool, dpool, steps = decode_program(*args)
    assert int(steps) == 2
    assert all(x.is_deleted() for x in old_pools)
    assert not tpool.k.is_deleted() and int(state.out_lens.min()) >= 2
