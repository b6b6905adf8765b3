"""Where the engine's device buffers live: the decode state, the target and draft KV pools and
the page table, on one device or on a ``("data", "model")`` mesh (``jaxspec.mesh``).

On a mesh every per-row array is split over ``data`` by rows; a pool's slots are split over
``data`` (each data shard owns a contiguous range of pages, page 0 of each its scratch page) and
its KV heads over ``model`` when the model is tensor parallel. Buffers are created directly in
their shards (never whole on one device first).

Glossary: B batch rows, D data shards, W page-table width.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxspec.engine.state import DecodeState
from jaxspec.mesh import DATA, MODEL


def run_context(mesh):
    """The context the compiled programs run in: ``jax.set_mesh(mesh)``, or nothing."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def pool_specs(pool, split_heads: bool, data: bool):
    """Partition specs of a pool's buffers (``pool.specs``) on the mesh axes in use."""
    return pool.specs(DATA if data else None, MODEL if split_heads else None)


def create(make, specs, mesh):
    """``make()`` evaluated straight into its shardings (``specs``: a matching pytree of
    PartitionSpecs), or on the default device without a mesh."""
    if mesh is None:
        return make()
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    return jax.jit(make, out_shardings=shardings)()


def create_pool(make_pool, split_heads: bool, mesh):
    """A KV pool (``make_pool()``) placed with its slots over data and heads over model."""
    if mesh is None:
        return make_pool()
    abstract = jax.eval_shape(make_pool)
    return create(make_pool, pool_specs(abstract, split_heads, data=True), mesh)


def create_state(make_state, mesh) -> DecodeState:
    """The decode state, every [B, ...] array split over data by rows (the grammar table whole)."""
    if mesh is None:
        return make_state()
    abstract = jax.eval_shape(make_state)
    return create(make_state, abstract.specs(DATA), mesh)


# The host tables handed to a program (page tables, snapshot and entry tables) are numpy arrays the
# scheduler goes on changing in place. ``jax.device_put`` of a numpy array onto CPU devices may
# alias its buffer (zero copy): the program, dispatched asynchronously, would then read whatever the
# host wrote after the call (the likely cause of a mesh case whose greedy output changed under load
# now and then; ``may_alias=False`` alone is not honoured for every sharding). On a GPU, where JAX
# lets the transfer take the buffer without a copy (PJRT's zero-copy semantics), the host-to-device
# copy may read it from another thread after the call has returned. So every path hands over a
# copy of its own, which nothing writes afterwards (a page table is kilobytes).
def _placed_copy(x: np.ndarray, mesh, spec: P) -> jax.Array:
    own = np.array(x)
    return jnp.asarray(own) if mesh is None else jax.device_put(own, NamedSharding(mesh, spec))


def place_table(page_table: np.ndarray, mesh) -> jax.Array:  # i32[B, W]
    """The page table (shard-local page ids), rows split over data; a copy of the host array."""
    return _placed_copy(page_table, mesh, P(DATA, None))


def place_rows(x: np.ndarray, mesh) -> jax.Array:  # [R, ...] rows grouped by data shard
    """Per-row host values, rows split over data; a copy of the host array."""
    return _placed_copy(x, mesh, P(DATA))


def to_host(tree):
    """Host (numpy) copies of a pytree of device arrays, whole on every process.

    ``jax.device_get`` where this process holds every shard; on a mesh spanning several processes
    (``jax.distributed``) each array is first replicated over its mesh in one program (an
    all-gather), so every process gets the same whole values and takes the same host decisions."""
    leaves = jax.tree.leaves(tree)
    if all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return jax.device_get(tree)
    mesh = next(x.sharding.mesh for x in leaves if not x.is_fully_addressable)
    whole = _replicate(mesh)(tree)
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), whole)


@functools.cache
def _replicate(mesh):
    return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))
