"""The compiled programs: prefill (admit requests) and the decode loop (K steps per call).

Both take the static ``Plan`` and donate the state and the KV pools, so the pools are
updated in place. One executable call runs up to ``plan.steps_per_call`` speculative steps
in a ``lax.while_loop``, stopping early when every row is done: no host work between steps, but
XLA:GPU reads the loop's condition on the host each step (its trip count is not known), a round
trip the H100 trace shows at every step's start (benchmarks/RESULTS.md).

On a mesh with several data shards, each program runs per shard of the ``data`` axis
(``jax.shard_map``): a shard's rows, its pool slots and its shard-local page table; the
``model`` axis is left to XLA and to the per-shard ops of the model (``jaxspec.mesh``).

Each program is compiled with the XLA options its plan carries (``Plan.compiler_options``, from
``jaxspec.xla_options``): ``jax.jit`` fixes its options per jit object, so a ``Program`` keeps one
per option set and hands a call to the one its plan names.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxspec.spec.plan import Plan
from jaxspec.spec.step import spec_step
from jaxspec.engine.prefill import prefill
from jaxspec.engine.state import DecodeState, commit
from jaxspec.mesh import DATA


def _rows(tree):
    return jax.tree.map(lambda _: P(DATA), tree)


def _slots(pool):
    return pool.specs(DATA, None)


def _per_data_shard(fn, plan: Plan, in_specs, out_specs):
    """``fn`` run per shard of the mesh's data axis (``jax.shard_map``), or ``fn`` itself."""
    if plan.data_shards == 1:
        return fn

    def call(*args):
        # Zero-size arrays (a zero-layer pool) stay outside the manual region: they hold nothing,
        # and jax 0.11.2's Shardy canonicalizer crashes on one that crosses a shard_map.
        flat, tree = jax.tree.flatten(args)
        specs = _spec_leaves(args, in_specs)
        out_struct = jax.eval_shape(  # tracing only: nothing is compiled here
            jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names={DATA}, check_vma=False), *args)
        out_flat, out_tree = jax.tree.flatten(out_struct)
        out_specs_flat = _spec_leaves(out_struct, out_specs)
        keep = [x.size > 0 for x in flat]
        keep_out = [x.size > 0 for x in out_flat]

        def inner(*kept):
            it = iter(kept)
            full = [next(it) if k else jnp.zeros(x.shape, x.dtype) for k, x in zip(keep, flat)]
            outs = jax.tree.leaves(fn(*tree.unflatten(full)))
            return tuple(o for o, k in zip(outs, keep_out) if k)

        kept_out = jax.shard_map(
            inner, in_specs=tuple(s for s, k in zip(specs, keep) if k),
            out_specs=tuple(s for s, k in zip(out_specs_flat, keep_out) if k), axis_names={DATA}, check_vma=False,
        )(*(x for x, k in zip(flat, keep) if k))
        it = iter(kept_out)
        return out_tree.unflatten([next(it) if k else jnp.zeros(x.shape, x.dtype) for k, x in zip(keep_out, out_flat)])

    return call


def _spec_leaves(values: tuple, specs: tuple) -> list:
    """One PartitionSpec per leaf of ``values`` (a spec given for a whole argument applies to
    every leaf of it)."""
    out = []
    for value, spec in zip(values, specs):
        n = len(jax.tree.leaves(value))
        if isinstance(spec, P):
            out += [spec] * n
        else:
            out += jax.tree.leaves(spec, is_leaf=lambda x: isinstance(x, P))
    return out


class Program:
    """A jitted program (its first argument the static ``Plan``) compiled with the plan's XLA
    options: one ``jax.jit`` of ``fn`` per option set, made on first use. Called, or lowered, like
    that jit object."""

    def __init__(self, fn, **jit_kwargs):
        self.fn, self.jit_kwargs = fn, jit_kwargs
        self.jits: dict[tuple, object] = {}  # Plan.compiler_options -> jax.jit of fn with them

    def jit_for(self, options: tuple):
        jitted = self.jits.get(options)
        if jitted is None:
            jitted = self.jits[options] = jax.jit(self.fn, compiler_options=dict(options) or None,
                                                  **self.jit_kwargs)
        return jitted

    def __call__(self, plan: Plan, *args, **kwargs):
        return self.jit_for(plan.compiler_options)(plan, *args, **kwargs)

    def lower(self, plan: Plan, *args, **kwargs):
        return self.jit_for(plan.compiler_options).lower(plan, *args, **kwargs)

    def cache_size(self) -> int:
        """Compiled variants over every option set."""
        return sum(j._cache_size() for j in self.jits.values())


def prefill_requests(plan: Plan, tparams, dparams, state: DecodeState, tpool, dpool, page_table, rows, tokens, lens,
                     request):
    """Prefills the admitted requests into their rows: (state, tpool, dpool)."""
    fn = _per_data_shard(
        functools.partial(prefill, plan), plan,
        in_specs=(P(), P(), state.specs(DATA), _slots(tpool), _slots(dpool), P(DATA), P(DATA), P(DATA), P(DATA),
                  _rows(request)),
        out_specs=(state.specs(DATA), _slots(tpool), _slots(dpool)),
    )
    return fn(tparams, dparams, state, tpool, dpool, page_table, rows, tokens, lens, request)


def decode_step(plan: Plan, tparams, dparams, state: DecodeState, tpool, dpool, page_table):
    """One speculative step for every row, committed: (state, tpool, dpool)."""
    out, tpool, dpool = spec_step(plan, tparams, dparams, state.step_rows(), tpool, dpool, page_table)
    return commit(state, out), tpool, dpool


def decode_steps(plan: Plan, tparams, dparams, state: DecodeState, tpool, dpool, page_table):
    """Up to ``plan.steps_per_call`` steps in one ``lax.while_loop``; returns
    (state, tpool, dpool, steps_run)."""

    def run(tparams, dparams, state, tpool, dpool, page_table):
        def cond(carry):
            i, st, _, _ = carry
            busy = jnp.any(st.active)
            if plan.data_shards > 1:  # every shard loops as long as any has work (one trip count)
                busy = jax.lax.psum(busy.astype(jnp.int32), DATA) > 0
            return (i < plan.steps_per_call) & busy

        def body(carry):
            i, st, tp, dp = carry
            return i + 1, *decode_step(plan, tparams, dparams, st, tp, dp, page_table)

        steps, state, tpool, dpool = jax.lax.while_loop(cond, body, (jnp.int32(0), state, tpool, dpool))
        return state, tpool, dpool, steps

    run = _per_data_shard(run, plan, in_specs=(P(), P(), state.specs(DATA), _slots(tpool), _slots(dpool), P(DATA)),
                          out_specs=(state.specs(DATA), _slots(tpool), _slots(dpool), P()))
    return run(tparams, dparams, state, tpool, dpool, page_table)


_DONATED = ("state", "tpool", "dpool")
prefill_program = Program(prefill_requests, static_argnames=("plan",), donate_argnames=_DONATED)
decode_program = Program(decode_steps, static_argnames=("plan",), donate_argnames=_DONATED)


def compiled_programs() -> dict[str, int]:
    """Number of compiled variants of each program, over every option set (used to prove steady
    state)."""
    return {"prefill": prefill_program.cache_size(), "decode": decode_program.cache_size()}
