"""Tensors across devices: grouping by device, and host<->device copies that convert on the device.

[Note: copies between host and device]
torch's ``copy_`` between the host and a CUDA device converts the dtype on the host: the
source is first converted into a fresh pageable host tensor, and a pageable copy runs at a
fraction of a pinned one's speed (on an H200, 8-16 GB/s against 55). The offload path
copies every offloaded gradient down and every master shard up once per step, so both
helpers here move the bytes in the source's dtype, between pinned host memory and the
device, and convert on the device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["by_device", "to_compute_device", "to_host"]


def by_device(tensors: Iterable[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return groups


def to_compute_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` (a master shard, on any device) on ``device`` in ``dtype``: an asynchronous copy in the
    source's dtype, converted there. See [Note: copies between host and device]."""
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.to(device, non_blocking=True).to(dtype)
    return tensor.to(device, dtype, non_blocking=True)


def to_host(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` on ``device`` in ``dtype``; from CUDA to the host, converted there first and copied into
    pinned memory, synchronously (the host reads it next). See [Note: copies between host and device]."""
    if tensor.device.type == "cuda" and device.type == "cpu":
        out = torch.empty(tensor.shape, dtype=dtype, pin_memory=True)
        out.copy_(tensor.to(dtype))
        return out
    return tensor.to(device, dtype)
