"""What a plugin's hook may read of the engine after a step: a frozen view, never the engine itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from zero_core.interfaces._inspection import memory_by_kind, model_state_bytes

if TYPE_CHECKING:
    from collections.abc import Sequence

    from zero_core.chunks.chunk import Chunk
    from zero_core.comm.backend import CommStats
    from zero_core.config.api import ZeroConfig

__all__ = ["EngineView"]


@dataclass(frozen=True, kw_only=True)
class EngineView:
    """The engine as a hook sees it (``zero_after_step(engine=...)``): what it holds, not how to drive it.

    Attributes:
        step: Optimizer steps completed (1 after the first step).
        config: The engine's config.
        rank: This rank in the data-parallel group.
        world_size: Ranks in the data-parallel group.
        chunks: The chunks, in plan order. Their state and tier change only through the engine and
            the placement policy (see [Note: who moves a chunk]); a hook that tries raises
            :class:`~zero_core.plugin.OwnershipError`.
        comm_stats: The engine's collective counters.
    """

    step: int
    config: ZeroConfig
    rank: int
    world_size: int
    chunks: tuple[Chunk, ...]
    comm_stats: CommStats
    _optimizer: Sequence[torch.optim.Optimizer] = field(repr=False)  # every optimizer shard() was given

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameter shards, gradients and optimizer states this rank holds now, by kind (exact)."""
        return model_state_bytes(self.chunks, self._optimizer)

    def memory_by_kind(self) -> dict[str, int]:
        """Every byte zero holds on this rank now, by kind: model states and working buffers (exact)."""
        return memory_by_kind(self.chunks, self._optimizer)
