"""zero-core's own plugin: the ``device`` and ``host`` placement policies.

:meth:`zero_core.plugin.ZeroPlugins.load` registers it directly under its entry-point name
``zero-core``, so these policies exist even with plugin autoload disabled; the entry point
stays, so it is listed and blocked (``ZERO_BLOCKED_PLUGINS=zero-core``) like any other.
"""

from __future__ import annotations

from zero_core.interfaces._registry import Registry
from zero_core.interfaces.hookspecs import hookimpl
from zero_core.interfaces.placement import DevicePlacementPolicy, HostPlacementPolicy, PlacementPolicy


@hookimpl
def zero_register_placement_policies(registry: Registry[type[PlacementPolicy]]) -> None:
    registry.add(DevicePlacementPolicy.name, DevicePlacementPolicy)
    registry.add(HostPlacementPolicy.name, HostPlacementPolicy)
