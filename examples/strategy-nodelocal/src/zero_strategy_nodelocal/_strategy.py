"""The ``node-local`` strategy: hybrid sharding (HSDP) planned entirely by a third-party strategy.

[Note: node-local plan]
Each chunk is sharded over ``g`` consecutive ranks (one node, when ``g`` is the ranks per
node) and replicated over the ``W / g`` groups: the chunk's mesh is the user's default mesh
re-laid as ``(W / g, g)`` by :meth:`zero_core.plugin.MeshSpec.hybrid`. All-gathers then stay inside
a node, gradients are reduce-scattered inside the node and the ``1 / g``-sized results are
all-reduced across nodes (``Reduction.for_mesh`` picks that for a 2-D mesh). Core builds the
process groups for whatever mesh a plan returns, so nothing here touches torch.distributed.

``g`` is ``ZERO_NODELOCAL_SHARD_SIZE`` when set, else ``LOCAL_WORLD_SIZE`` (which torchrun
sets to the ranks of one node), else the whole mesh (plain full sharding); it must divide
the mesh's size. A mesh the user already laid out as ``(replicate, shard)`` is used as is.

Parameters are packed greedily in the order given into chunks of
``config.chunk.chunk_size`` elements (``DEFAULT_CHUNK_SIZE`` when ``None``; no search),
one open chunk per (``ParamInfo.key``, mesh), so parameters of different dtype,
``requires_grad`` or optimizer group, or on different meshes, never share a chunk. A
parameter larger than the chunk size gets a chunk of its own, and the last chunk of each
sequence is trimmed to its content. Every size is a multiple of its mesh's shard size.

Every chunk follows ``ZeroConfig.reshard_after_forward``; a group size ``k`` at least ``g``
means ``True`` here, since the backward's gathers already stay inside ``g`` ranks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from zero_core.plugin import (
    ChunkPlan,
    ChunkSpec,
    ConfigError,
    MeshSpec,
    ParamInfo,
    ShardPlan,
    ShardStrategy,
    Topology,
    ZeroConfig,
    get_logger,
    round_up,
)

if TYPE_CHECKING:
    import pluggy

__all__ = ["DEFAULT_CHUNK_SIZE", "SHARD_SIZE_ENV", "NodeLocalStrategy", "node_shard_size", "reshard_for"]

logger = get_logger("strategy.nodelocal")

#: The environment variable that overrides ``LOCAL_WORLD_SIZE`` as the shard group size.
SHARD_SIZE_ENV = "ZERO_NODELOCAL_SHARD_SIZE"
#: Elements per chunk when ``config.chunk.chunk_size`` is ``None`` (16 MiB of fp32).
DEFAULT_CHUNK_SIZE = 1 << 22


def node_shard_size(mesh_size: int, *, default: int | None = None) -> int:
    """The ranks one chunk is sharded over: ``ZERO_NODELOCAL_SHARD_SIZE``, else ``LOCAL_WORLD_SIZE``,
    else ``default`` (``mesh_size`` when ``None``). Raises ``ConfigError`` unless it divides ``mesh_size``."""
    for var in (SHARD_SIZE_ENV, "LOCAL_WORLD_SIZE"):
        raw = os.environ.get(var, "").strip()
        if not raw:
            continue
        try:
            size = int(raw)
        except ValueError:
            size = 0
        if size < 1:
            raise ConfigError(
                f"{var}={raw!r}: the node-local strategy needs a positive int there (the ranks each chunk is "
                f"sharded over, usually the ranks of one node); set {SHARD_SIZE_ENV} to override it"
            )
        if mesh_size % size:
            divisors = [d for d in range(1, mesh_size + 1) if mesh_size % d == 0]
            raise ConfigError(
                f"the node-local strategy shards each chunk within groups of {size} consecutive ranks ({var}={raw}), "
                f"but the data-parallel mesh has {mesh_size} ranks, which {size} does not divide. Set "
                f"{SHARD_SIZE_ENV} to one of {divisors}, or pass a 2-D (replicate, shard) mesh, which is used as is"
            )
        return size
    return mesh_size if default is None else default


def reshard_for(k: bool | int, mesh: MeshSpec) -> bool | int:
    """``ZeroConfig.reshard_after_forward`` for chunks on ``mesh``: a group size ``k`` at least the shard group's
    is ``True`` (the backward's gathers already stay inside the shard group); a ``k`` that does not divide it
    is left for ``ChunkPlan`` to reject."""
    if not isinstance(k, bool) and k >= mesh.shard_ranks:
        return True
    return k


class NodeLocalStrategy(ShardStrategy):
    """Hybrid sharding: each chunk sharded inside a group of ``g`` ranks, replicated across groups.

    See [Note: node-local plan].
    """

    name = "node-local"

    def plan(
        self,
        params: Sequence[ParamInfo],
        *,
        world_size: int,
        config: ZeroConfig,
        hook: pluggy.HookRelay | None = None,
        topology: Topology | None = None,
    ) -> ShardPlan:
        default = topology.default if topology is not None else MeshSpec.of_shape((world_size,))
        chunk_size = config.chunk.chunk_size or DEFAULT_CHUNK_SIZE
        placed: dict[MeshSpec, ChunkPlan] = {}  # the user's mesh -> the plan of the chunks on it

        def plan_for(info: ParamInfo) -> ChunkPlan:
            user = topology.mesh_for(info.name) if topology is not None else default
            if user not in placed:
                # A 2-D mesh is the user's own (replicate, shard) layout; a 1-D one is split into node groups.
                mesh = user if user.ndim == 2 else user.hybrid(node_shard_size(user.size, default=default.shard_ranks))
                try:
                    placed[user] = ChunkPlan(mesh=mesh, reshard_after_forward=reshard_for(config.reshard_after_forward, mesh))
                except ConfigError as err:
                    raise ConfigError(f"the node-local strategy places chunks on {mesh}: {err}") from None
                logger.info("node-local: chunks of %s on %s (%s)", user, mesh, placed[user].reduction.value)
            return placed[user]

        members: list[list[ParamInfo]] = []
        filled: list[int] = []
        plans: list[ChunkPlan] = []
        open_chunk: dict[tuple[object, ...], int] = {}  # (key, user mesh) -> index of its open chunk
        oversize: set[int] = set()
        for info in params:
            cp = plan_for(info)
            capacity = round_up(chunk_size, cp.mesh.shard_ranks)
            if info.numel > capacity:  # its own chunk; the open one of its key stays open
                oversize.add(len(members))
                members.append([info])
                filled.append(info.numel)
                plans.append(cp)
                continue
            # keyed by the user's mesh, not the chunk plan: two user meshes may map to one layout, and
            # ShardPlan.validate still wants each chunk's parameters to come from one module mesh
            group = (info.key, topology.mesh_for(info.name) if topology is not None else default)
            index = open_chunk.get(group)
            if index is None or filled[index] + info.numel > capacity:
                index = open_chunk[group] = len(members)
                members.append([])
                filled.append(0)
                plans.append(cp)
            members[index].append(info)
            filled[index] += info.numel
        last = set(open_chunk.values())
        specs = []
        for index, (infos, used, cp) in enumerate(zip(members, filled, plans)):
            shard = cp.mesh.shard_ranks
            size = round_up(used, shard) if index in oversize or index in last else round_up(chunk_size, shard)
            specs.append(ChunkSpec(tuple(infos), size))
        return ShardPlan(tuple(specs), chunk_plans=tuple(plans))
