"""Gather groups: several chunks whose all-gathers travel as one collective.

[Note: gather groups]
A plan may declare that consecutive chunks form a *gather group* (tensor-wise ZeRO-3
makes one chunk per parameter and one group per module, so a module's parameters
arrive in one all-gather instead of one per tensor). Each rank packs its shards of the
group's chunks into one send buffer; the all-gather leaves the ranks' packs side by
side, and each chunk's full buffer is cut out of that (one strided copy per chunk,
the price of keeping every parameter contiguous). A group is what one all-gather gathers: the
gather scheduler walks and agrees on groups, and the reducer waits for each group's gradients
and reduces its chunks together (the group keeps its own reduce bookkeeping, a
:class:`~zero_core.base._state.ReduceState`); release stays per chunk, so a tied parameter can
outlive the rest of its module's group. Members already gathered on this rank still take part
in the collective (every rank must send the same pack) but are not overwritten.
Without declared groups every chunk is its own group.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from zero_core.base._state import ReduceState
from zero_core.chunks.chunk import BufferPool, Chunk
from zero_core.comm.backend import CommBackend

__all__ = ["GatherGroup", "build_groups"]


class GatherGroup:
    """Consecutive chunks of one dtype gathered, and after a step refreshed, with one all-gather each
    (:func:`zero_core.chunks._collectives.gather_group`, :func:`~zero_core.chunks._collectives.refresh_group`), and reduced
    together once every gradient the group waits for has arrived."""

    def __init__(self, index: int, chunks: Sequence[Chunk], pool: BufferPool) -> None:
        self.index = index
        self.chunks = tuple(chunks)
        self.pool = pool
        first = self.chunks[0]
        # the shard group's ranks, and what each sends per all-gather (group shards, when cut over the replicas)
        self.dtype, self.device, self.world_size = first.dtype, first.device, first.gather_world
        self.shard_numel = sum(c.gather_numel for c in self.chunks)
        # The members share one chunk plan (ShardPlan.validate): their own shard group, when shard() gave one.
        self.comm: CommBackend | None = first.comms.gather if first.comms is not None else None
        # Reduce bookkeeping, changed only by the transitions below (the reducer calls them). The parameters (ids)
        # the graphs built since the last backward can deliver a gradient to; the last backward's, for a second
        # backward through a retained graph; those the running backward still waits for.
        self.reduce_state = ReduceState.IDLE
        self._expected: set[int] = set()
        self._last_expected: set[int] = set()
        self._waiting: set[int] = set()

    @property
    def refreshed(self) -> tuple[Chunk, ...]:
        """Trainable chunks whose kept full buffers are refreshed after each optimizer step (stages 1 and 2);
        asked at each step, since parameters may be frozen or unfrozen between steps."""
        return tuple(c for c in self.chunks if c.persistent and c.requires_grad)

    @property
    def is_gathered(self) -> bool:
        """Every member's full buffer exists or is being filled."""
        return all(c.is_gathered for c in self.chunks)

    # -- reduce bookkeeping --------------------------------------------------------------------
    def expect(self, params: AbstractSet[int]) -> None:
        """A forward built a graph that can deliver a gradient to these of the group's parameters (ids)."""
        self._expected |= params

    def forget_graphs(self) -> None:
        """After a step: graphs built before it cannot be backwarded after it."""
        self._expected, self._last_expected = set(), set()

    def begin_backward(self, *, kept_graph: bool) -> None:
        """IDLE -> WAITING or READY: a backward begins; through the last backward's graph when ``kept_graph``
        (no forward since), which reaches what that one did."""
        expected = self._last_expected if kept_graph else self._expected
        self._last_expected, self._expected = expected, set()
        self._waiting = set(expected)
        self.reduce_state = ReduceState.WAITING if self._waiting else ReduceState.READY

    def arrived(self, param: int) -> bool:
        """WAITING -> READY once the last gradient it waits for (parameter id ``param``) has arrived; whether it is
        READY now."""
        self._waiting.discard(param)
        if self.reduce_state is ReduceState.WAITING and not self._waiting:
            self.reduce_state = ReduceState.READY
        return self.reduce_state is ReduceState.READY

    def mark_reduced(self) -> None:
        """-> REDUCED: its reductions are being launched (ready, or the backward ended without the rest)."""
        self.reduce_state = ReduceState.REDUCED

    def end_backward(self) -> None:
        """-> IDLE: the backward is over (finished or undone); nothing waits any more."""
        self._waiting = set()
        self.reduce_state = ReduceState.IDLE

    def __repr__(self) -> str:
        return f"GatherGroup(index={self.index}, chunks={[c.index for c in self.chunks]}, shard_numel={self.shard_numel})"


def build_groups(chunks: Sequence[Chunk], declared: Sequence[Sequence[int]] | None, pool: BufferPool) -> list[GatherGroup]:
    """The plan's gather groups as objects; one group per chunk when the plan declares none."""
    if declared is None:
        return [GatherGroup(i, [c], pool) for i, c in enumerate(chunks)]
    return [GatherGroup(i, [chunks[k] for k in members], pool) for i, members in enumerate(declared)]
