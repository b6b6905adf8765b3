"""Several devices: the ``("data", "model")`` mesh and the per-shard helpers every layer uses.

A model placed on a mesh (``load_model(..., mesh=)``) has its weights split Megatron-style over
the ``model`` axis (column-parallel q/k/v/gate/up, row-parallel o/down, vocab-parallel embedding
and head, KV pools split by KV head, MoE experts split) and replicated over ``data``; batch rows
and their KV pages split over ``data``. Matmuls are partitioned by XLA from the weights'
shardings; what XLA cannot partition well (paged attention, KV moves, the embedding lookup) runs
per shard through ``per_model_shard``, which is a plain call without a mesh.

With a mesh, the compiled programs run under ``jax.set_mesh(mesh)``; inside them
``model_parallel()`` says how many shards the ``model`` axis has. A mesh may span the processes
of a ``jax.distributed`` job (several hosts): every process runs the same program over it, reads
device state whole (``jaxspec.engine.placement.to_host``), and checks that the others load the
same checkpoints (``same_on_every_process``).
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA, MODEL = "data", "model"


def make_mesh(tensor_parallel: int = 1, data_parallel: int = 1, *, devices=None) -> Mesh:
    """A ``jax.sharding.Mesh`` of ``data_parallel x tensor_parallel`` devices, axes ("data", "model").

    On several hosts call ``jax.distributed.initialize()`` first; ``jax.devices()`` then lists
    every host's devices (host by host) and the same code runs on each: the model axis runs
    over one host's devices first, so tensor parallelism stays within a host while it can.

    Raises:
      ValueError: a non-positive size; more devices asked for than are present (without
        ``jax.distributed.initialize()`` only this process's devices are); a mesh leaving out
        every device of some process of a ``jax.distributed`` job (each runs the same program
        over the mesh).
    """
    for name, n in (("tensor_parallel", tensor_parallel), ("data_parallel", data_parallel)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"make_mesh: {name} must be a positive int, got {n!r}")
    devices = list(jax.devices() if devices is None else devices)
    need = tensor_parallel * data_parallel
    if need > len(devices):
        hint = ("; a mesh over several hosts needs jax.distributed.initialize() on every host before make_mesh"
                if jax.process_count() == 1 else f" in the {jax.process_count()} processes")
        raise ValueError(
            f"make_mesh: data_parallel {data_parallel} x tensor_parallel {tensor_parallel} = {need} devices, but "
            f"only {len(devices)} are present ({devices[0].platform}){hint}"
        )
    import numpy as np

    grid = np.asarray(devices[:need], dtype=object).reshape(data_parallel, tensor_parallel)
    missing = sorted(set(range(jax.process_count())) - {d.process_index for d in grid.flat})
    if missing:
        raise ValueError(
            f"make_mesh: a mesh of {need} of the {len(devices)} devices leaves out every device of process(es) "
            f"{missing}, but each process of a jax.distributed job runs the same program over the mesh; use all "
            f"{len(devices)} devices (data_parallel x tensor_parallel = {len(devices)})"
        )
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def spans_processes(mesh: Mesh | None) -> bool:
    """Whether ``mesh`` holds devices of several processes (a ``jax.distributed`` job)."""
    return mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1


_checks = 0  # calls of same_on_every_process so far (every process makes them in the same order)


def same_on_every_process(what: str, digest: str, timeout_s: float = 600.0) -> None:
    """Raises a ValueError on every process of a ``jax.distributed`` job whose processes hold
    different ``digest`` values of ``what`` (e.g. a checksum of a checkpoint's config and tensor
    index): exchanged through the job's coordinator, with no device work. Nothing on one process."""
    global _checks
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the coordinator's key-value store (no public handle in JAX)

    client = distributed.global_state.client
    _checks += 1
    key = f"jaxspec/same/{_checks}"
    client.key_value_set(f"{key}/{jax.process_index()}", digest)
    seen = []
    for p in range(jax.process_count()):
        try:
            seen.append(client.blocking_key_value_get(f"{key}/{p}", int(timeout_s * 1000)))
        except Exception as e:  # the coordinator's timeout (its exception type is not public)
            raise ValueError(
                f"process {p} did not report its {what} within {timeout_s:g} s: it failed before this check or "
                f"runs different code ({type(e).__name__}); every process must run the same script"
            ) from None
    differ = [p for p, d in enumerate(seen) if d != seen[0]]
    if differ:
        raise ValueError(
            f"{what} differs between the processes of this jax.distributed job: process 0 has {seen[0][:16]}..., "
            + ", ".join(f"process {p} has {seen[p][:16]}..." for p in differ)
            + "; every process must load the same checkpoint (its path may differ between hosts)"
        )


def axis_size(mesh: Mesh | None, axis: str) -> int:
    return 1 if mesh is None else int(mesh.shape[axis])


def model_parallel() -> int:
    """Shards of the ``model`` axis of the mesh the current program runs under (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or MODEL not in mesh.axis_names:
        return 1
    return int(mesh.shape[MODEL])


def per_model_shard(fn, in_specs, out_specs, shards: int):
    """``fn`` run on each of the ``shards`` shards of the ``model`` axis (``jax.shard_map`` over
    that axis alone, the rest left to XLA); ``fn`` itself when ``shards`` is 1."""
    if shards == 1:
        return fn
    if model_parallel() != shards:
        raise ValueError(
            f"a model split over {shards} shards runs under its mesh (jax.set_mesh(mesh) with a model axis of "
            f"{shards}); this program's model axis has {model_parallel()}"
        )
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names={MODEL}, check_vma=False)


def named(mesh: Mesh, *spec) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*spec))
