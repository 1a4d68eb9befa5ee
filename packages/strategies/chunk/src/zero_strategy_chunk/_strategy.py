"""Chunked even-shard ZeRO-3: parameters packed into fixed-size chunks, one collective per chunk."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from zero_core import ZeroConfig
from zero_core.plugin import (
    ChunkPlan,
    ChunkSpec,
    MeshSpec,
    ParamInfo,
    ShardPlan,
    ShardStrategy,
    Topology,
    get_logger,
    reshard_for_mesh,
    round_up,
)
from zero_strategy_chunk._search import block_of, outlier_threshold, search_chunk_size

if TYPE_CHECKING:
    import pluggy

__all__ = ["ChunkStrategy", "mesh_plans", "pack_chunks"]

logger = get_logger("strategy.chunk")


def pack_chunks(params: Sequence[ParamInfo], *, world_size: int, config: ZeroConfig,
                mesh_of: Callable[[ParamInfo], MeshSpec] | None = None) -> list[ChunkSpec]:
    """Pack ``params`` in order into chunks of one size (searched unless the config gives it).

    Parameters that may not share a chunk (different dtype, ``requires_grad``, optimizer
    group or, with ``mesh_of``, mesh) fill separate chunk sequences. A parameter larger than
    the chunk size, or an outlier of the search, gets a chunk of its own. Every chunk has the
    common size (a multiple of every mesh's shard size) except each sequence's last chunk,
    which is trimmed to its content rounded up to its mesh's shard size (``world_size``).
    When the search finds a chunk per block wastes least (see :func:`search_chunk_size`), a
    chunk also closes, trimmed, wherever the parameters' block changes.
    """
    policy = config.chunk
    shard_of: Callable[[ParamInfo], int] = (lambda p: mesh_of(p).shard_ranks) if mesh_of else (lambda p: world_size)
    if mesh_of is not None:  # one common size that every mesh's shard group divides
        world_size = math.lcm(world_size, *(shard_of(p) for p in params))
    sizes = [p.numel for p in params]
    blocks = [block_of(p.name) for p in params]
    per_block = False
    if policy.chunk_size is not None:
        chunk_size = round_up(policy.chunk_size, world_size)
        limit = float("inf")
    else:
        result = search_chunk_size(
            sizes, world_size=world_size, min_chunk_size=policy.min_chunk_size,
            interval=policy.search_interval, search_range=policy.search_range, blocks=blocks,
        )
        chunk_size, limit, per_block = result.chunk_size, outlier_threshold(sizes), result.per_block
        logger.info("chunk size %d elements%s (%d candidates searched, %d elements of padding)", chunk_size,
                    ", a chunk per block" if per_block else "", result.candidates, result.waste)

    chunks: list[list[ParamInfo]] = []
    filled: list[int] = []
    open_chunk: dict[tuple[object, ...], int] = {}  # key -> index into chunks of its open chunk
    closed: set[int] = set()  # chunks closed at a block boundary: trimmed like a sequence's last
    current = None
    for info, block in zip(params, blocks):
        if per_block and block != current:
            closed.update(open_chunk.values())
            open_chunk.clear()
            current = block
        if info.numel > chunk_size or info.numel > limit:
            chunks.append([info])
            filled.append(info.numel)
            continue
        key = (*info.key, mesh_of(info)) if mesh_of else info.key
        index = open_chunk.get(key)
        if index is None or filled[index] + info.numel > chunk_size:
            chunks.append([])
            filled.append(0)
            index = open_chunk[key] = len(chunks) - 1
        chunks[index].append(info)
        filled[index] += info.numel
    last_of_key = set(open_chunk.values()) | closed
    specs = []
    for index, (members, used) in enumerate(zip(chunks, filled)):
        oversize = len(members) == 1 and (members[0].numel > chunk_size or members[0].numel > limit)
        size = round_up(used, shard_of(members[0])) if oversize or index in last_of_key else chunk_size
        specs.append(ChunkSpec(tuple(members), size))
    return specs


class ChunkStrategy(ShardStrategy):
    """ZeRO-3 over chunks: see :func:`pack_chunks` for the layout.

    The packing is asked of the ``zero_plan_chunks`` hook (:mod:`zero_strategy_chunk.hookspecs`)
    first, so a plugin can override it; this distribution's own implementation runs last.
    """

    name = "chunk"

    def plan(
        self,
        params: Sequence[ParamInfo],
        *,
        world_size: int,
        config: ZeroConfig,
        hook: pluggy.HookRelay | None = None,
        topology: Topology | None = None,
    ) -> ShardPlan:
        topology = topology or Topology(MeshSpec.of_shape((world_size,)))
        mesh_of = (lambda p: topology.mesh_for(p.name)) if topology.modules else None
        specs = None
        # The hook is specified by this distribution's plugin; a relay from a manager that
        # did not load it (autoload disabled, the plugin blocked) has no such attribute.
        # It packs for one mesh, so module meshes skip it.
        if hook is not None and hasattr(hook, "zero_plan_chunks") and not topology.modules:
            specs = hook.zero_plan_chunks(params=list(params), world_size=world_size, config=config)
        if specs is None:
            specs = pack_chunks(params, world_size=world_size, config=config, mesh_of=mesh_of)
        return ShardPlan(tuple(specs), chunk_plans=mesh_plans(specs, topology, config))


def mesh_plans(specs: Sequence[ChunkSpec], topology: Topology, config: ZeroConfig) -> tuple[ChunkPlan, ...]:
    """Each chunk on its first parameter's module mesh (chunks never mix meshes), resharded as the config says."""
    plans: dict[MeshSpec, ChunkPlan] = {}
    out = []
    for spec in specs:
        mesh = topology.mesh_for(spec.params[0].name)
        if mesh not in plans:
            plans[mesh] = ChunkPlan(mesh=mesh, reshard_after_forward=reshard_for_mesh(config.reshard_after_forward, mesh))
        out.append(plans[mesh])
    return tuple(out)

