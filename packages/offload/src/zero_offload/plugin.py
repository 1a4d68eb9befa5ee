"""zero-offload's plugin: registers the ``static`` and ``gemini`` placement policies through the ``zero`` entry points."""

from __future__ import annotations

from zero_core.plugin import PlacementPolicy, Registry, hookimpl
from zero_offload._gemini import GeminiPolicy
from zero_offload._static import StaticPolicy


@hookimpl
def zero_register_placement_policies(registry: Registry[type[PlacementPolicy]]) -> None:
    registry.add(StaticPolicy.name, StaticPolicy)
    registry.add(GeminiPolicy.name, GeminiPolicy)
