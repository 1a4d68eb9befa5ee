"""The shard strategy interface.

A shard strategy decides the plan: which parameters share a chunk, in what order, how
large each chunk is, and per chunk (:class:`ChunkPlan`) the mesh it lives on, how its
gradients are reduced and when it is resharded after forward. The engine in zero-core
runs whatever plan it returns (gather before use, release after, reduce gradients,
update shards), so a strategy is small and its correctness follows from the plan.

Subclass :class:`zero_core.testing.ShardStrategyConformance` to test a strategy.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from zero_core.base.errors import ConfigError, PlanError
from zero_core.chunks.chunk import ChunkSpec, ParamInfo
from zero_core.config.api import check_reshard_after_forward
from zero_core.interfaces.mesh import MeshSpec, Topology

if TYPE_CHECKING:
    import pluggy

    from zero_core.config.api import ZeroConfig

__all__ = ["ChunkPlan", "Reduction", "ShardPlan", "ShardStrategy", "reshard_for_mesh", "round_up"]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class Reduction(enum.Enum):
    """How a chunk's gradients are summed over the ranks (always divided by every data-parallel rank)."""

    #: Reduce-scatter over the shard group: each rank keeps the sum of its shard. Needs a mesh without replicas.
    REDUCE_SCATTER = "reduce_scatter"
    #: Reduce-scatter over the shard group, then all-reduce the shard across the replicate group (HSDP).
    REDUCE_SCATTER_ALL_REDUCE = "reduce_scatter+all_reduce"
    #: All-reduce the full gradient over the shard group, then across replicas; each rank keeps its shard
    #: (twice a reduce-scatter's traffic: for a shard group of one rank, plain data parallelism, it is the only way).
    ALL_REDUCE = "all_reduce"

    @classmethod
    def for_mesh(cls, mesh: MeshSpec) -> Reduction:
        """The cheapest reduction that leaves every replica the same mean."""
        if mesh.shard_ranks == 1:
            return cls.ALL_REDUCE
        return cls.REDUCE_SCATTER if mesh.replicate_ranks == 1 else cls.REDUCE_SCATTER_ALL_REDUCE


ReshardAfterForward = bool | int


