"""Hook specifications that zero-strategy-chunk owns.

Added to each engine's plugin manager by this distribution's plugin
(:func:`zero_strategy_chunk.plugin.zero_add_hookspecs`), so they exist exactly when the
``chunk`` strategy is loaded. Implement them with ``@zero_core.plugin.hookimpl`` like core's hooks.
"""

from __future__ import annotations

from collections.abc import Sequence

from zero_core.plugin import ChunkSpec, ParamInfo, ZeroConfig, hookspec

__all__ = ["zero_plan_chunks"]


@hookspec(firstresult=True)
def zero_plan_chunks(params: Sequence[ParamInfo], world_size: int, config: ZeroConfig) -> Sequence[ChunkSpec] | None:
    """Pack ``params`` (in packing order) into chunks for the ``chunk`` strategy.

    zero-strategy-chunk implements the size search with ``trylast=True``, so a user
    plugin can override the packing by returning its own list of chunk specs.
    Stops at first non-None result.
    """
