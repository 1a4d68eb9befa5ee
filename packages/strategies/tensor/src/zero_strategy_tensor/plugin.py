"""zero-strategy-tensor's plugin: registers the ``tensor`` strategy through the ``zero`` entry points."""

from __future__ import annotations

from zero_core.plugin import Registry, ShardStrategy, hookimpl
from zero_strategy_tensor._strategy import TensorStrategy


@hookimpl
def zero_register_shard_strategies(registry: Registry[type[ShardStrategy]]) -> None:
    registry.add(TensorStrategy.name, TensorStrategy)
