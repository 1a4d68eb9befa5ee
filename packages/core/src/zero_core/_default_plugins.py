"""zero-core's own plugin: the ``device`` and ``host`` placement policies.

Registered through the ``zero`` entry-point group like any third-party plugin.
"""

from __future__ import annotations

from zero_core._plugins import hookimpl
from zero_core._registry import Registry
from zero_core.placement import DevicePlacementPolicy, HostPlacementPolicy, PlacementPolicy


@hookimpl
def zero_register_placement_policies(registry: Registry[type[PlacementPolicy]]) -> None:
    registry.add(DevicePlacementPolicy.name, DevicePlacementPolicy)
    registry.add(HostPlacementPolicy.name, HostPlacementPolicy)
