"""Chunked even-shard ZeRO-3: parameters packed into fixed-size chunks, one collective per chunk."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from zero_core import ChunkSpec, ParamInfo, ShardPlan, ShardStrategy, ZeroConfig, round_up
from zero_strategy_chunk._search import outlier_threshold, search_chunk_size

if TYPE_CHECKING:
    import pluggy

__all__ = ["ChunkStrategy", "pack_chunks"]

logger = logging.getLogger("zero.strategy.chunk")


def pack_chunks(params: Sequence[ParamInfo], *, world_size: int, config: ZeroConfig) -> list[ChunkSpec]:
    """Pack ``params`` in order into chunks of one size (searched unless the config gives it).

    Parameters that may not share a chunk (different dtype, ``requires_grad`` or optimizer
    group) fill separate chunk sequences. A parameter larger than the chunk size, or an
    outlier of the search, gets a chunk of its own. Every chunk has the common size except
    each sequence's last chunk, which is trimmed to its content rounded up to the world size.
    """
    policy = config.chunk
    sizes = [p.numel for p in params]
    if policy.chunk_size is not None:
        chunk_size = round_up(policy.chunk_size, world_size)
        limit = float("inf")
    else:
        result = search_chunk_size(
            sizes, world_size=world_size, min_chunk_size=policy.min_chunk_size,
            interval=policy.search_interval, search_range=policy.search_range,
        )
        chunk_size, limit = result.chunk_size, outlier_threshold(sizes)
        logger.info("chunk size %d elements (%d candidates searched, %d elements of padding)",
                    chunk_size, result.candidates, result.waste)

    chunks: list[list[ParamInfo]] = []
    filled: list[int] = []
    open_chunk: dict[tuple[object, ...], int] = {}  # key -> index into chunks of its open chunk
    for info in params:
        if info.numel > chunk_size or info.numel > limit:
            chunks.append([info])
            filled.append(info.numel)
            continue
        index = open_chunk.get(info.key)
        if index is None or filled[index] + info.numel > chunk_size:
            chunks.append([])
            filled.append(0)
            index = open_chunk[info.key] = len(chunks) - 1
        chunks[index].append(info)
        filled[index] += info.numel
    last_of_key = set(open_chunk.values())
    specs = []
    for index, (members, used) in enumerate(zip(chunks, filled)):
        oversize = len(members) == 1 and (members[0].numel > chunk_size or members[0].numel > limit)
        size = round_up(used, world_size) if oversize or index in last_of_key else chunk_size
        specs.append(ChunkSpec(tuple(members), size))
    return specs


class ChunkStrategy(ShardStrategy):
    """ZeRO-3 over chunks: see :func:`pack_chunks` for the layout.

    The packing is asked of the ``zero_plan_chunks`` hook first, so a plugin can
    override it; this distribution's own implementation runs last.
    """

    name = "chunk"

    def plan(
        self,
        params: Sequence[ParamInfo],
        *,
        world_size: int,
        config: ZeroConfig,
        hook: pluggy.HookRelay | None = None,
    ) -> ShardPlan:
        specs = None
        if hook is not None:
            specs = hook.zero_plan_chunks(params=list(params), world_size=world_size, config=config)
        if specs is None:
            specs = pack_chunks(params, world_size=world_size, config=config)
        return ShardPlan(tuple(specs))
