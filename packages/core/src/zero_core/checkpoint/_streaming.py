"""Full weights streamed out of the shards in buckets: a weight sync to an inference engine with a bounded peak.

[Note: streaming full weights]
RL and evaluation loops pull the whole model out of a sharded trainer every few steps.
Gathering everything at once (``gathered_parameters()``) holds the model whole on every rank;
:func:`stream_full_parameters` holds at most one *bucket* of finished tensors and one gathered
chunk at a time. Chunks are gathered one after another, as every rank's shard side by side
(rank-major: no second, parameter-major copy of the chunk); each parameter is cut out of its
column of that buffer, converted to the requested dtype where the chunk is, and moved to the
requested device, into the current bucket. A bucket is handed out when the next parameter
would take it past ``bucket_bytes`` (a parameter larger than that travels alone). At its
worst moment a rank holds: the bucket the caller still holds, the one being built, one chunk's
gathered shards, and one parameter's conversion. The tensors handed out are
fresh: the caller may keep them, and what it drops is freed before the next bucket is built,
because the generator holds no reference to a bucket it has handed out.

Every rank iterates to the end, since each chunk is gathered collectively. With ``rank=r``
only rank r builds the copies; the other ranks get empty buckets, as many as rank r gets, so
one loop body serves every rank. A tied parameter comes once, under its first name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from zero_core.base._accounting import engine_work_context as engine_work
from zero_core.base.errors import ConfigError
from zero_core.chunks._collectives import gather_master_shards
from zero_core.chunks._slots import ParamSlot

if TYPE_CHECKING:
    from zero_core.runtime._engine import Engine

__all__ = ["stream_full_parameters"]

Bucket = list[tuple[str, torch.Tensor]]


def _destination(device: str | torch.device, compute: torch.device) -> torch.device:
    if isinstance(device, str) and device == "device":
        return compute
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"stream_full_parameters(device=...) takes 'cpu', 'device' (the compute device) or a "
                          f"torch.device, got {device!r}") from err


def stream_full_parameters(engine: Engine, *, bucket_bytes: int, dtype: torch.dtype | None = None,
                           device: str | torch.device = "cpu", rank: int | None = None) -> Iterator[Bucket]:
    """Buckets of ``(name, full tensor)``; see [Note: streaming full weights]. Collective: every rank iterates to
    the end. ``dtype``: ``None`` keeps each parameter's master dtype. Arguments are checked, and the engine
    settled, at the call; the gathers run as the buckets are asked for."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ConfigError(f"the bucket size must be a positive number of bytes, got {bucket_bytes!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(f"stream_full_parameters(dtype=...) must be a floating torch.dtype or None, got {dtype!r}")
    comm = engine.comm
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < comm.world_size):
        raise ConfigError(f"stream_full_parameters(rank=...) must be None (every rank) or a rank in "
                          f"[0, {comm.world_size}), got {rank!r}")
    target = _destination(device, engine.device)
    engine.settle("streaming the full parameters", collective=True)
    return _buckets(engine, bucket_bytes, dtype, target, keep=rank is None or rank == comm.rank)


def _whole(slot: ParamSlot, column: torch.Tensor, dtype: torch.dtype, target: torch.device) -> torch.Tensor:
    """Parameter ``slot`` whole, from its ``(world_size, piece)`` column of the ranks' shards (each rank's rows in
    rank order, padded at the end), in ``dtype`` on ``target``: one fresh tensor of its own."""
    block = torch.empty(column.shape, dtype=dtype, device=column.device)
    block.copy_(column)  # converted where the shards are (see [Note: copies between host and device])
    value = slot.whole(block)  # a copy for a strided piece (see [Note: shard dimension] in zero_core.chunks._slots)
    if block.numel() != slot.numel:
        value = value.clone()  # the padding's storage stays behind
    return value.to(target)


@torch.no_grad()
def _buckets(engine: Engine, bucket_bytes: int, dtype: torch.dtype | None, target: torch.device, *,
             keep: bool) -> Iterator[Bucket]:
    bucket: Bucket = []
    held = 0
    for chunk in engine.chunks:
        wanted = dtype or chunk.master_dtype
        with engine_work():
            engine.placement.before_gather([chunk])  # a shard on disk comes back to be read
            # a kept full buffer holds the master values already (same dtype); else every rank's shard, side by side
            shards = chunk.full if chunk.shard_is_view else gather_master_shards(chunk, engine.comm)
        try:
            for slot in chunk.slots:
                nbytes = slot.numel * wanted.itemsize
                if bucket_bytes < held + nbytes and held:  # the same decision on every rank: the sizes are the same
                    out, bucket, held = bucket, [], 0
                    yield out
                    del out  # hold nothing handed out: the caller's references are the only ones
                held += nbytes
                if not keep:
                    continue
                if chunk.shard_is_view:
                    value = shards[slot.offset: slot.offset + slot.numel].view(slot.shape)
                    converted = value.to(wanted)  # a fresh tensor when the dtype changes
                    bucket.append((slot.name, converted.to(target, copy=converted is value)))
                    del value, converted
                else:
                    column = shards[:, slot.shard_offset: slot.shard_offset + slot.piece]
                    bucket.append((slot.name, _whole(slot, column, wanted, target)))
                    del column
        finally:
            del shards  # before the next chunk is gathered: one chunk's shards at a time
            with engine_work():
                engine.placement.after_release([chunk])
    if held:
        yield bucket
