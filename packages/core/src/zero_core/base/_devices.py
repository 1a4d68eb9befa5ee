"""Tensors across devices: grouping by device, and host<->device copies that convert on the device.

[Note: copies between host and device]
torch's ``copy_`` between the host and a CUDA device converts the dtype on the host: the
source is first converted into a fresh pageable host tensor, and a pageable copy runs at a
fraction of a pinned one's speed (on an H200, 8-16 GB/s against 55). The offload path
copies every offloaded gradient down and every master shard up once per step, so both
helpers here move the bytes in the source's dtype, between pinned host memory and the
device, and convert on the device. With CUDA streams the bytes travel on the copy stream
(:func:`copy_on_copy_stream`, see [Note: streams of the data plane] in ``zero_core.base._streams``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from zero_core.base._streams import NO_STREAMS, Streams

__all__ = ["by_device", "copy_on_copy_stream", "to_compute_device", "to_host"]


def by_device(tensors: Iterable[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return groups


def copy_on_copy_stream(dst: torch.Tensor, src: torch.Tensor, streams: Streams) -> None:
    """``dst.copy_(src)`` on the copy stream, after the compute stream's work so far (which wrote ``src`` and
    allocated ``dst``); then its reader waits the copy's event: the host when ``dst`` is in host memory (it reads it
    next), the compute stream otherwise. Without streams, a plain copy."""
    copy = streams.copy
    streams.wait(copy, streams.record(streams.compute))
    streams.read(src, copy)
    streams.wrote(dst, copy)
    with streams.on(copy):
        dst.copy_(src, non_blocking=streams.active)
    reader = streams.host if dst.device.type == "cpu" else streams.compute
    streams.wait(reader, streams.record(copy))
    streams.read(dst, reader)


def to_compute_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype, *,
                      streams: Streams = NO_STREAMS) -> torch.Tensor:
    """``tensor`` (a master shard, on any device) on ``device`` in ``dtype``: an asynchronous copy in the
    source's dtype, converted there. See [Note: copies between host and device]."""
    if tensor.device.type == "cpu" and device.type == "cuda":
        if streams.active:  # allocated on the compute stream, which consumes it, filled on the copy stream
            staged = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            copy_on_copy_stream(staged, tensor, streams)
            return staged.to(dtype)
        return tensor.to(device, non_blocking=True).to(dtype)
    return tensor.to(device, dtype, non_blocking=True)


def to_host(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype, *,
            streams: Streams = NO_STREAMS) -> torch.Tensor:
    """``tensor`` on ``device`` in ``dtype``; from CUDA to the host, converted there first and copied into
    pinned memory, synchronously (the host reads it next). See [Note: copies between host and device]."""
    if tensor.dtype is dtype and tensor.device == device:  # what ``to`` returns too, without its dispatch (per chunk)
        return tensor
    if tensor.device.type == "cuda" and device.type == "cpu":
        out = torch.empty(tensor.shape, dtype=dtype, pin_memory=True)
        copy_on_copy_stream(out, tensor.to(dtype), streams)  # without streams: a synchronous copy, as before
        return out
    return tensor.to(device, dtype)
