"""Whole parameters on demand: :meth:`zero_core.ZeroModule.gathered_parameters`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from zero_core.base._accounting import engine_work_context
from zero_core.checkpoint._state_keys import refresh_kept
from zero_core.interfaces._inspection import iter_full_chunks

if TYPE_CHECKING:
    from zero_core.runtime._engine import Engine

__all__ = ["gathered_parameters"]


@contextlib.contextmanager
def gathered_parameters(engine: Engine, *, writable: bool = False) -> Iterator[None]:
    """See :meth:`zero_core.ZeroModule.gathered_parameters`."""
    engine.settle("model.gathered_parameters()", collective=True)
    fulls = []
    engine.settle("reading the full parameters", collective=True)
    for chunk, full in iter_full_chunks(engine.chunks, placement=engine.placement, comm=engine.comm):
        fulls.append((chunk, full if not chunk.shard_is_view else full.clone()))
    with torch.no_grad():
        for chunk, full in fulls:
            for slot, seg in zip(chunk.slots, chunk.segments):
                slot.param.data = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
                slot.param.requires_grad_(seg.param.requires_grad)
    engine.params.use_unsharded(stand_ins=False)
    engine.params.full_copies = True
    try:
        yield
    finally:
        engine.params.full_copies = False
        engine.params.use_sharded()
        with torch.no_grad(), engine_work_context():
            for chunk, full in fulls:
                # the unsharded parameters go back to the chunk's own buffer (or to nothing, when released)
                if chunk.is_gathered:
                    chunk._to_gathered()
                else:
                    for slot in chunk.slots:
                        slot.param.data = chunk._empty
                if not writable:
                    continue
                engine.placement.before_load([chunk])  # a shard on disk comes back to take the writes
                try:
                    for i, slot in enumerate(chunk.slots):
                        chunk.fill(i, full[slot.offset : slot.offset + slot.numel])
                    refresh_kept(chunk, engine.comm)
                    engine.residency.mark_refreshed([chunk])
                finally:
                    engine.placement.after_load([chunk])
        fulls.clear()
