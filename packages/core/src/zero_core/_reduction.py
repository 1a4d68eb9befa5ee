"""Gradient reduction: each chunk reduced once per backward, in one order on every rank.

See [Note: gradient reduction order] in ``zero_core._engine``. Mixed into :class:`~zero_core.Engine`; this
file holds everything between a gradient's accumulation and the optimizer segments' ``.grad``.
"""

from __future__ import annotations

import torch

from zero_core._accounting import engine_work
from zero_core.chunk import Chunk
from zero_core.errors import GradientLostError

__all__ = ["GradientReduction"]


class GradientReduction:
    """Reduce-scatters (and HSDP all-reduces) chunks as their gradients become ready; publishes the results."""

    def _on_grad_accumulated(self, param: torch.Tensor) -> None:
        self._enter_backward()
        chunk = self._chunk_of[id(param)]
        if chunk.index in self._reduced:
            raise GradientLostError(
                f"parameter {self._name_of[id(param)]!r} received a gradient after its chunk {chunk.index} was already "
                "reduce-scattered in this backward, so the gradient would be lost. This happens with reentrant "
                "activation checkpointing (use torch.utils.checkpoint(..., use_reentrant=False)) or when a "
                "parameter's gradient does not flow through the wrapped model's outputs."
            )
        slot = self._slot_of[id(param)]
        chunk.got_grad[slot] = True
        self._adopt_gradient(chunk, slot)
        waiting = self._waiting.get(chunk.index)
        if waiting is not None:
            waiting.discard(id(param))
            if not waiting:
                self._ready[chunk.index] = True
        if self.sync_gradients:
            self._reduce_ready()

    @engine_work
    def _adopt_gradient(self, chunk: Chunk, slot: int) -> None:
        chunk.adopt_gradient(slot)  # see [Note: gradient buffers on arrival]

    def _flush_reductions(self) -> None:
        """Every reduce group launches what a bucketing backend still holds (on every rank, in one order)."""
        self.reduce_comm.flush()
        for comm in self._mesh_comms:
            comm.flush()

    def _reduce_ready(self) -> None:
        while self._next_reduce < len(self._reduce_order):
            chunk = self._reduce_order[self._next_reduce]
            if not self._ready.get(chunk.index):
                return
            self._reduce(chunk)

    @engine_work
    def _reduce(self, chunk: Chunk) -> None:
        with torch.profiler.record_function("ZeRO::reduce_scatter"):
            scale = self.scaler.scale if self.scaler is not None else 1.0
            self._waiter.submit(chunk.reduce_gradients(self.reduce_comm, loss_scale=scale))
        self._reduced.add(chunk.index)
        self._next_reduce += 1
        self._release([chunk])

    def _publish_gradients(self) -> None:
        """Give each optimizer segment its gradient if its parameter got one on any rank."""
        trainable = self._reduce_order
        flags = [f for chunk in trainable for f in chunk.got_grad]
        if self.reduce_comm.world_size > 1 and not self.config.static_graph:
            agreed = self.reduce_comm.agree_any(torch.tensor(flags, dtype=torch.uint8)).tolist()
            flags = [bool(f) for f in agreed]
        offset = 0
        for chunk in trainable:
            chunk.publish_gradients(flags[offset : offset + len(chunk.slots)])
            offset += len(chunk.slots)
