"""The ``lru`` policy: everything offloaded to the host, plus a device cache of recently used master shards."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from zero_core import ConfigError
from zero_core.plugin import Chunk, MemoryTier
from zero_offload import Part, TierConfig, TieredPolicy

__all__ = ["LruConfig", "LruPolicy"]

DEVICE, HOST = MemoryTier.DEVICE, MemoryTier.HOST


@dataclass(frozen=True, kw_only=True)
class LruConfig(TierConfig):
    """Options of the ``lru`` policy (plus the tier budgets of :class:`~zero_offload.TierConfig`).

    Attributes:
        device_chunks: How many chunks' master shards may stay on the device between uses.
    """

    device_chunks: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.device_chunks
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(
                f"LruConfig.device_chunks must be a positive int (how many chunks' master shards stay on the device), "
                f"got {n!r}; write placement_options={{'device_chunks': 2}}."
            )


class LruPolicy(TieredPolicy):
    """Gradients and optimizer states on the host; master shards of the ``device_chunks`` most recently used chunks on the device."""

    name = "lru"
    config_class = LruConfig
    options: LruConfig

    def __init__(self, options: LruConfig | None = None) -> None:
        super().__init__(options)
        # Chunks whose shard this policy brought to the device, least recently used first.
        self._cached: OrderedDict[int, Chunk] = OrderedDict()

    def place(self, chunks: Sequence[Chunk]) -> None:
        # The optimizer steps on the host, so every shard starts there; use brings it up.
        self.place_offloaded(chunks, params=HOST)

    def before_compute(self, chunks: Sequence[Chunk], *, backward: bool) -> None:
        for chunk in chunks:
            # Only host shards come up: one the host budget sent to disk is read by before_gather instead.
            if self.tiers.tier(chunk, Part.PARAMS) is HOST:
                self.tiers.move(chunk, Part.PARAMS, DEVICE)
            if self.tiers.tier(chunk, Part.PARAMS) is DEVICE:
                self._cached[chunk.index] = chunk
                self._cached.move_to_end(chunk.index)
        # Evict from the old end; the chunks about to compute stay even if they alone exceed the limit.
        in_use = {chunk.index for chunk in chunks}
        for index in [i for i in self._cached if i not in in_use]:
            if len(self._cached) <= self.options.device_chunks:
                break
            self.tiers.move(self._cached.pop(index), Part.PARAMS, HOST)

    def after_backward(self, chunks: Sequence[Chunk]) -> None:
        # The optimizer steps on the host, and a segment's gradient must sit with its parameter:
        # bring every cached shard home (and forget it) first, so the base class finds nothing
        # to move for the step and after_step moves nothing back up behind the cache's back.
        for chunk in self._cached.values():
            self.tiers.move(chunk, Part.PARAMS, HOST)
        self._cached.clear()
        super().after_backward(chunks)
