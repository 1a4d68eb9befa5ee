"""The records that describe a chunk's layout: parameters as planned, where each sits, what the optimizer sees.

See [Note: chunk layout] in ``zero_core.chunk``. Plain data and pure functions, below the
chunk itself, so strategies can plan without the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ChunkSpec", "ParamInfo", "ParamSlot", "Segment", "layout_slots", "padded_shard_size", "rewrap", "to_local"]


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """A parameter as the strategy sees it when planning.

    Attributes:
        name: Fully qualified name (the first one, for parameters shared under several names).
        param: The parameter itself.
        param_group: Index of the optimizer param group that holds it, or ``None``.
    """

    name: str
    param: nn.Parameter
    param_group: int | None

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def key(self) -> tuple[object, ...]:
        """Parameters may share a chunk only if these agree."""
        return (self.param.dtype, self.param.requires_grad, self.param_group)


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """One chunk in a strategy's plan: which parameters, in order, and its padded size."""

    params: tuple[ParamInfo, ...]
    size: int

    @property
    def used(self) -> int:
        return sum(p.numel for p in self.params)


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Where one parameter lives inside its chunk. See [Note: chunk layout].

    Attributes:
        name: The parameter's (first) fully qualified name.
        param: The unsharded parameter (the original object; a view of the full buffer while gathered).
        offset: Where the parameter starts in the full buffer (``world_size * shard_offset``).
        numel: Its number of elements.
        shape: Its shape.
        shard_offset: Where its piece starts in every rank's shard.
        piece: Elements of one rank's piece, padding included (``rows * row``).
        rows: Rows of dim 0 one piece holds (``ceil(d0 / world_size)``).
        row: Elements per dim-0 row.
    """

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    shard_offset: int = 0
    piece: int = 0
    rows: int = 0
    row: int = 1

    @property
    def replicated(self) -> bool:
        """A zero-dimensional parameter: every rank holds it whole."""
        return len(self.shape) == 0

    def local_rows(self, rank: int) -> int:
        """Rows of dim 0 that ``rank`` owns (``torch.chunk``'s rule)."""
        if self.replicated:
            return 1
        return max(0, min(self.rows, self.shape[0] - rank * self.rows))

    def local_shape(self, rank: int) -> torch.Size:
        if self.replicated:
            return torch.Size(())
        return torch.Size((self.local_rows(rank), *self.shape[1:]))

    def own_range(self, rank: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of the flattened parameter in ``rank``'s piece (a replicated one: rank 0 owns it)."""
        if self.replicated:
            return (0, 1) if rank == 0 else (0, 0)
        lo = min(rank * self.rows, self.shape[0]) * self.row
        return lo, lo + self.local_rows(rank) * self.row

    def held_range(self, rank: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` ``rank`` holds: its own range, and a replicated parameter everywhere."""
        return (0, 1) if self.replicated else self.own_range(rank)


def layout_slots(params: Sequence[tuple[str, nn.Parameter]], world_size: int) -> tuple[tuple[ParamSlot, ...], int]:
    """The slots of these parameters in one chunk, and the elements their pieces take in a shard."""
    slots, offset = [], 0
    for name, param in params:
        shape = param.shape
        if len(shape) == 0:
            rows, row = 1, 1
        else:
            row = 1
            for d in shape[1:]:
                row *= d
            rows = -(-shape[0] // world_size)
        piece = rows * row
        slots.append(ParamSlot(name, param, world_size * offset, param.numel(), shape, offset, piece, rows, row))
        offset += piece
    return tuple(slots), offset


def padded_shard_size(params: Sequence[tuple[str, nn.Parameter]] | Sequence[torch.Size], world_size: int, size: int) -> int:
    """A chunk's shard size: the plan's ``size / world_size``, or more when the per-parameter padding needs it."""
    total = 0
    for item in params:
        shape = item if isinstance(item, torch.Size) else item[1].shape
        if len(shape) == 0:
            total += 1
            continue
        row = 1
        for d in shape[1:]:
            row *= d
        total += -(-shape[0] // world_size) * row
    if len(params) == 1:  # one parameter: its piece is the shard (see Chunk.__init__)
        return total
    return max(size // world_size, total)


@dataclass(frozen=True, slots=True)
class Segment:
    """One parameter as the optimizer sees it on this rank. See [Note: optimizer segments].

    Attributes:
        slot: Index of the parameter in the chunk's slots.
        begin: Offset of its piece inside the shard.
        param: The sharded parameter: what the model holds between steps and the optimizer updates.
    """

    slot: int
    begin: int
    param: nn.Parameter

    @property
    def local(self) -> torch.Tensor:
        """This rank's piece of the parameter (a plain tensor: the DTensor's local tensor)."""
        return to_local(self.param)

    @property
    def numel(self) -> int:
        """Elements of this rank's piece."""
        return to_local(self.param).numel()


def to_local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor; any other tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor  # type: ignore[attr-defined]


def rewrap(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` in ``like``'s form: a DTensor with ``like``'s sharding when ``like`` is one, else ``local`` itself.

    For code that moves an optimizer state's local values (placement policies): the state
    must stay a DTensor like its parameter."""
    if isinstance(like, DTensor):
        return DTensor(local, like._spec, requires_grad=False)  # type: ignore[attr-defined]
    return local
