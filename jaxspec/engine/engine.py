"""``Engine``: a serving engine that keeps its KV pools, page allocators, prefix cache and
compiled programs across calls (``jaxspec.generate()`` is a throwaway one sized for its call)."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp

from jaxspec.config import EngineConfig, SamplingParams, SpecConfig
from jaxspec.engine.geometry import engine_geometry
from jaxspec.engine.host_loop import Run
from jaxspec.engine.placement import create_pool
from jaxspec.engine.requests import check_models, check_seed, sampling_list, tokenize
from jaxspec.mesh import DATA, axis_size
from jaxspec.model.drafts.base import DraftModel, zero_pool
from jaxspec.model.targets import Model, create_target_pool, exact_support, kv_layout
from jaxspec.results import GenerateOutput, StreamEvent
from jaxspec.spec.plan import Plan, verify_branches_on
from jaxspec.xla_options import program_backend, resolve_options


class Engine:
    """A serving engine that keeps its KV pools, page allocators, prefix cache and compiled
    programs across calls.

        engine = jaxspec.Engine(target, draft=draft, spec=spec, engine=jaxspec.EngineConfig(max_batch=16))
        out = engine.generate(prompts, sampling=jaxspec.SamplingParams(max_new_tokens=256))
        for event in engine.generate_stream(more_prompts): ...

    Its pools are sized once, for ``engine.max_batch`` requests of ``engine.max_seq_len`` tokens (or
    ``engine.num_pages`` pages); every call reuses them, and calls with the same shapes compile nothing
    new. One call runs at a time. ``jaxspec.generate()`` is a throwaway engine sized for its call.

    Raises:
      ValueError: a draft that does not fit the target or the spec, before any device work.
    """

    def __init__(self, target: Model, draft: DraftModel | None = None, spec: SpecConfig | None = None,
                 engine: EngineConfig | None = None, *, _batch: int | None = None, _longest: int | None = None):
        engine = engine or EngineConfig()
        check_models(target, draft, spec)
        mesh = target.mesh
        # A draft without parameters (NgramDraft) serves any mesh; its per-row state follows the rows.
        if draft is not None and jax.tree_util.tree_leaves(draft.params) and getattr(draft, "mesh", None) is not mesh:
            raise ValueError("the draft is not placed on the target's mesh: load it with load_draft(path, target)")
        adaptive = spec is not None and bool(spec.adaptive_steps)
        # The plan of every call, but for what its requests ask (sampling, controls, logprobs: ``Run``).
        plan = Plan(
            target=target.config,
            draft=None if draft is None else draft.config,
            spec=spec.with_steps(max(spec.adaptive_steps)) if adaptive else spec,  # buffers: the deepest
            page_size=engine.page_size,
            steps_per_call=engine.steps_per_call,
            implementation=engine.implementation,
            data_shards=axis_size(mesh, DATA),
            compiler_options=resolve_options(engine.compiler_options, program_backend(mesh)),
            exact=engine.exact,
            verify_branches=verify_branches_on(program_backend(mesh)),
        )
        if engine.exact:
            _check_exact(target, mesh)
        draft_layout = None if draft is None else draft.config.kv_layout
        geo = engine_geometry(plan, engine, kv_layout(target.config), draft_layout, requests=_batch, longest=_longest)
        self.uncacheable = geo.uncacheable  # why prompts are not cached (None: they are, when the engine caches)
        if engine.prefix_cache and geo.uncacheable:
            raise ValueError(f"EngineConfig(prefix_cache=True): this model's prompts cannot be cached: "
                             f"{geo.uncacheable}")
        self.geometry = geo
        self.target, self.draft, self.spec, self.plan, self.config = target, draft, spec, plan, engine
        self.dtype, self.batch, self.width = jnp.dtype(target.dtype), geo.batch, geo.width
        self.dparams = None if draft is None else draft.params
        self.create_pools()
        self.busy = False  # a call is running (its stream is open)

    def create_pools(self) -> None:
        """Fresh KV pools and page accounting (empty prefix cache)."""
        geo, target, draft, engine, mesh, dtype = (self.geometry, self.target, self.draft, self.config,
                                                   self.target.mesh, self.dtype)
        self.pages = geo.page_pools(prefix_cache=engine.prefix_cache is not False)
        sizes = geo.pool_sizes()
        self.tpool = create_pool(functools.partial(create_target_pool, target.config, dtype=dtype, **sizes),
                                 getattr(target.config, "tensor_parallel", 1) > 1, mesh)
        if draft is None:
            self.dpool = create_pool(functools.partial(zero_pool, engine.page_size, dtype), False, mesh)
        else:
            if not draft.config.kv_layout.entry_rates:  # only a draft with compressed KV of its own takes entry pools
                sizes.pop("entry_pages", None)
            sizes.pop("snapshot_rows", None)  # the target's recurrent-state snapshots
            self.dpool = create_pool(functools.partial(draft.config.create_pool, dtype=dtype, **sizes),
                                     draft.config.tensor_parallel > 1, mesh)

    def generate(self, prompts, *, sampling: SamplingParams | Sequence[SamplingParams] | None = None, seed: int = 0,
                 progress: bool | None = None) -> GenerateOutput:
        """``jaxspec.generate()`` on this engine's pools (same prompts, sampling, seed, progress)."""
        run = self._run(prompts, sampling, seed, progress)
        for _ in run.events():
            pass
        return run.output()

    def generate_stream(self, prompts, *, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                        seed: int = 0, progress: bool | None = False) -> Iterator[StreamEvent]:
        """``jaxspec.generate_stream()`` on this engine's pools. Closing the stream early ends the
        call: its requests' pages go back."""
        return self._run(prompts, sampling, seed, progress).events()

    def _run(self, prompts, sampling, seed, progress) -> Run:
        check_seed(seed)
        ids = tokenize(self.target, prompts)
        return Run(self, ids, sampling_list(sampling, len(ids)), seed=seed, progress=progress)


def _check_exact(target: Model, mesh) -> None:
    """The exact mode's refusals, by name, before any device work."""
    if mesh is not None and mesh.devices.size > 1:
        raise ValueError("EngineConfig(exact=True) runs on one device: on a mesh the tensor-parallel all-reduces "
                         "sum the shards' partial products in whatever order the collective takes")
    reason = exact_support(target.config)
    if reason:
        raise ValueError(f"EngineConfig(exact=True) cannot compute this {type(target.config).__name__} target "
                         f"exactly: {reason}")
