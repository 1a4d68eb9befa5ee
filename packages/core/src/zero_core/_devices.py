"""Grouping tensors by device, for work that runs once per device (shards may be offloaded)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["by_device"]


def by_device(tensors: Iterable[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return groups
