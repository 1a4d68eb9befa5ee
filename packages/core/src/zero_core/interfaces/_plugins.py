"""Building a plugin manager per engine and collecting the registries from it."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import pluggy

from zero_core.comm.backend import CommBackend
from zero_core.interfaces import _default_plugins, hookspecs
from zero_core.interfaces._registry import Registry
from zero_core.interfaces.placement import PlacementPolicy
from zero_core.interfaces.strategy import ShardStrategy

__all__ = ["ENTRY_POINT_GROUP", "ZeroPlugins", "hookimpl"]

ENTRY_POINT_GROUP = "zero"
hookimpl = hookspecs.hookimpl

# The name of zero-core's own entry point (packages/core/pyproject.toml): blocking it blocks the direct registration too.
_CORE_PLUGIN_NAME = "zero-core"

# Which distribution ships each built-in name, for "pip install X" hints.
_INSTALL_HINTS = {
    "chunk": "zero-strategy-chunk",
    "tensor": "zero-strategy-tensor",
    "torch": "zero-comm",
    "bucketed": "zero-comm",
    "quantized": "zero-comm-quantized",
    "quantized-params": "zero-comm-quantized",
    "quantized-grads": "zero-comm-quantized",
    "quantized-int4": "zero-comm-quantized",
    "quantized-int4-params": "zero-comm-quantized",
    "quantized-int4-grads": "zero-comm-quantized",
    "gemini": "zero-offload",
    "static": "zero-offload",
}


@dataclass(frozen=True)
class ZeroPlugins:
    """A fresh plugin manager and the registries its plugins filled.

    Built per engine, never at import time, so tests and several engines in one
    process never see each other's plugins.

    Loading order: zero-core's own plugin under its entry-point name ``zero-core``, then
    entry points of the ``zero`` group (unless the environment variable
    ``ZERO_DISABLE_PLUGIN_AUTOLOAD`` is set), then the ``plugins`` passed in. Names in
    ``ZERO_BLOCKED_PLUGINS``, comma-separated, are skipped, ``zero-core`` included. Then
    plugins add the hook specifications they own (``zero_add_hookspecs``) and every
    implementation is checked against its specification.
    """

    manager: pluggy.PluginManager
    strategies: Registry[type[ShardStrategy]]
    comm_backends: Registry[type[CommBackend]]
    placement_policies: Registry[type[PlacementPolicy]]

    @classmethod
    def load(cls, plugins: Iterable[object] = ()) -> ZeroPlugins:
        pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        pm.add_hookspecs(hookspecs)
        for name in filter(None, (n.strip() for n in os.environ.get("ZERO_BLOCKED_PLUGINS", "").split(","))):
            pm.set_blocked(name)
        # Registered directly, not only through its entry point, so `device` and `host` exist
        # with autoload disabled or without installed metadata (a source checkout on sys.path).
        # pluggy skips an entry point whose name is already registered, so it is not loaded twice.
        if not pm.is_blocked(_CORE_PLUGIN_NAME):
            pm.register(_default_plugins, name=_CORE_PLUGIN_NAME)
        if not os.environ.get("ZERO_DISABLE_PLUGIN_AUTOLOAD"):
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        for plugin in plugins:
            if not pm.is_registered(plugin):
                pm.register(plugin)
        pm.hook.zero_add_hookspecs.call_historic(kwargs={"plugin_manager": pm})
        pm.check_pending()
        strategies: Registry[type[ShardStrategy]] = Registry("shard strategy", install_hint=_INSTALL_HINTS)
        comm: Registry[type[CommBackend]] = Registry("comm backend", install_hint=_INSTALL_HINTS)
        placement: Registry[type[PlacementPolicy]] = Registry("placement policy", install_hint=_INSTALL_HINTS)
        pm.hook.zero_register_shard_strategies(registry=strategies)
        pm.hook.zero_register_comm_backends(registry=comm)
        pm.hook.zero_register_placement_policies(registry=placement)
        return cls(pm, strategies, comm, placement)
