"""Whole values of sharded tensors, read the same way on CPU and on CUDA ranks that share a GPU.

[Note: DTensor all-gathers over gloo on CUDA]
With several ranks on one GPU the harness runs gloo on CUDA tensors (see [Note: the device
under test]). There, torch 2.11's ``DTensor.full_tensor()`` killed the rank processes with
SIGSEGV on an H200, in plain torch too (``distribute_tensor`` then ``full_tensor`` over a
2-rank CUDA mesh), while the collectives zero issues itself, and torch's
``clip_grad_norm_`` over DTensors, returned the right values. So tests read whole values
through :func:`full_value`: ``full_tensor()`` wherever it works, and on gloo with CUDA
tensors the local shards gathered through the CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["full_value"]


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s whole value as a plain CPU tensor (a copy). For a DTensor this is a collective over its mesh:
    every rank calls it, in the same order."""
    if not isinstance(tensor, DTensor):
        return tensor.detach().cpu().clone()
    local = tensor.to_local().detach()
    mesh = tensor.device_mesh
    if local.device.type != "cuda" or dist.get_backend(mesh.get_group(0)) != "gloo":
        return tensor.full_tensor().detach().cpu().clone()
    sharded = [(d, p) for d, p in enumerate(tensor.placements) if not isinstance(p, Replicate)]
    if not sharded:
        return local.cpu().clone()
    mesh_dim, placement = sharded[0]
    if len(sharded) > 1 and all(isinstance(p, Shard) for _, p in sharded):
        # a grid of pieces (see [Note: two-dimension cut] in zero_core.chunks._slots): each rank's piece and where
        # it starts, gathered over the whole mesh (the default group's ranks) and put in place
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, tensor.placements)
        found: list[tuple[tuple[int, ...], torch.Tensor] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(found, (tuple(offset), local.cpu()))
        whole = torch.zeros(tensor.shape, dtype=local.dtype)
        for start, piece in (f for f in found if f is not None):
            whole[tuple(slice(a, a + n) for a, n in zip(start, piece.shape))] = piece
        return whole
    if len(sharded) > 1 or not isinstance(placement, Shard):
        raise NotImplementedError(f"full_value over gloo on CUDA reads one Shard placement, got {tensor.placements}")
    group = mesh.get_group(mesh_dim)
    pieces: list[torch.Tensor | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, local.cpu(), group=group)
    return torch.cat([p for p in pieces if p is not None], dim=placement.dim)
