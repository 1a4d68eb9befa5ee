"""Gradient reduction: each chunk reduced once per backward, in one order on every rank.

See [Note: gradient reduction order] in ``zero_core._engine``. :class:`GradientReducer` owns the
bookkeeping of that order (which gradients each chunk waits for, which chunks are ready, which
are reduced) and the thread that completes reductions; the engine tells it when a forward
built a graph, when a backward begins and ends, and releases each chunk it launches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from zero_core._accounting import engine_work
from zero_core._collectives import reduce_gradients
from zero_core._waiter import ReductionWaiter
from zero_core.chunk import Chunk
from zero_core.comm import CommBackend
from zero_core.errors import GradientLostError

__all__ = ["GradientReducer"]


class GradientReducer:
    """Reduce-scatters (and HSDP all-reduces) chunks as their gradients become ready; publishes the results."""

    def __init__(self, chunks: Sequence[Chunk], *, reduce_comm: CommBackend, mesh_comms: Sequence[CommBackend],
                 agree: bool) -> None:
        self._chunks = tuple(chunks)
        self._comm = reduce_comm
        self._mesh_comms = tuple(mesh_comms)
        # Whether ranks agree on which parameters got a gradient anywhere (off with static_graph=True).
        self._agree = agree
        # Unsharded parameter (by id) -> its chunk, its slot, its (first) name: what a gradient hook is given.
        self._chunk_of = {id(s.param): c for c in chunks for s in c.slots}
        self._slot_of = {id(s.param): i for c in chunks for i, s in enumerate(c.slots)}
        self._name_of = {id(s.param): s.name for c in chunks for s in c.slots}
        self._waiter = ReductionWaiter()
        # False inside ZeroModule.no_sync(): backwards accumulate full gradients without reducing them.
        self.sync = True
        # Chunks reduced in this order on every rank; recomputed when a step's first forward begins, since
        # parameters may be frozen or unfrozen between steps.
        self.order: list[Chunk] = [c for c in reversed(self._chunks) if c.requires_grad]
        # Parameters a gradient may reach from the graphs the forwards since the last backward built, per chunk
        # index; the last backward's are kept, for a second backward through a retained graph.
        self._expected: dict[int, set[int]] = {}
        self._last_expected: dict[int, set[int]] = {}
        # Of those, the ones the running backward still waits for; which chunks are ready, reduced, next.
        self._waiting: dict[int, set[int]] = {}
        self._ready: dict[int, bool] = {}
        self.reduced: set[int] = set()
        self._next = 0

    # -- between steps and in forward ------------------------------------------------------------------
    @property
    def has_unreduced(self) -> bool:
        """Gradients accumulated inside ``no_sync()`` and not reduced yet."""
        return any(chunk.grads.unreduced for chunk in self.order)

    def reorder(self) -> None:
        """A step's first forward begins (no ``no_sync()`` accumulation open): take the trainable chunks anew."""
        if not any(chunk.grads.unreduced for chunk in self._chunks):
            self.order = [c for c in reversed(self._chunks) if c.requires_grad]

    def expect(self, reachable: set[int]) -> None:
        """A forward built a graph that reaches the parameters (ids) in ``reachable``."""
        for chunk in self.order:
            ids = {id(s.param) for s in chunk.slots if id(s.param) in reachable}
            self._expected.setdefault(chunk.index, set()).update(ids)

    def forget_graphs(self) -> None:
        """After a step: graphs built before it cannot be backwarded after it."""
        self._expected, self._last_expected = {}, {}

    # -- backward --------------------------------------------------------------------------------------
    def begin(self, *, forwards: int) -> None:
        """A backward begins after ``forwards`` forwards that built a graph (0: through a kept graph)."""
        # a backward with no forward since the last one runs through a kept graph: it reaches what that one did
        expected = self._expected if forwards else self._last_expected
        self._last_expected, self._expected = expected, {}
        self._waiting = {index: set(ids) for index, ids in expected.items()}
        self._ready = {c.index: not self._waiting.get(c.index) for c in self.order}
        self.reduced = set()
        self._next = 0

    def accumulated(self, param: torch.Tensor) -> None:
        """Autograd accumulated ``param``'s gradient (an unsharded parameter)."""
        chunk = self._chunk_of[id(param)]
        if chunk.index in self.reduced:
            raise GradientLostError(
                f"parameter {self._name_of[id(param)]!r} received a gradient after its chunk {chunk.index} was already "
                "reduce-scattered in this backward, so the gradient would be lost. This happens with reentrant "
                "activation checkpointing (use torch.utils.checkpoint(..., use_reentrant=False)) or when a "
                "parameter's gradient does not flow through the wrapped model's outputs."
            )
        self._adopt(chunk, self._slot_of[id(param)])
        waiting = self._waiting.get(chunk.index)
        if waiting is not None:
            waiting.discard(id(param))
            if not waiting:
                self._ready[chunk.index] = True

    @engine_work
    def _adopt(self, chunk: Chunk, slot: int) -> None:
        chunk.grads.adopt(slot)  # see [Note: gradient buffers on arrival]

    def launch_ready(self, loss_scale: float) -> Iterator[Chunk]:
        """Launch the reduction of every chunk that is next in the order and ready; yields each once launched."""
        while self._next < len(self.order):
            chunk = self.order[self._next]
            if not self._ready.get(chunk.index):
                return
            self._launch(chunk, loss_scale)
            yield chunk

    def launch_rest(self, loss_scale: float) -> Iterator[Chunk]:
        """The backward ended: launch every chunk not reduced yet, in order (zeros for gradients that never came)."""
        while self._next < len(self.order):
            chunk = self.order[self._next]
            self._launch(chunk, loss_scale)
            yield chunk

    @engine_work
    def _launch(self, chunk: Chunk, loss_scale: float) -> None:
        with torch.profiler.record_function("ZeRO::reduce_scatter"):
            self._waiter.submit(reduce_gradients(chunk, self._comm, loss_scale=loss_scale))
        self.reduced.add(chunk.index)
        self._next += 1

    def complete(self) -> None:
        """Every reduce group launches what a bucketing backend still holds (on every rank, in one order), and
        every launched reduction completes; re-raises the first failure."""
        self._comm.flush()
        for comm in self._mesh_comms:
            comm.flush()
        self._waiter.join()

    def publish(self) -> None:
        """Give each optimizer segment its gradient if its parameter got one on any rank."""
        flags = [f for chunk in self.order for f in chunk.grads.got]
        if self._comm.world_size > 1 and self._agree:
            agreed = self._comm.agree_any(torch.tensor(flags, dtype=torch.uint8)).tolist()
            flags = [bool(f) for f in agreed]
        offset = 0
        for chunk in self.order:
            chunk.grads.publish(flags[offset : offset + len(chunk.slots)])
            offset += len(chunk.slots)

    def end(self) -> None:
        """The backward is over (finished or undone): nothing waits any more."""
        self._waiting, self._ready = {}, {}

    def discard_unreduced(self, *, set_to_none: bool = True) -> None:
        """``zero_grad()``: gradients a ``no_sync()`` window accumulated and never reduced are dropped, as in DDP.

        With ``set_to_none=False``, a parameter the window gave a gradient on this rank keeps a
        zero gradient, as its ``.grad`` would in one process (momentum then still acts on it)."""
        for chunk in self._chunks:
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
