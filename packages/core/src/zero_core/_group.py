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

import torch

from zero_core._state import ChunkState
from zero_core.chunk import BufferPool, Chunk
from zero_core.comm import CommBackend, Pending

__all__ = ["GatherGroup", "build_groups"]


class GatherGroup:
    """Consecutive chunks of one dtype gathered, and after a step published, with one all-gather each."""

    def __init__(self, index: int, chunks: Sequence[Chunk], pool: BufferPool) -> None:
        self.index = index
        self.chunks = tuple(chunks)
        self.pool = pool
        first = self.chunks[0]
        self.dtype, self.device, self.world_size = first.dtype, first.device, first.world_size
        self.shard_numel = sum(c.shard_size for c in self.chunks)
        # The members share one chunk plan (ShardPlan.validate): their own shard group, when shard() gave one.
        self.comm: CommBackend | None = first.groups.gather if first.groups is not None else None

    @property
    def refreshed(self) -> tuple[Chunk, ...]:
        """Trainable chunks whose kept full buffers are refreshed after each optimizer step (stages 1 and 2);
        asked at each step, since parameters may be frozen or unfrozen between steps."""
        return tuple(c for c in self.chunks if c.persistent and c.requires_grad)

    @property
    def is_gathered(self) -> bool:
        """Every member's full buffer exists or is being filled."""
        return all(c.is_gathered for c in self.chunks)

    def gather(self, comm: CommBackend, *, async_op: bool = False, keep: bool = True) -> None:
        """All-gather the group; members not gathered yet are filled unless ``keep=False`` (a gather only peers need)."""
        comm = self.comm or comm
        targets = [c for c in self.chunks if not c.is_gathered] if keep else []
        if len(self.chunks) == 1:
            if targets:
                targets[0].gather(comm, async_op=async_op)
            else:
                self.chunks[0].gather_for_peers(comm)
            return
        if all(c.state is ChunkState.SHARDED_POST_FORWARD for c in self.chunks):  # copies kept by the forward: gather inside their groups of k
            self._gather_copies(targets, async_op=async_op)
            return
        send = self.pool.take(self.shard_numel, self.dtype, self.device, zeroed=False)
        offset = 0
        with torch.no_grad():
            for chunk in self.chunks:
                send[offset : offset + chunk.shard_size].copy_(chunk._compute_shard())
                offset += chunk.shard_size
        received = self.pool.take(self.world_size * self.shard_numel, self.dtype, self.device, zeroed=False)
        unpack = _Unpack(self, comm.all_gather(received, send, async_op=True), send, received, self.chunks, targets)
        if not targets:
            unpack.wait()
            return
        for chunk in targets:
            chunk.begin_gather(unpack)
        if not async_op:
            for chunk in targets:
                chunk.wait()

    def _gather_copies(self, targets: Sequence[Chunk], *, async_op: bool) -> None:
        """The members' kept copies (each ``1/k`` of its rank-major buffer) gathered in one all-gather over the group
        of ``k``; each member's rank-major buffer is its column block of the result. Only under a static graph
        (shard() checks), so every rank holds copies of the same members."""
        sub = self.chunks[0].groups.sub
        k = sub.world_size
        parts = [c.size // k for c in self.chunks]
        send = torch.cat([c.take_post_forward_copy() for c in self.chunks])
        received = self.pool.take(k * sum(parts), self.dtype, self.device, zeroed=False)
        pending = sub.all_gather(received, send, async_op=True)
        unpack = _CopiesOut(self, pending, received, parts, targets)
        for chunk in targets:
            chunk.begin_gather(unpack)
        if not async_op:
            for chunk in targets:
                chunk.wait()
        elif not targets:
            unpack.wait()

    def publish_parameters(self, comm: CommBackend) -> list[Pending | None]:
        """After a step, bring the kept full buffers of trainable members up to date (see ``Chunk.publish_parameters``)."""
        comm = self.comm or comm
        refreshed = self.refreshed
        if len(refreshed) <= 1 or self.world_size == 1:
            return [c.publish_parameters(comm, async_op=True) for c in refreshed]
        numel = sum(c.shard_size for c in refreshed)
        send = self.pool.take(numel, self.dtype, self.device, zeroed=False)
        offset = 0
        for chunk in refreshed:
            send[offset : offset + chunk.shard_size].copy_(chunk.refresh_own_slice())
            offset += chunk.shard_size
        received = self.pool.take(self.world_size * numel, self.dtype, self.device, zeroed=False)
        unpack = _Unpack(self, comm.all_gather(received, send, async_op=True), send, received,
                         refreshed, refreshed)
        return [unpack]

    def __repr__(self) -> str:
        return f"GatherGroup(index={self.index}, chunks={[c.index for c in self.chunks]}, shard_numel={self.shard_numel})"


class _Unpack:
    """A group's all-gather in flight; ``wait()`` (idempotent) cuts each target's full buffer out of it.

    ``packed`` are the chunks whose shards the send buffer holds, in order; ``targets`` those to fill.
    """

    def __init__(self, group: GatherGroup, pending: Pending | None, send: torch.Tensor, received: torch.Tensor,
                 packed: Sequence[Chunk], targets: Sequence[Chunk]) -> None:
        self._group, self._pending = group, pending
        self._packed, self._targets = tuple(packed), {id(c) for c in targets}
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = (send, received)

    def wait(self) -> None:
        if self._buffers is None:
            return
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        send, received = self._buffers
        self._buffers = None
        packed = received.view(self._group.world_size, -1)
        offset = 0
        with torch.no_grad():
            for chunk in self._packed:
                if id(chunk) in self._targets:
                    chunk.copy_out(packed[:, offset : offset + chunk.shard_size])
                offset += chunk.shard_size
        self._group.pool.give(send)
        self._group.pool.give(received)


class _CopiesOut:
    """A gather of kept copies in flight; ``wait()`` (idempotent) rebuilds each target's full buffer."""

    def __init__(self, group: GatherGroup, pending: Pending | None, received: torch.Tensor, parts: Sequence[int],
                 targets: Sequence[Chunk]) -> None:
        self._group, self._pending, self._received = group, pending, received
        self._parts, self._targets = list(parts), {id(c) for c in targets}

    def wait(self) -> None:
        if self._received is None:
            return
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        received, self._received = self._received, None
        k = len(received) // sum(self._parts)
        by_rank = received.view(k, -1)
        offset = 0
        with torch.no_grad():
            for chunk, part in zip(self._group.chunks, self._parts):
                if id(chunk) in self._targets:  # rank p of the group sent ranks p*S/k .. of the chunk's rank-major buffer
                    chunk.copy_out(by_rank[:, offset : offset + part].reshape(chunk.world_size, chunk.shard_size))
                offset += part
        self._group.pool.give(received)


def build_groups(chunks: Sequence[Chunk], declared: Sequence[Sequence[int]] | None, pool: BufferPool) -> list[GatherGroup]:
    """The plan's gather groups as objects; one group per chunk when the plan declares none."""
    if declared is None:
        return [GatherGroup(i, [c], pool) for i, c in enumerate(chunks)]
    return [GatherGroup(i, [chunks[k] for k in members], pool) for i, members in enumerate(declared)]
