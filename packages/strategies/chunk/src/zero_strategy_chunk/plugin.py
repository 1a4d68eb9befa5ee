"""zero-strategy-chunk's plugin: the ``chunk`` strategy, its hooks and the default chunk packing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from zero_core.plugin import ChunkSpec, ParamInfo, Registry, ShardStrategy, ZeroConfig, hookimpl
from zero_strategy_chunk import hookspecs
from zero_strategy_chunk._strategy import ChunkStrategy, pack_chunks

if TYPE_CHECKING:
    import pluggy


@hookimpl
def zero_add_hookspecs(plugin_manager: pluggy.PluginManager) -> None:
    plugin_manager.add_hookspecs(hookspecs)


@hookimpl
def zero_register_shard_strategies(registry: Registry[type[ShardStrategy]]) -> None:
    registry.add(ChunkStrategy.name, ChunkStrategy)


@hookimpl(trylast=True)
def zero_plan_chunks(params: Sequence[ParamInfo], world_size: int, config: ZeroConfig) -> list[ChunkSpec]:
    return pack_chunks(params, world_size=world_size, config=config)
