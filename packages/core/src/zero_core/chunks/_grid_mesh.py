"""The device meshes of parameters cut in two dimensions. See [Note: two-dimension cut] in ``zero_core.chunks._slots``.

A chunk's mesh has the shard group as its last dimension (``W`` ranks); a parameter cut into an
``(a, b)`` grid of pieces is a DTensor on that mesh with the last dimension unflattened to
``(a, b)``. torch's ``DeviceMesh._unflatten`` needs named dimensions, which a user's mesh may not
have, so the grid mesh is made with :meth:`DeviceMesh.from_group` over groups of its own: one per
row and per column of the grid (every rank creates every group, in the same order), with zero's
collective timeout, as for the chunk's own mesh (see [Note: torch's collectives on a group of
their own] in ``zero_core._shard``). The leading dimensions (HSDP's replicas) reuse the chunk
mesh's groups. One grid mesh per chunk mesh and ``b`` is made, once, and shared by every chunk.
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Any

import torch

__all__ = ["grid_mesh"]

# By the chunk mesh's id: (a weak reference to it, {(b, timeout): its grid mesh}).
_GRIDS: dict[int, tuple[weakref.ref[Any], dict[tuple[int, timedelta | None], Any]]] = {}


def grid_mesh(mesh: Any, split: int, timeout: timedelta | None = None) -> Any:
    """``mesh`` with its last dimension (``W`` ranks) unflattened to ``(W // split, split)``. Collective the first
    time: every rank of ``mesh`` must ask for the same grids in the same order."""
    found = _GRIDS.get(id(mesh))
    if found is None or found[0]() is not mesh:
        found = _GRIDS[id(mesh)] = (weakref.ref(mesh), {})
    key = (split, timeout)
    if key not in found[1]:
        found[1][key] = _make(mesh, split, timeout)
    return found[1][key]


def _make(mesh: Any, split: int, timeout: timedelta | None) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    world = mesh.size(mesh.ndim - 1)
    ranks = mesh.mesh.reshape(*mesh.mesh.shape[:-1], world // split, split)
    me = dist.get_rank()
    backend = dist.get_backend(mesh.get_group(mesh.ndim - 1))
    groups = [mesh.get_group(d) for d in range(mesh.ndim - 1)]
    for d in (ranks.dim() - 2, ranks.dim() - 1):
        lines = ranks.movedim(d, -1).reshape(-1, ranks.shape[d]).tolist()
        mine = None
        for line in lines:  # every rank creates every group (torch's new_group contract), keeps its own
            group = dist.new_group(line, backend=backend, timeout=timeout)
            if me in line:
                mine = group
        groups.append(mine)
    names = tuple(mesh.mesh_dim_names or (f"zero_replicate{d}" for d in range(mesh.ndim - 1)))[: mesh.ndim - 1]
    grid = DeviceMesh.from_group(groups, mesh.device_type, mesh=torch.as_tensor(ranks),
                                 mesh_dim_names=(*names, "zero_grid_rows", "zero_grid_cols"))
    # the grid's two dimensions flattened, which DTensor then reduces a norm over in one collective, not two
    if hasattr(grid, "_flatten"):  # a private method (torch 2.13 has it): without it, two reductions
        grid["zero_grid_rows", "zero_grid_cols"]._flatten("zero_grid")
    return grid
