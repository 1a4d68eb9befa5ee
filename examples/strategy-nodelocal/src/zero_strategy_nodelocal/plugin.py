"""zero-strategy-nodelocal's plugin: registers the ``node-local`` strategy through the ``zero`` entry points."""

from __future__ import annotations

from zero_core.plugin import Registry, ShardStrategy, hookimpl
from zero_strategy_nodelocal._strategy import NodeLocalStrategy


@hookimpl
def zero_register_shard_strategies(registry: Registry[type[ShardStrategy]]) -> None:
    registry.add(NodeLocalStrategy.name, NodeLocalStrategy)
