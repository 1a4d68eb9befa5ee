"""zero-placement-lru's plugin: registers the ``lru`` placement policy through the ``zero`` entry points."""

from __future__ import annotations

import zero_core
from zero_placement_lru._policy import LruPolicy


@zero_core.plugin.hookimpl
def zero_register_placement_policies(registry: zero_core.plugin.Registry[type[zero_core.plugin.PlacementPolicy]]) -> None:
    registry.add(LruPolicy.name, LruPolicy)
