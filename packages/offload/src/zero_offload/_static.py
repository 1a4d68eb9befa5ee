"""The ``static`` policy: Gemini's three fractions, fixed for the whole run."""

from __future__ import annotations

from collections.abc import Sequence

from zero_core.plugin import Chunk, ChunkParts, ChunkSpec, MemoryTier, PartTiers
from zero_offload._base import TieredPolicy
from zero_offload._tiers import DEVICE, HOST
from zero_offload.config import StaticConfig

__all__ = ["StaticPolicy"]


def _first_share(sizes: Sequence[int], fraction: float) -> int:
    """How many leading items make up ``fraction`` of the total (an item counts if the share before it is short)."""
    total, cumulative = sum(sizes), 0
    for n, size in enumerate(sizes):
        if cumulative >= fraction * total:
            return n
        cumulative += size
    return len(sizes) if fraction > 0 else 0


class StaticPolicy(TieredPolicy):
    """Fixed shares of the model kept gathered, stepped on the host, and kept on the host.

    Chunks are taken in plan order (rank-independent, so every rank agrees). See
    :class:`~zero_offload.StaticConfig` for the fractions; ``StaticConfig(offload_optim_frac=1,
    offload_param_frac=1)`` is full offload: every master shard, gradient and optimizer
    state in host memory (or on disk past the host budget), the device holding only what a
    module computes with.
    """

    name = "static"
    config_class = StaticConfig
    options: StaticConfig

    def keep_gathered(self, specs: Sequence[ChunkSpec], groups: Sequence[Sequence[int]]) -> set[int]:
        sizes = [sum(specs[i].size for i in group) for group in groups]
        kept = _first_share(sizes, 1.0 - self.options.shard_param_frac)
        return {i for group in groups[:kept] for i in group}

    def keep_gathered_alone(self) -> bool:
        """On one rank, chunks stay gathered only while every master shard stays on the device: offloading them is
        for device memory, which whole-model full buffers would take back."""
        return self.options.offload_param_frac == 0

    def initial_tier(self, chunk: Chunk) -> MemoryTier:
        """Full offload (both fractions 1) makes every master shard in host memory, where :meth:`place` puts it;
        other fractions make them on the device and :meth:`place` moves the offloaded share."""
        full = self.options.offload_param_frac >= 1 and self.options.offload_optim_frac >= 1
        return HOST if full else DEVICE

    def estimate_tiers(self, parts: Sequence[ChunkParts]) -> list[PartTiers] | None:
        """The split :meth:`place` makes, when no disk tier can take what the host budget refuses."""
        if self.options.disk_dir is not None:
            return None  # what spills to disk depends on the host budget measured at setup
        sizes = [p.params for p in parts]
        optim_n = _first_share(sizes, self.options.offload_optim_frac)
        param_n = _first_share(sizes, self.options.offload_param_frac)
        return [{"params": HOST if n < min(param_n, optim_n) else DEVICE, "grads": HOST if n < optim_n else DEVICE,
                 "optimizer_states": HOST if n < optim_n else DEVICE} for n in range(len(parts))]

    def place(self, chunks: Sequence[Chunk]) -> None:
        sizes = [c.shard_bytes for c in chunks]
        optim_n = _first_share(sizes, self.options.offload_optim_frac)
        param_n = _first_share(sizes, self.options.offload_param_frac)
        self.place_offloaded(chunks[:optim_n], params=[HOST if n < param_n else DEVICE for n in range(optim_n)])
