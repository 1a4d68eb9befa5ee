"""Building the process groups each chunk plan runs on. See [Note: meshes] in ``zero_core.interfaces.mesh``.

[Note: one group per direction of traffic]
A chunk talks on up to four groups, each used by one thread only, so every rank issues the
collectives of a group in the same order:

* ``gather``: the shard group; all-gathers, issued by the training thread in the order
  [Note: agreeing on all-gathers] fixes;
* ``reduce``: a second group over the same ranks; reduce-scatters, issued by the training
  thread in [Note: gradient reduction order] (a separate group, because they run
  concurrently with the all-gathers);
* ``reduce_all``: a third one, for ``Reduction.ALL_REDUCE`` over a shard group of more
  than one rank, whose all-reduces run on the reduction waiter thread;
* ``replicate``: the replicate group; the HSDP all-reduce of each reduced shard, issued by
  the waiter thread in the order it completes reductions, which is the reduction order (a
  group of its own on an ``(R, 1)`` mesh, where the DeviceMesh's would be the default group
  the training thread agrees on);
* ``sub``: groups of ``k`` ranks inside the shard group for ``reshard_after_forward=k``;
  the backward's all-gathers of the kept copy, by the training thread.

With ``shard_optimizer_across_replicas`` (see [Note: optimizer states across replicas] in
``zero_core.chunks.chunk``) the replicate group is ``outer`` instead of ``replicate``: the waiter
thread reduce-scatters each reduced group shard on it, and the training thread all-gathers the
updated shards on it after a step (never at the same time: a step settles the reductions
first). ``everyone`` is the whole data-parallel group (the engine's own), over which such
chunks' shards are laid out: their sharded parameters' DTensors live on its 1-D mesh.

Every group is created by every rank in the same order (``new_group`` is collective over
the whole world), in the order meshes first appear in the plan, so creation never hangs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zero_core.base.errors import ZeroSetupError
from zero_core.comm.backend import CommBackend
from zero_core.interfaces.mesh import MeshSpec
from zero_core.interfaces.strategy import ChunkPlan, Reduction

__all__ = ["ChunkComms", "MeshGroups", "build_chunk_groups"]


@dataclass(frozen=True)
class ChunkComms:
    """The comm backends one chunk runs on, and its place in its mesh."""

    plan: ChunkPlan
    device_mesh: Any
    gather: CommBackend
    reduce: CommBackend
    reduce_all: CommBackend | None
    replicate: CommBackend | None
    sub: CommBackend | None
    shard_rank: int
    replicate_rank: int
    outer: CommBackend | None = None
    everyone: CommBackend | None = None

    @functools.cached_property  # the plan and its mesh are frozen: read once, not at every chunk's every reduction
    def all_reduce(self) -> bool:
        """Whether the shard group all-reduces (``Reduction.ALL_REDUCE``) instead of reduce-scattering."""
        return self.plan.reduction is Reduction.ALL_REDUCE and self.plan.mesh.shard_ranks > 1


class MeshGroups:
    """Builds, once per mesh (and per subgroup size), the groups chunks on it share."""

    def __init__(self, *, world_comm: CommBackend, world_reduce_comm: CommBackend, default: MeshSpec, default_mesh: Any,
                 make_comm: Callable[[Any], CommBackend], device: torch.device, rank: int) -> None:
        self._make_comm = make_comm
        self._device = device
        self._rank = rank
        self._timeout = world_comm.timeout
        # The default 1-D mesh over the data-parallel group reuses the engine's own two groups.
        self._default = default
        self._default_mesh = default_mesh
        self._default_comms = (world_comm, world_reduce_comm)
        self._meshes: dict[MeshSpec, tuple[Any, CommBackend, CommBackend, CommBackend | None]] = {}
        self._extra: dict[tuple[MeshSpec, str, int], CommBackend | None] = {}

    def for_plan(self, plan: ChunkPlan, *, across_replicas: bool = False) -> ChunkComms:
        """The groups of a chunk on ``plan``'s mesh; ``across_replicas``: its shards are cut over the replicas too."""
        spec = plan.mesh
        device_mesh, gather, reduce, replicate = self._mesh(spec)
        outer = everyone = None
        if across_replicas and replicate is not None:
            outer, replicate = replicate, None
            device_mesh, everyone = self._default_mesh, self._default_comms[0]
        reduce_all = None
        if plan.reduction is Reduction.ALL_REDUCE and spec.shard_ranks > 1:
            reduce_all = self._subgroups(spec, "reduce_all", spec.shard_ranks)
        sub = None
        if not isinstance(plan.reshard_after_forward, bool):
            sub = self._subgroups(spec, "sub", plan.reshard_after_forward)
        replicate_rank, shard_rank = spec.coordinates(self._rank)
        return ChunkComms(plan, device_mesh, gather, reduce, reduce_all, replicate, sub, shard_rank, replicate_rank,
                          outer, everyone)

    def _mesh(self, spec: MeshSpec) -> tuple[Any, CommBackend, CommBackend, CommBackend | None]:
        if spec in self._meshes:
            return self._meshes[spec]
        built: tuple[Any, CommBackend, CommBackend, CommBackend | None]
        if spec == self._default and spec.ndim == 1:
            built = (self._default_mesh, *self._default_comms, None)
        elif spec.size == 1:
            built = (self._default_mesh, *self._default_comms, None)
        else:
            device_mesh = spec.device_mesh if spec.device_mesh is not None else self._new_device_mesh(spec)
            gather = self._make_comm(device_mesh.get_group(spec.ndim - 1))
            reduce = self._subgroups(spec, "reduce", spec.shard_ranks)
            replicate = None
            if spec.replicate_ranks > 1:
                # on an (R, 1) mesh the DeviceMesh's replicate group is the default group, on which the training
                # thread runs its agreement rounds while the waiter thread reduces: the waiter gets a group of its own
                replicate = (self._subgroups(spec, "replicate", spec.replicate_ranks) if spec.shard_ranks == 1
                             else self._make_comm(device_mesh.get_group(0)))
            built = (device_mesh, gather, reduce, replicate)
        self._meshes[spec] = built
        return built

    def _new_device_mesh(self, spec: MeshSpec) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        names = ("shard",) if spec.ndim == 1 else ("replicate", "shard")
        return DeviceMesh(self._device.type, torch.tensor(spec.ranks).view(spec.shape), mesh_dim_names=names)

    def _subgroups(self, spec: MeshSpec, what: str, size: int) -> CommBackend:
        """This rank's group among ``spec``'s shard groups cut into runs of ``size`` ranks (a new group each)."""
        key = (spec, what, size)
        if key not in self._extra:
            import torch.distributed as dist

            lists = {"sub": spec.subgroups, "replicate": lambda _: spec.replicate_groups()}.get(
                what, lambda _: spec.shard_groups())(size)
            backend = dist.get_backend()
            group, _ = dist.new_subgroups_by_enumeration(lists, timeout=self._timeout, backend=backend)
            if group is None:
                raise ZeroSetupError(f"rank {self._rank} is in no {what} group of {spec}; every mesh must span every rank")
            self._extra[key] = self._make_comm(group)
        comm = self._extra[key]
        assert comm is not None
        return comm


def build_chunk_groups(plans: Sequence[ChunkPlan], groups: MeshGroups) -> list[ChunkComms]:
    """Each chunk's groups, built in plan order (the same on every rank)."""
    return [groups.for_plan(plan) for plan in plans]
