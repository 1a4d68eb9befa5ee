"""Inspection: what the engine holds (bytes, exactly) and the full parameters on demand.

Free functions over the chunks (and the optimizer that steps their segments): they read, and
only :func:`iter_full_chunks` communicates.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from zero_core.base._accounting import engine_work_context as _engine_work
from zero_core.base._trace import STATE_DICT_GATHER, traced
from zero_core.chunks._collectives import gather_master
from zero_core.chunks.chunk import Chunk, to_local
from zero_core.comm.backend import CommBackend
from zero_core.interfaces.placement import PlacementPolicy

__all__ = ["device_bytes", "full_parameters", "iter_full_chunks", "memory_by_kind", "model_state_bytes"]


def device_bytes(chunks: Sequence[Chunk], comms: Sequence[CommBackend] = ()) -> int:
    """Bytes the engine holds on the device now: gathered or kept full buffers, gradient buffers, idle pooled buffers,
    and the buffers its comm backends ``comms`` hold (:attr:`~zero_core.comm.backend.CommBackend.buffer_bytes`).

    Exact, from storage sizes. Master shards, their gradients and optimizer states are not
    counted here: where they live is the placement policy's to account.
    """
    pool = chunks[0].pool if chunks else None
    # pooled buffers: idle, or lent to a backward or a reduction in flight (gradient buffers, receive buffers)
    total = pool.nbytes + pool.lent if pool is not None else 0
    total += sum(comm.buffer_bytes for comm in comms)
    for chunk in chunks:
        if not chunk.shard_is_view:
            total += chunk.full.untyped_storage().nbytes()
        else:  # the kept buffer holds the shard: the shard's part is the policy's
            total += chunk.full_bytes - chunk.shard_bytes
        if chunk.grads.kept is not None:
            total += chunk.grads.kept.untyped_storage().nbytes()
    return total

def model_state_bytes(chunks: Sequence[Chunk],
                      optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> dict[str, int]:
    """Bytes of model states this rank holds now, by kind (exact, from tensor storages).

    ``params`` counts master shards and the full buffers stages 1 and 2 keep, each
    storage once (in one dtype the kept buffer holds the shard). ``grads`` counts each
    gradient storage once: the segments' gradients (views of one shard-sized buffer
    per chunk) and the full-size buffer stage 1 keeps. ``optimizer_scalars`` counts
    zero-dimensional optimizer states (step counters) separately, because the ZeRO
    formulas leave them out. ``gathered_buffers`` is stage 3's full buffers gathered
    right now; ``gradient_workspace`` the idle full-size gradient buffers kept for reuse.
    """
    report = {"params": 0, "grads": 0, "optimizer_states": 0, "optimizer_scalars": 0, "gathered_buffers": 0,
              "gradient_workspace": chunks[0].pool.nbytes if chunks else 0}
    param_storages: dict[int, int] = {}
    grad_storages: dict[int, int] = {}

    def add(storages: dict[int, int], tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    for chunk in chunks:
        if chunk._shard is not None:  # else the kept full buffer holds the master values
            add(param_storages, chunk._shard)
        if chunk.group_shard is not None:  # holds the master shard too in one dtype: one storage, counted once
            add(param_storages, chunk.group_shard)
        if chunk.persistent:
            add(param_storages, chunk.full)
        elif chunk.is_gathered:
            report["gathered_buffers"] += chunk.full_bytes
        if chunk.grads.kept is not None:
            add(grad_storages, chunk.grads.kept)
        for seg in chunk.segments:
            if seg.param.grad is not None:
                add(grad_storages, to_local(seg.param.grad))
            for value in _state_of(optimizer, seg.param).values():
                if isinstance(value, torch.Tensor):
                    per_element = isinstance(value, DTensor) or value.dim() > 0
                    value = to_local(value)
                    key = "optimizer_states" if per_element else "optimizer_scalars"
                    report[key] += value.numel() * value.element_size()
    report["params"] = sum(param_storages.values())
    report["grads"] = sum(grad_storages.values())
    return report

def memory_by_kind(chunks: Sequence[Chunk],
                   optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> dict[str, int]:
    """Every byte the engine holds now, by what it is for (exact, each storage once, any tier).

    ``params``, ``grads`` and ``optimizer_states`` are the model states the ZeRO formulas count
    (as :meth:`model_state_bytes`, with gradients reduced in this backward but not yet handed to the
    optimizer counted as ``grads``); the rest are the engine's working buffers: ``gathered``
    (stage 3's full buffers gathered now), ``gradient_buffers`` (full-size gradient and send
    buffers lent to a backward or a reduction in flight), ``pool`` (idle buffers kept for reuse),
    ``kept_copies`` (the parts a forward kept for ``reshard_after_forward=k``). Safe to call from
    another thread (a memory sampler): it only reads.
    """
    params: dict[int, int] = {}
    grads: dict[int, int] = {}
    states = 0
    gathered = copies = 0

    def add(storages: dict[int, int], tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    for chunk in list(chunks):
        shard = chunk._shard
        if shard is not None and shard.stride(0) != 0:  # an absent (disk) shard holds nothing
            add(params, shard)
        if chunk.persistent:
            add(params, chunk.full)
        elif chunk.is_gathered:
            gathered += chunk.full.untyped_storage().nbytes()
        if chunk.grads.kept is not None:
            add(grads, chunk.grads.kept)
        copy = chunk.post_forward_copy
        if copy is not None:
            copies += copy.untyped_storage().nbytes()
        for piece in chunk.grads.reduced or ():
            add(grads, piece)
        for seg in chunk.segments:
            grad = seg.param.grad
            if grad is not None:
                add(grads, to_local(grad))
            for value in list(_state_of(optimizer, seg.param).values()):
                if isinstance(value, torch.Tensor) and (isinstance(value, DTensor) or value.dim() > 0):
                    value = to_local(value)
                    if value.stride() and value.stride(0) == 0:
                        continue
                    states += value.numel() * value.element_size()
    pool = chunks[0].pool if chunks else None
    return {"params": sum(params.values()), "grads": sum(grads.values()), "optimizer_states": states,
            "gathered": gathered, "gradient_buffers": pool.lent if pool is not None else 0,
            "pool": pool.nbytes if pool is not None else 0, "kept_copies": copies}

@torch.no_grad()
def iter_full_chunks(chunks: Sequence[Chunk], *, placement: PlacementPolicy,
                     comm: CommBackend) -> Iterator[tuple[Chunk, torch.Tensor]]:
    """Each chunk with its whole master values (a device tensor), one chunk at a time.

    Collective: every rank iterates to the end. The tensor is only valid until the next
    item; no rank holds more than one gathered chunk beyond its shards. The engine must be
    idle (``Engine.settle``).
    """
    for chunk in chunks:
        with _engine_work():
            placement.before_gather([chunk])  # a shard on disk comes back to be read
            if chunk.shard_is_view:
                full = chunk.full
            else:
                full = gather_master(chunk, comm)
        try:
            yield chunk, full
        finally:
            del full
            with _engine_work():
                placement.after_release([chunk])

@torch.no_grad()
@traced(STATE_DICT_GATHER)
def full_parameters(chunks: Sequence[Chunk], *, placement: PlacementPolicy, comm: CommBackend) -> dict[str, torch.Tensor]:
    """Every parameter, whole, as CPU copies of the master values, one chunk at a time.

    Collective: call on every rank. With 16-bit compute these are the fp32 masters
    the optimizer updates, not the 16-bit copies forward uses.
    """
    result: dict[str, torch.Tensor] = {}
    for chunk, full in iter_full_chunks(chunks, placement=placement, comm=comm):
        for slot in chunk.slots:
            result[slot.name] = full[slot.offset : slot.offset + slot.numel].view(slot.shape).to("cpu", copy=True)
    return result


def _state_of(optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], param: torch.Tensor) -> dict[Any, Any]:
    """``param``'s optimizer state, in whichever of the optimizers holds it (one at most: see [Note: several
    optimizers] in ``zero_core._shard``)."""
    if isinstance(optimizers, torch.optim.Optimizer):
        return optimizers.state.get(param, {})
    return next((state for o in optimizers if (state := o.state.get(param)) is not None), {})
