"""Gather groups: several chunks whose all-gathers travel as one collective.

[Note: gather groups]
A plan may declare that consecutive chunks form a *gather group* (tensor-wise ZeRO-3
makes one chunk per parameter and one group per module, so a module's parameters
arrive in one all-gather instead of one per tensor). Each rank packs its shards of the
group's chunks into one send buffer; the all-gather leaves the ranks' packs side by
side, and each chunk's full buffer is cut out of that (one strided copy per chunk,
the price of keeping every parameter contiguous). A group is the unit the gather
scheduler walks and agrees on; release stays per chunk, so a tied parameter can outlive
the rest of its module's group. Members already gathered on this rank still take part
in the collective (every rank must send the same pack) but are not overwritten.
Without declared groups every chunk is its own group.
"""

from __future__ import annotations

from collections.abc import Sequence

from zero_core.chunk import BufferPool, Chunk
from zero_core.comm import CommBackend

__all__ = ["GatherGroup", "build_groups"]


class GatherGroup:
    """Consecutive chunks of one dtype gathered, and after a step published, with one all-gather each
    (:func:`zero_core._collectives.gather_group`, :func:`~zero_core._collectives.publish_group`)."""

    def __init__(self, index: int, chunks: Sequence[Chunk], pool: BufferPool) -> None:
        self.index = index
        self.chunks = tuple(chunks)
        self.pool = pool
        first = self.chunks[0]
        self.dtype, self.device, self.world_size = first.dtype, first.device, first.world_size
        self.shard_numel = sum(c.shard_size for c in self.chunks)
        # The members share one chunk plan (ShardPlan.validate): their own shard group, when shard() gave one.
        self.comm: CommBackend | None = first.comms.gather if first.comms is not None else None

    @property
    def refreshed(self) -> tuple[Chunk, ...]:
        """Trainable chunks whose kept full buffers are refreshed after each optimizer step (stages 1 and 2);
        asked at each step, since parameters may be frozen or unfrozen between steps."""
        return tuple(c for c in self.chunks if c.persistent and c.requires_grad)

    @property
    def is_gathered(self) -> bool:
        """Every member's full buffer exists or is being filled."""
        return all(c.is_gathered for c in self.chunks)

    def __repr__(self) -> str:
        return f"GatherGroup(index={self.index}, chunks={[c.index for c in self.chunks]}, shard_numel={self.shard_numel})"


def build_groups(chunks: Sequence[Chunk], declared: Sequence[Sequence[int]] | None, pool: BufferPool) -> list[GatherGroup]:
    """The plan's gather groups as objects; one group per chunk when the plan declares none."""
    if declared is None:
        return [GatherGroup(i, [c], pool) for i, c in enumerate(chunks)]
    return [GatherGroup(i, [chunks[k] for k in members], pool) for i, members in enumerate(declared)]