def reshard_for_mesh(value: bool | int, mesh: MeshSpec) -> bool | int:
    """``ZeroConfig.reshard_after_forward`` as a chunk on ``mesh`` can use it: a group size its shard group cannot
    be cut into (a module mesh with a smaller shard group) has nothing smaller to keep, which is ``True``.
    (``shard()`` rejects a size the default mesh cannot use.)"""
    if isinstance(value, bool) or (1 < value < mesh.shard_ranks and mesh.shard_ranks % value == 0):
        return value
    return True


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkPlan:
    """Where one chunk lives and how the engine runs it. See [Note: meshes] in ``zero_core.interfaces.mesh``.

    Attributes:
        mesh: The mesh the chunk is sharded on (its size must divide by ``mesh.shard_ranks``).
        reduction: How its gradients are reduced; ``None`` takes :meth:`Reduction.for_mesh`.
        reshard_after_forward: At stage 3, what a forward that builds a graph leaves for the
            backward: ``True`` frees the full buffer (the backward gathers again), ``False``
            keeps it until the backward has used it (no second gather, more memory), an int
            ``k`` keeps a copy sharded over groups of ``k`` ranks of the shard group, so the
            backward gathers inside the group only (ZeRO++'s hpZ, FSDP2's int).
    """

    mesh: MeshSpec
    reduction: Reduction | None = None
    reshard_after_forward: ReshardAfterForward = True

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, MeshSpec):
            raise ConfigError(f"ChunkPlan.mesh must be a zero_core.plugin.MeshSpec, got {type(self.mesh).__name__}")
        reduction = Reduction.for_mesh(self.mesh) if self.reduction is None else self.reduction
        if not isinstance(reduction, Reduction):
            raise ConfigError(f"ChunkPlan.reduction must be a zero_core.plugin.Reduction, got {reduction!r}")
        if reduction is Reduction.REDUCE_SCATTER and self.mesh.replicate_ranks > 1:
            raise ConfigError(
                f"Reduction.REDUCE_SCATTER on {self.mesh} would leave its {self.mesh.replicate_ranks} replicas with "
                "different gradients; use REDUCE_SCATTER_ALL_REDUCE"
            )
        if reduction is Reduction.REDUCE_SCATTER_ALL_REDUCE and self.mesh.shard_ranks == 1:
            raise ConfigError(f"{self.mesh} shards nothing (shard groups of 1 rank): use Reduction.ALL_REDUCE")
        object.__setattr__(self, "reduction", reduction)
        check_reshard_after_forward(self.reshard_after_forward, "ChunkPlan.reshard_after_forward")
        k = self.reshard_after_forward
        if not isinstance(k, bool) and (k < 2 or k >= self.mesh.shard_ranks or self.mesh.shard_ranks % k):
            raise ConfigError(
                f"ChunkPlan.reshard_after_forward={k} must be a divisor of the shard group size "
                f"{self.mesh.shard_ranks} below it (or True / False)"
            )


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """An ordered list of chunks covering every parameter exactly once.

    The order is the order chunks are expected to be first used in forward; the engine
    reduces gradients in the reverse order, the same on every rank.

    Attributes:
        chunks: The chunks, in order.
        gather_groups: Runs of consecutive chunk indices whose all-gathers travel as one
            collective (see [Note: gather groups] in ``zero_core.chunks._group``); every chunk in
            exactly one run, one parameter dtype and one chunk plan per run. ``None``: each chunk alone.
        chunk_plans: One :class:`ChunkPlan` per chunk. ``None``: every chunk on the default
            mesh, reduced by :meth:`Reduction.for_mesh`, resharded as ``ZeroConfig`` says.
    """

    chunks: tuple[ChunkSpec, ...]
    gather_groups: tuple[tuple[int, ...], ...] | None = None
    chunk_plans: tuple[ChunkPlan, ...] | None = None

    @property
    def numel(self) -> int:
        return sum(c.used for c in self.chunks)

    @property
    def padded_numel(self) -> int:
        return sum(c.size for c in self.chunks)

    def plans(self, default: ChunkPlan) -> tuple[ChunkPlan, ...]:
        """Each chunk's plan, ``default`` where the strategy gave none."""
        return self.chunk_plans if self.chunk_plans is not None else (default,) * len(self.chunks)

    def validate(self, params: Sequence[ParamInfo], world_size: int, topology: Topology | None = None) -> None:
        """Check the invariants the engine relies on; raise ``ValueError`` naming the first broken one.

        ``world_size`` is the default mesh's shard group size; with ``chunk_plans`` each
        chunk's size must divide by its own mesh's shard size instead."""
        seen: dict[int, int] = {}
        if self.chunk_plans is not None:
            if len(self.chunk_plans) != len(self.chunks):
                raise PlanError(f"the plan has {len(self.chunks)} chunks but {len(self.chunk_plans)} chunk plans")
            for i, cp in enumerate(self.chunk_plans):
                if not isinstance(cp, ChunkPlan):
                    raise PlanError(f"chunk plan {i} is a {type(cp).__name__}, not a zero_core.plugin.ChunkPlan")
                if topology is not None and sorted(cp.mesh.ranks) != sorted(topology.default.ranks):
                    raise PlanError(f"chunk {i} is planned on {cp.mesh}, which does not span every data-parallel rank")
        for i, spec in enumerate(self.chunks):
            if not spec.params:
                raise PlanError(f"chunk {i} of the plan holds no parameter")
            shard_size = self.chunk_plans[i].mesh.shard_ranks if self.chunk_plans is not None else world_size
            if spec.size % shard_size:
                raise PlanError(f"chunk {i} has size {spec.size}, not a multiple of its shard group size {shard_size}")
            if spec.used > spec.size:
                raise PlanError(f"chunk {i} holds {spec.used} elements but its size is {spec.size}")
            if topology is not None and topology.modules:
                meshes = {topology.mesh_for(p.name) for p in spec.params}
                if len(meshes) > 1:
                    raise PlanError(f"chunk {i} mixes parameters of modules on different meshes ({len(meshes)} meshes)")
            keys = {p.key for p in spec.params}
            if len(keys) > 1:
                raise PlanError(f"chunk {i} mixes parameters of different dtype, requires_grad or optimizer group: {keys}")
            for p in spec.params:
                if id(p.param) in seen:
                    raise PlanError(f"parameter {p.name} is in chunks {seen[id(p.param)]} and {i}")
                seen[id(p.param)] = i
        missing = [p.name for p in params if id(p.param) not in seen]
        if missing:
            raise PlanError(f"the plan leaves out parameters {missing[:5]}{'...' if len(missing) > 5 else ''}")
        if len(seen) != len(params):
            raise PlanError("the plan holds parameters that are not the model's")
        if self.gather_groups is not None:
            self._validate_groups()

    def _validate_groups(self) -> None:
        expected = 0
        for g, members in enumerate(self.gather_groups or ()):
            if not members or list(members) != list(range(expected, expected + len(members))):
                raise PlanError(
                    f"gather group {g} is {list(members)}, but groups must be non-empty runs of consecutive chunk "
                    f"indices covering every chunk in order; the next run must start at chunk {expected}"
                )
            dtypes = {self.chunks[k].params[0].param.dtype for k in members}
            if len(dtypes) > 1:
                raise PlanError(f"gather group {g} mixes parameter dtypes {sorted(map(str, dtypes))}; one all-gather carries one dtype")
            if self.chunk_plans is not None and len({self.chunk_plans[k] for k in members}) > 1:
                raise PlanError(f"gather group {g} mixes chunk plans (meshes or resharding); one all-gather runs on one group")
            expected += len(members)
        if expected != len(self.chunks):
            raise PlanError(f"the gather groups cover chunks 0..{expected - 1} but the plan has {len(self.chunks)} chunks")


class ShardStrategy(ABC):
    """Decides how parameters are laid out in evenly sharded chunks.

    Attributes:
        name: The name users select it by (``ZeroConfig(strategy=name)``).
        comm: The comm backend used when ``ZeroConfig.comm_backend`` is ``None``.
    """

    name: ClassVar[str]
    comm: ClassVar[str] = "torch"

    @abstractmethod
    def plan(
        self,
        params: Sequence[ParamInfo],
        *,
        world_size: int,
        config: ZeroConfig,
        hook: pluggy.HookRelay | None = None,
        topology: Topology | None = None,
    ) -> ShardPlan:
        """Lay ``params`` (in the order they should be packed) out into chunks.

        ``world_size`` is the default mesh's shard group size. ``topology`` holds the meshes
        the user gave (``None``: one 1-D mesh of ``world_size`` ranks); a strategy that
        returns no ``chunk_plans`` puts every chunk on the default mesh, so one that
        supports per-module meshes must return them. ``hook`` is the engine's plugin hook
        relay, for strategies that let plugins override part of the plan (for example
        ``zero_plan_chunks``).
        """
