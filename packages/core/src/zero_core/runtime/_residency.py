"""Which chunks are gathered: gathers through the scheduler, releases, what a forward keeps for its backward.

[Note: who moves a chunk] makes the engine the only one that gathers and releases; this object
is how it does so. It owns the gather scheduler and the buffers a phase borrows, and tells the
placement policy and :class:`~zero_core.runtime._module_params.ModuleParameters` of every change.

[Note: writes outside the optimizer]
A kept full buffer (stages 1 and 2, a chunk a policy keeps gathered, a single rank computing
in another dtype) holds copies of master values: other ranks' rows, or this rank's cast.
After the registered optimizer's step the engine refreshes them (:meth:`Residency.after_step`),
but parameters are written in other ways too: a second optimizer, an optimizer re-created
after ``shard()``, ``nn.init`` on a layer, an in-place clamp or decay under ``no_grad``,
``load_state_dict`` or an EMA copied in for evaluation. Each of those changes only the master
values, so the next forward would mix new and stale ones. Every in-place write through a
sharded parameter bumps its version counter (the DTensor's own; its local tensor's does not
move), so the residency remembers each such chunk's counters when it last refreshed it, and
a forward (and every collective verb) first compares them: no write costs a Python loop over
the parameters and nothing else. A rank that sees a write says so in the phase's lockstep
round (one byte of it, see [Note: lockstep rounds] in ``zero_core.comm._lockstep``), and when any
rank did, every rank refreshes every kept buffer from the masters (the step's all-gathers,
once). A rank that wrote alone, at stages 1 and 2 where a forward has no round of its own,
opens one, which its peers' next round reports as ranks out of step. Two writes are not seen:
through ``param.data`` (a tensor outside autograd's version tracking; write through the
parameter under ``torch.no_grad()`` instead), and one in the same window as a placement
policy's move of that shard (a move restarts the counters; see ``Chunk.shard_moves``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from zero_core.base._accounting import engine_work
from zero_core.base._state import ChunkState
from zero_core.base._trace import ALL_GATHER, REFRESH_GROUP_SHARDS, REFRESH_PARAMETERS, phase
from zero_core.chunks._collectives import refresh_group, refresh_group_shard
from zero_core.chunks._group import GatherGroup
from zero_core.chunks.chunk import Chunk
from zero_core.comm.backend import CommBackend
from zero_core.runtime._module_params import ModuleParameters
from zero_core.runtime._schedule import GatherScheduler

if TYPE_CHECKING:
    from zero_core.interfaces.placement import PlacementPolicy

__all__ = ["Residency"]


class Residency:
    """Gathers and releases chunks for the engine, and frees the buffers a phase borrowed."""

    def __init__(self, chunks: Sequence[Chunk], groups: Sequence[GatherGroup], *, comm: CommBackend,
                 comms: Sequence[CommBackend], placement: PlacementPolicy, params: ModuleParameters,
                 stage: int, agree: Callable[[int], int] | None) -> None:
        self.chunks = tuple(chunks)
        self.groups = list(groups)
        self._comm = comm
        self._comms = tuple(comms)  # every backend the chunks use: each drops its idle buffers after a phase
        self._placement = placement
        self._params = params
        self._stage = stage
        self.scheduler = GatherScheduler(self.groups, comm, placement, agree=agree)
        # Groups that keep full buffers, refreshed from the master shards after each step (their trainable members).
        self._refresh_after_step = [g for g in self.groups if any(c.persistent for c in g.chunks)]
        self._members = {id(g): frozenset(c.index for c in g.chunks) for g in self.groups}
        # Chunks cut over the replicas, whose group shards are refreshed after each step (see [Note: optimizer states
        # across replicas] in zero_core.chunks.chunk).
        self._group_sharded = [c for c in self.chunks if c.group_shard is not None]
        # Per chunk whose kept buffer mirrors master values: its shard moves and its parameters' version counters when
        # it was last refreshed (see [Note: writes outside the optimizer]).
        self._refreshed: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.mark_refreshed()

    @engine_work
    def gather(self, chunks: Sequence[Chunk], *, backward: bool) -> None:
        self._placement.before_compute(chunks, backward=backward)
        with phase(ALL_GATHER, chunks):
            self.scheduler.gather(chunks)
        self._params.show(chunks)

    def release(self, chunks: Sequence[Chunk], *, keep_copy: bool = False) -> None:
        done = [c for c in chunks if not c.persistent and c.is_gathered]
        if done:  # nothing to release (a kept buffer of stages 1 and 2, a chunk released already): no engine work
            self._release(done, keep_copy=keep_copy)

    @engine_work
    def _release(self, done: list[Chunk], *, keep_copy: bool) -> None:
        for chunk in done:
            chunk.release(keep_copy=keep_copy)
        self._placement.after_release(done)
        self._params.show(done)

    def release_after_forward(self, chunks: Sequence[Chunk], *, for_backward: bool) -> None:
        """A forward is done with ``chunks``: each is resharded as its plan says when a backward will need it.

        ``reshard_after_forward=False`` keeps a trainable chunk gathered until its backward has reduced it; an
        int keeps a copy sharded inside groups of that size for the backward's gather; ``True`` frees it."""
        if not for_backward or self._stage != 3:
            self.release(chunks)
            return
        now: list[Chunk] = []
        with_copy: list[Chunk] = []
        for chunk in chunks:
            if chunk.persistent:  # kept gathered for good: nothing to release (release() would skip it)
                continue
            policy = chunk.plan.reshard_after_forward if chunk.plan is not None else True
            if policy is False and chunk.requires_grad:
                continue
            (with_copy if policy is not True and chunk.requires_grad else now).append(chunk)
        if now:
            self.release(now)
        if with_copy:
            self.release(with_copy, keep_copy=True)

    def drop_leftovers(self, *, wait: bool = False) -> None:
        """No backward will use what forwards kept for it (copies, chunks kept gathered): free them.

        ``wait``: complete the gathers still in flight first (every rank issued them), never left to write later."""
        for chunk in self.chunks:
            if wait and chunk.state is ChunkState.GATHERING:
                chunk.wait()
            chunk.drop_post_forward_copy()
        self.release(self.chunks)

    def free_idle_buffers(self) -> None:
        """See [Note: no idle buffers between steps] in ``zero_core.runtime._engine``."""
        if self.chunks:
            self.chunks[0].pool.clear()
        for comm in self._comms:
            comm.free()

    @engine_work
    def after_step(self, *, refresh_kept: bool, chunks: Sequence[Chunk] | None = None) -> None:
        """An optimizer step ended (returned, or raised after the engine prepared it): the kept full buffers are
        refreshed from the masters (so forward sees what the optimizer holds) unless ``refresh_kept`` is False (an
        fp16 overflow skipped the step), idle buffers go, and the placement policy puts shards back. ``chunks``:
        the only ones the step changed (one of several optimizers; the same on every rank), else every chunk."""
        changed = None if chunks is None else {c.index for c in chunks}
        refresh = self._refresh_after_step if changed is None else \
            [g for g in self._refresh_after_step if any(c.index in changed for c in g.chunks)]
        mirrors = self._mirrors()
        if refresh_kept and refresh:
            with phase(REFRESH_PARAMETERS):
                # Only groups with a mirror: a kept buffer that is its master (one rank, shard_is_view) has nothing to
                # refresh, and one set operation per group says so, not refresh_group's calls per chunk (at one rank
                # in one dtype: every group, every step).
                mirrored = {c.index for c in mirrors}
                # one group at a time: each all-gather's receive buffer is free again before the next one takes it
                for group in refresh:
                    if self._members[id(group)].isdisjoint(mirrored):
                        continue
                    for pending in refresh_group(group, self._comm):
                        if pending is not None:
                            pending.wait()
        stepped = [c for c in self._group_sharded if c.requires_grad and (changed is None or c.index in changed)]
        if refresh_kept and stepped:
            with phase(REFRESH_GROUP_SHARDS, stepped):
                for chunk in stepped:
                    refresh_group_shard(chunk)
        self.free_idle_buffers()
        self._placement.after_step(self.chunks)
        if refresh_kept:
            # only the mirrors (asked again: the placement policy may have moved a shard just now, making its chunk
            # one): written() reads no other chunk's record (the usual case at one rank: none)
            mirrors = self._mirrors()
            if mirrors:
                marked = {c.index for g in refresh for c in g.refreshed} | {c.index for c in stepped}
                self.mark_refreshed([c for c in mirrors if c.index in marked])

    # -- writes outside the optimizer -------------------------------------------------------------------
    def _mirrors(self) -> list[Chunk]:
        """Chunks whose kept full buffer (or group shard) holds copies of master values (other ranks' rows, or a
        cast)."""
        return [c for c in self.chunks if (c.persistent and (c.world_size > 1 or not c.shard_is_view))
                or c.group_shard is not None]

    def mark_refreshed(self, chunks: Sequence[Chunk] | None = None) -> None:
        """The kept buffers of ``chunks`` (every mirror when None) hold their masters' values now."""
        for chunk in self._mirrors() if chunks is None else chunks:
            self._refreshed[chunk.index] = (chunk.shard_moves, tuple(seg.param._version for seg in chunk.segments))

    def written(self) -> bool:
        """Whether a sharded parameter of a mirrored chunk was written in place since its buffer was refreshed."""
        found = False
        for chunk in self._mirrors():
            moves, versions = self._refreshed.get(chunk.index, (-1, ()))
            now = tuple(seg.param._version for seg in chunk.segments)
            if moves != chunk.shard_moves:  # a policy moved the shard: its counters restarted (the move kept the values)
                self._refreshed[chunk.index] = (chunk.shard_moves, now)
            elif now != versions:
                found = True
        return found

    @engine_work
    def refresh(self) -> None:
        """Refresh every kept full buffer from the masters (collective: every rank calls it, see ``written``)."""
        with phase(REFRESH_PARAMETERS):
            for group in self._refresh_after_step:
                for pending in refresh_group(group, self._comm, members=[c for c in group.chunks if c.persistent]):
                    if pending is not None:
                        pending.wait()
            for chunk in self._group_sharded:
                refresh_group_shard(chunk)
        self.mark_refreshed()
