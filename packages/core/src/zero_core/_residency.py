"""Which chunks are gathered: gathers through the scheduler, releases, what a forward keeps for its backward.

[Note: who moves a chunk] makes the engine the only one that gathers and releases; this object
is how it does so. It owns the gather scheduler and the buffers a phase borrows, and tells the
placement policy and :class:`~zero_core._module_params.ModuleParameters` of every change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from zero_core._accounting import engine_work
from zero_core._collectives import publish_group
from zero_core._group import GatherGroup
from zero_core._module_params import ModuleParameters
from zero_core._schedule import GatherScheduler
from zero_core._state import ChunkState
from zero_core.chunk import Chunk
from zero_core.comm import CommBackend

if TYPE_CHECKING:
    from zero_core.placement import PlacementPolicy

__all__ = ["Residency"]


class Residency:
    """Gathers and releases chunks for the engine, and frees the buffers a phase borrowed."""

    def __init__(self, chunks: Sequence[Chunk], groups: Sequence[GatherGroup], *, comm: CommBackend,
                 comms: Sequence[CommBackend], placement: PlacementPolicy, params: ModuleParameters,
                 stage: int, agree: bool) -> None:
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

    @engine_work
    def gather(self, chunks: Sequence[Chunk], *, backward: bool) -> None:
        self._placement.before_compute(chunks, backward=backward)
        with torch.profiler.record_function("ZeRO::all_gather"):
            self.scheduler.gather(chunks)
        self._params.show(chunks)

    @engine_work
    def release(self, chunks: Sequence[Chunk], *, keep_copy: bool = False) -> None:
        done = [c for c in chunks if c.is_gathered and not c.persistent]
        for chunk in done:
            chunk.release(keep_copy=keep_copy)
        if done:
            self._placement.after_release(done)
            self._params.show(done)

    def release_after_forward(self, chunks: Sequence[Chunk], *, for_backward: bool) -> None:
        """A forward is done with ``chunks``: each is resharded as its plan says when a backward will need it.

        ``reshard_after_forward=False`` keeps a trainable chunk gathered until its backward has reduced it; an
        int keeps a copy sharded inside groups of that size for the backward's gather; ``True`` frees it."""
        if not for_backward or self._stage != 3:
            self.release(chunks)
            return
        now, with_copy = [], []
        for chunk in chunks:
            policy = chunk.plan.reshard_after_forward if chunk.plan is not None else True
            if policy is False and chunk.requires_grad:
                continue
            (with_copy if policy is not True and chunk.requires_grad else now).append(chunk)
        self.release(now)
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
        """See [Note: no idle buffers between steps] in ``zero_core._engine``."""
        if self.chunks:
            self.chunks[0].pool.clear()
        for comm in self._comms:
            comm.free()

    @engine_work
    def after_step(self, *, publish: bool) -> None:
        """An optimizer step ended (returned, or raised after the engine prepared it): the kept full buffers are
        refreshed from the masters (so forward sees what the optimizer holds) unless ``publish`` is False (an
        fp16 overflow skipped the step), idle buffers go, and the placement policy puts shards back."""
        if publish and self._refresh_after_step:
            with torch.profiler.record_function("ZeRO::publish_parameters"):
                # one group at a time: each all-gather's receive buffer is free again before the next one takes it
                for group in self._refresh_after_step:
                    for pending in publish_group(group, self._comm):
                        if pending is not None:
                            pending.wait()
        self.free_idle_buffers()
        self._placement.after_step(self.chunks)
