"""Gradient reduction: each chunk reduced once per backward, in one order on every rank.

See [Note: gradient reduction order] in ``zero_core.runtime._engine``. :class:`GradientReducer` owns that
order across gather groups and the thread that completes reductions; each
:class:`~zero_core.chunks._group.GatherGroup` keeps its own bookkeeping (which gradients it waits for,
whether it is ready or reduced). The engine tells the reducer when a forward built a graph, when
a backward begins and ends, and releases each chunk it launches.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence

import torch
from torch.autograd.graph import get_gradient_edge

from zero_core.base._state import ReduceState
from zero_core.base._trace import REDUCE_SCATTER, REDUCE_WAIT, phase, traced
from zero_core.base.errors import GradientLostError
from zero_core.chunks._collectives import reduce_gradients
from zero_core.chunks._group import GatherGroup
from zero_core.chunks.chunk import Chunk
from zero_core.comm._agreement import any_rank
from zero_core.comm.backend import CommBackend
from zero_core.runtime._waiter import ReductionWaiter

__all__ = ["GradientReducer"]


class GradientReducer:
    """Reduce-scatters (and HSDP all-reduces) chunks as their gradients become ready; hands the results over."""

    def __init__(self, groups: Sequence[GatherGroup], *, reduce_comm: CommBackend, mesh_comms: Sequence[CommBackend],
                 agree: bool) -> None:
        self._groups = tuple(groups)
        chunks = [c for g in self._groups for c in g.chunks]
        self._chunks = tuple(sorted(chunks, key=lambda c: c.index))
        self._comm = reduce_comm
        self._mesh_comms = tuple(mesh_comms)
        # Whether ranks agree on which parameters got a gradient anywhere (off with static_graph=True).
        self._agree = agree
        # Unsharded parameter (by id) -> its chunk, its slot, its group: what a gradient hook is given, found with
        # one lookup per gradient (this runs for every parameter in every backward).
        group_of = {c.index: g for g in self._groups for c in g.chunks}
        self._where = {id(s.param): (c, i, group_of[c.index]) for c in chunks for i, s in enumerate(c.slots)}
        self._group_of = group_of
        self._waiter = ReductionWaiter()
        # One rank and nothing to sum over replicas: a reduction has nothing to wait for (its complete() only
        # scales and lands the gradient), so it completes at once on this thread instead of waking the waiter
        # thread once per chunk (see PendingReduction in zero_core.chunks._collectives).
        self._local = all(c.world_size == 1 and (c.comms is None or c.comms.replicate is None) for c in chunks)
        # False inside ZeroModule.no_sync(): backwards accumulate full gradients without reducing them.
        self.sync = True
        # Groups reduced in this order on every rank (the reverse of the plan), each with its trainable chunks in
        # reverse; recomputed when a step's first forward begins, since parameters may be (un)frozen between steps.
        self._steps: list[tuple[GatherGroup, tuple[Chunk, ...]]] = []
        self.order: list[Chunk] = []  # the trainable chunks, in the order they are reduced
        self._expectable: list[tuple[GatherGroup, frozenset[int]]] = []  # see _take_order
        self._take_order()
        self._next = 0  # the next group of the order to reduce in the running backward
        # Chunks launched in the running backward whose reductions complete on the waiter thread, in launch order,
        # until their gradients are handed over as they land (see [Note: gradients handed over as they land] in
        # zero_core.chunks._chunk_grads); empty at one rank, where they land at launch.
        self.in_flight: collections.deque[Chunk] = collections.deque()

    def _take_order(self) -> None:
        steps = [(g, trainable) for g in reversed(self._groups)
                 if (trainable := tuple(c for c in reversed(g.chunks) if c.requires_grad))]
        if steps == self._steps:  # nothing (un)frozen since: the sets below are the same (this runs every step)
            return
        self._steps = steps
        self.order = [c for _, trainable in self._steps for c in trainable]
        # Each group of the order with its trainable parameters' ids, taken with the order: what expect() intersects
        # with a graph's reachable parameters after every forward, one set operation per group instead of an id()
        # and a lookup per parameter.
        self._expectable = [(g, frozenset(id(s.param) for c in trainable for s in c.slots)) for g, trainable in self._steps]

    # -- between steps and in forward ------------------------------------------------------------------
    @property
    def has_unreduced(self) -> bool:
        """Gradients accumulated inside ``no_sync()`` and not reduced yet."""
        for chunk in self.order:  # a loop, not any(): asked when each backward begins
            if chunk.grads.unreduced:
                return True
        return False

    def reorder(self) -> None:
        """A step's first forward begins (no ``no_sync()`` accumulation open): take the trainable chunks anew."""
        for chunk in self._chunks:  # a loop, not any(): this runs at every step's first forward
            if chunk.grads.unreduced:
                return
        self._take_order()

    def expect(self, reachable: set[int]) -> None:
        """A forward built a graph that reaches the parameters (ids) in ``reachable``."""
        for group, ids in self._expectable:
            group.expect(ids & reachable)

    def forget_graphs(self) -> None:
        """After a step: graphs built before it cannot be backwarded after it."""
        for group in self._groups:
            group.forget_graphs()

    # -- backward --------------------------------------------------------------------------------------
    def begin(self, *, forwards: int) -> None:
        """A backward begins after ``forwards`` forwards that built a graph (0: through a kept graph)."""
        for group in self._groups:
            # a backward with no forward since the last one runs through a kept graph: it reaches what that one did
            group.begin_backward(kept_graph=not forwards)
        sync = self.sync
        for chunk in self._chunks:
            chunk.grads.begin_backward(sync=sync)
        self._next = 0

    def accumulates(self) -> bool:
        """Whether the running backward accumulates into a trainable parameter (asked inside the backward).

        False under ``torch.autograd.grad`` and ``backward(inputs=...)`` naming none of them: such a pass
        captures gradients of other tensors (a gradient penalty's inputs) and gives the parameters none."""
        for chunk in self.order:
            for slot in chunk.slots:
                if not slot.param.requires_grad:
                    continue
                try:
                    if torch._C._will_engine_execute_node(get_gradient_edge(slot.param).node):
                        return True
                except RuntimeError:  # torch.autograd.grad() is running: it captures gradients, never accumulates
                    return False
        return False

    def is_reduced(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s reduction was launched in the running backward (a later gradient would be lost)."""
        return self._group_of[chunk.index].reduce_state is ReduceState.REDUCED

    def where(self, param: torch.Tensor) -> tuple[Chunk, int, GatherGroup]:
        """``param``'s (an unsharded parameter's) chunk, its slot there and its gather group."""
        return self._where[id(param)]

    def accumulated(self, param: torch.Tensor) -> bool:
        """Autograd accumulated ``param``'s gradient (an unsharded parameter); whether the next group of the order is
        ready to reduce now (:meth:`accumulated_at`, with ``param``'s place looked up)."""
        return self.accumulated_at(*self._where[id(param)], id(param))

    def accumulated_at(self, chunk: Chunk, slot: int, group: GatherGroup, key: int) -> bool:
        """Autograd accumulated the gradient of ``chunk``'s slot ``slot`` (``group``'s; ``key`` the unsharded
        parameter's id); whether the next group of the order is ready to reduce now (:attr:`next_ready`, answered
        here: this runs for every parameter in every backward, from its hook: see [Note: one call per gradient] in
        ``zero_core.runtime._engine``)."""
        if group.reduce_state is ReduceState.REDUCED:
            raise GradientLostError(
                f"parameter {chunk.slots[slot].name!r} received a gradient after its chunk {chunk.index} was already "
                "reduce-scattered in this backward, so the gradient would be lost. This happens with reentrant "
                "activation checkpointing (use torch.utils.checkpoint(..., use_reentrant=False)) or when a "
                "parameter's gradient does not flow through the wrapped model's outputs."
            )
        chunk.grads.adopt(slot)  # see [Note: gradient buffers on arrival]; the engine calls this as engine work
        group.arrived(key)
        # the next group may have been READY before this gradient (it waits for none): asked after every gradient
        steps, nxt = self._steps, self._next
        return nxt < len(steps) and steps[nxt][0].reduce_state is ReduceState.READY

    @property
    def next_ready(self) -> bool:
        """Whether the next group of the order is ready to reduce (asked after every gradient, before
        :meth:`launch_ready` makes a generator)."""
        return self._next < len(self._steps) and self._steps[self._next][0].reduce_state is ReduceState.READY

    def launch_ready(self, loss_scale: float) -> Iterator[Chunk]:
        """Launch the reductions of every group that is next in the order and ready; yields each chunk once launched."""
        while self._next < len(self._steps):
            if self._steps[self._next][0].reduce_state is not ReduceState.READY:
                return
            yield from self._launch_next(loss_scale)

    def launch_rest(self, loss_scale: float) -> Iterator[Chunk]:
        """The backward ended: launch every chunk not reduced yet, in order (zeros for gradients that never came)."""
        while self._next < len(self._steps):
            yield from self._launch_next(loss_scale)

    def _launch_next(self, loss_scale: float) -> Iterator[Chunk]:
        group, trainable = self._steps[self._next]
        group.mark_reduced()
        self._next += 1
        for chunk in trainable:
            self._launch(chunk, loss_scale)
            yield chunk

    def _launch(self, chunk: Chunk, loss_scale: float) -> None:
        # engine work: only the engine's gradient hook and the end of backward launch, both marked as such
        with phase(REDUCE_SCATTER, chunk):
            # at one rank, where the reduction is the identity (see [Note: gradients handed over as autograd made them])
            if chunk.grads.direct and loss_scale == 1.0 and chunk.grads.hand_over_directly():
                return
            reduction = reduce_gradients(chunk, self._comm, loss_scale=loss_scale)
            if self._local:
                reduction.complete()
                chunk.grads.hand_over_landed()
            else:
                self._waiter.submit(reduction)
                self.in_flight.append(chunk)

    def hand_over_landed(self) -> None:
        """On the training thread, in a backward: hand over the gradients of the reductions the waiter thread has
        landed, in launch order (see [Note: gradients handed over as they land] in zero_core.chunks._chunk_grads)."""
        in_flight = self.in_flight
        while in_flight and in_flight[0].grads.landed:
            in_flight.popleft().grads.hand_over_landed()

    @traced(REDUCE_WAIT)
    def complete(self) -> None:
        """Every reduce group launches what a bucketing backend still holds (on every rank, in one order), and
        every launched reduction completes; re-raises the first failure."""
        self._comm.flush()
        for comm in self._mesh_comms:
            comm.flush()
        self._waiter.join()

    def hand_over(self, *, apply: bool = True) -> None:
        """Give each optimizer segment its gradient if its parameter got one on any rank (``apply=False``: only
        join the ranks' agreement on it, for a backward that raised; see [Note: a backward that raises finishes
        its collectives])."""
        if self._comm.world_size == 1 or not self._agree:  # each chunk's own flags are the answer: nothing to join
            if apply:
                for chunk in self.order:
                    chunk.grads.hand_over(chunk.grads.got)
            return
        flags = [f for chunk in self.order for f in chunk.grads.got]
        agreed = any_rank(self._comm, torch.tensor(flags, dtype=torch.uint8)).tolist()
        flags = [bool(f) for f in agreed]
        if not apply:
            return
        offset = 0
        for chunk in self.order:
            chunk.grads.hand_over(flags[offset : offset + len(chunk.slots)])
            offset += len(chunk.slots)

    def end(self) -> None:
        """The backward is over (finished or undone): nothing waits any more."""
        self.in_flight.clear()
        for group in self._groups:
            group.end_backward()

    def discard_unreduced(self, *, set_to_none: bool = True, chunks: Sequence[Chunk] | None = None) -> None:
        """``zero_grad()``: gradients a ``no_sync()`` window accumulated and never reduced are dropped, as in DDP.

        With ``set_to_none=False``, a parameter the window gave a gradient on this rank keeps a
        zero gradient, as its ``.grad`` would in one process (momentum then still acts on it).
        ``chunks``: only these (the chunks one of several optimizers clears); every chunk when None."""
        for chunk in self._chunks if chunks is None else chunks:
            if not chunk.grads.unreduced:
                continue
            if not set_to_none:
                for seg in chunk.segments:
                    if chunk.grads.got[seg.slot] and seg.param.grad is None and seg.param.requires_grad:
                        device = chunk.grads.target_device or seg.local.device  # where reduced gradients would land
                        seg.param.grad = chunk.wrap(seg.slot, torch.zeros_like(seg.local, device=device))
            chunk.grads.discard()

    def close(self) -> None:
        self._waiter.close()
