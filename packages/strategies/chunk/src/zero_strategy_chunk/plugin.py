"""zero-strategy-chunk's plugin: the ``chunk`` strategy and the default chunk packing."""

from __future__ import annotations

from collections.abc import Sequence

from zero_core import ChunkSpec, ParamInfo, Registry, ShardStrategy, ZeroConfig, hookimpl
from zero_strategy_chunk._strategy import ChunkStrategy, pack_chunks


@hookimpl
def zero_register_shard_strategies(registry: Registry[type[ShardStrategy]]) -> None:
    registry.add(ChunkStrategy.name, ChunkStrategy)


@hookimpl(trylast=True)
def zero_plan_chunks(params: Sequence[ParamInfo], world_size: int, config: ZeroConfig) -> list[ChunkSpec]:
    return pack_chunks(params, world_size=world_size, config=config)
