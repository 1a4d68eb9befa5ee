"""Hook specifications of the ``zero`` plugin system that concern every plugin.

Plugins implement these with ``@zero_core.plugin.hookimpl`` and are found through the
``zero`` entry-point group (built-in parts register exactly like third-party ones).
Hooks fire at setup and at step boundaries; per-chunk decisions call methods on the
objects the hooks registered, never ``pm.hook``, because hook calls cost time.

A hook that only one plugin calls is specified by that plugin, which adds it in
:func:`zero_add_hookspecs` (``zero_plan_chunks`` lives in ``zero_strategy_chunk.hookspecs``),
so core does not change when a plugin's hooks do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from zero_core.comm.backend import CommBackend
    from zero_core.config.api import ZeroConfig
    from zero_core.interfaces._registry import Registry
    from zero_core.interfaces._view import EngineView
    from zero_core.interfaces.placement import PlacementPolicy
    from zero_core.interfaces.strategy import ShardStrategy

hookspec = pluggy.HookspecMarker("zero")
#: Marks a plugin's implementation of a hook (re-exported as ``zero_core.plugin.hookimpl``).
hookimpl = pluggy.HookimplMarker("zero")

__all__ = [
    "hookimpl",
    "hookspec",
    "zero_add_hookspecs",
    "zero_after_step",
    "zero_configure",
    "zero_register_comm_backends",
    "zero_register_placement_policies",
    "zero_register_shard_strategies",
]

# -- registration: called once when an engine's plugin manager is built -------------


@hookspec(historic=True)
def zero_add_hookspecs(plugin_manager: pluggy.PluginManager) -> None:
    """Add the hook specifications a plugin owns: ``plugin_manager.add_hookspecs(my_plugin.hookspecs)``.

    Called after every plugin is registered and before implementations are checked
    against specifications, so other plugins may implement the added hooks.
    Historic: plugins registered later still receive the call.
    """


@hookspec
def zero_register_shard_strategies(registry: Registry[type[ShardStrategy]]) -> None:
    """Add shard strategy classes by name: ``registry.add("chunk", ChunkStrategy)``."""


@hookspec
def zero_register_comm_backends(registry: Registry[type[CommBackend]]) -> None:
    """Add comm backend classes by name: ``registry.add("torch", TorchCommBackend)``."""


@hookspec
def zero_register_placement_policies(registry: Registry[type[PlacementPolicy]]) -> None:
    """Add placement policy classes by name: ``registry.add("lru", LruPolicy)``."""


# -- setup ----------------------------------------------------------------------------


@hookspec(historic=True)
def zero_configure(config: ZeroConfig) -> None:
    """Called once the config is final, before any parameter is sharded.

    Plugins may validate the config here and raise :class:`zero_core.ConfigError`.
    Historic: plugins registered later still receive the call.
    """


# -- step boundaries ------------------------------------------------------------------


@hookspec
def zero_after_step(engine: EngineView, stats: dict[str, Any]) -> None:
    """Called on every rank after each optimizer step with that step's counters.

    ``engine`` is a read-only :class:`~zero_core.plugin.EngineView` (the step number, config,
    rank, chunks and exact byte counts), not the engine itself.

    ``stats`` maps collective kind names to ``{"calls": int, "bytes_sent": int}``.
    """
