"""The records that describe a chunk's layout: parameters as planned, where each sits, what the optimizer sees.

See [Note: chunk layout] in ``zero_core.chunks.chunk``. Plain data and pure functions, below the
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


# A dim-0 cut that pads a parameter by more than this fraction of its elements is replaced by a cut along the first
# dimension the shard group divides evenly (see [Note: shard dimension]).
PADDING_TOLERANCE = 0.01


def shard_dim(shape: Sequence[int], world_size: int) -> int:
    """The dimension a parameter of ``shape`` is cut along over ``world_size`` ranks. See [Note: shard dimension].

    [Note: shard dimension]
    A parameter is cut along dim 0 (``Shard(0)``, as FSDP2 does by default) unless that pads it by more than
    ``PADDING_TOLERANCE`` of its elements: a fused MoE weight of 8 experts, ``(8, 28672, 4096)``, over 64 ranks
    would be one expert per rank on 8 ranks and 56 ranks of padding (8x). Such a parameter is cut along the first
    later dimension the ranks divide evenly instead (``Shard(1)`` here: 448 of the 28672 rows per rank, no padding),
    FSDP2's ``shard_placement_fn`` advice, made automatic. A rank's piece is then ``lead = prod(shape[:dim])``
    runs of the flattened parameter, stored contiguously in the shard (the sharded parameter's local tensor is
    contiguous, the DTensor's ``Shard(dim)`` piece), and the full buffer keeps the parameter contiguous in its
    own shape: the copy-out and copy-in move each rank's piece as a ``(lead, run)`` block. When no later dimension
    divides evenly the cut stays on dim 0, padded. Every reader of a slot (checkpoints, state dicts, streamed
    loading, the estimator) goes through :class:`ParamSlot`'s methods, so the choice is made once, here.
    """
    if len(shape) < 2 or world_size == 1:
        return 0
    numel = 1
    for d in shape:
        numel *= d
    pad_rows = -(-shape[0] // world_size) * world_size - shape[0]
    if numel == 0 or pad_rows * (numel // shape[0]) <= PADDING_TOLERANCE * numel:
        return 0
    for d in range(1, len(shape)):
        if shape[d] % world_size == 0:
            return d
    return 0


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Where one parameter lives inside its chunk. See [Note: chunk layout] and [Note: shard dimension].

    Attributes:
        name: The parameter's (first) fully qualified name.
        param: The unsharded parameter (the original object; a view of the full buffer while gathered).
        offset: Where the parameter starts in the full buffer (``world_size * shard_offset``).
        numel: Its number of elements.
        shape: Its shape.
        shard_offset: Where its piece starts in every rank's shard.
        piece: Elements of one rank's piece, padding included (``lead * rows * row``).
        rows: Entries of the cut dimension one piece holds (``ceil(shape[dim] / world_size)``).
        row: Elements per entry of the cut dimension (the product of the later dimensions).
        dim: The dimension the parameter is cut along (``Shard(dim)``).
        lead: The product of the dimensions before ``dim``: how many runs one rank's piece is in the parameter.
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
    dim: int = 0
    lead: int = 1

    @property
    def replicated(self) -> bool:
        """A zero-dimensional parameter: every rank holds it whole."""
        return len(self.shape) == 0

    @property
    def strided(self) -> bool:
        """Cut along a later dimension: a rank's piece is ``lead`` runs of the flattened parameter, not one range."""
        return self.lead > 1

    def local_rows(self, rank: int) -> int:
        """Entries of the cut dimension that ``rank`` owns (``torch.chunk``'s rule)."""
        if self.replicated:
            return 1
        return max(0, min(self.rows, self.shape[self.dim] - rank * self.rows))

    def local_shape(self, rank: int) -> torch.Size:
        if self.replicated:
            return torch.Size(())
        shape = list(self.shape)
        shape[self.dim] = self.local_rows(rank)
        return torch.Size(shape)

    def local_numel(self, rank: int) -> int:
        """Elements of ``rank``'s piece without its padding."""
        return 1 if self.replicated else self.lead * self.local_rows(rank) * self.row

    def own_range(self, rank: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of the flattened parameter in ``rank``'s piece (a replicated one: rank 0 owns it).
        Only for a parameter cut along dim 0: a strided piece is several ranges (:meth:`runs`)."""
        if self.replicated:
            return (0, 1) if rank == 0 else (0, 0)
        assert not self.strided, f"{self.name} is cut along dim {self.dim}: read its pieces through runs()"
        lo = min(rank * self.rows, self.shape[self.dim]) * self.row
        return lo, lo + self.local_rows(rank) * self.row

    def held_range(self, rank: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` ``rank`` holds: its own range, and a replicated parameter everywhere."""
        return (0, 1) if self.replicated else self.own_range(rank)

    def runs(self, rank: int, *, held: bool = True) -> list[tuple[int, int, int]]:
        """``(lo, hi, at)`` for each range ``[lo, hi)`` of the flattened parameter in ``rank``'s piece, ``at`` being
        where it starts in the piece. A replicated parameter is held by every rank (``held``) or owned by rank 0."""
        if not self.strided:
            lo, hi = self.held_range(rank) if held else self.own_range(rank)
            return [(lo, hi, 0)] if lo < hi else []
        n = self.local_rows(rank) * self.row
        if n == 0:
            return []
        stride, start = self.shape[self.dim] * self.row, min(rank * self.rows, self.shape[self.dim]) * self.row
        return [(i * stride + start, i * stride + start + n, i * n) for i in range(self.lead)]

    def local_of(self, value: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s piece of a whole value of this parameter (any shape with its elements), in the local shape:
        a view (not contiguous when the piece is strided)."""
        if self.replicated:
            return value.reshape(())
        start = min(rank * self.rows, self.shape[self.dim])
        return value.reshape(self.shape).narrow(self.dim, start, self.local_rows(rank))

    def columns(self, region: torch.Tensor, world_size: int) -> torch.Tensor:
        """The parameter's region of a parameter-major buffer (``world_size * piece`` elements) as every rank's
        piece: ``(world_size, piece)``, or ``(world_size, lead, rows * row)`` for a strided one (a view)."""
        if not self.strided:
            return region.view(world_size, self.piece)
        return region.view(self.lead, world_size, self.rows * self.row).transpose(0, 1)

    def whole(self, columns: torch.Tensor) -> torch.Tensor:
        """The parameter's value from every rank's padded piece side by side (``(world_size, piece)``, rank order)."""
        if not self.strided:
            return columns.reshape(-1)[: self.numel].view(self.shape)
        world = columns.shape[0]
        return columns.reshape(world, self.lead, self.rows * self.row).transpose(0, 1).reshape(self.shape)

    def pieces_of(self, whole: torch.Tensor, world_size: int) -> torch.Tensor:
        """The inverse of :meth:`whole`: every rank's padded piece of a whole value, ``(world_size, piece)`` (a new
        tensor, zero padded)."""
        flat = whole.reshape(-1)
        if self.strided:
            return flat.view(self.lead, world_size, self.rows * self.row).transpose(0, 1).reshape(world_size, self.piece)
        out = flat.new_zeros(world_size * self.piece)
        out[: self.numel] = flat
        return out.view(world_size, self.piece)


def _cut(shape: Sequence[int], world_size: int) -> tuple[int, int, int, int]:
    """``(dim, lead, rows, row)`` of a parameter of ``shape`` cut over ``world_size`` ranks."""
    if len(shape) == 0:
        return 0, 1, 1, 1
    dim = shard_dim(shape, world_size)
    lead = row = 1
    for d in shape[:dim]:
        lead *= d
    for d in shape[dim + 1:]:
        row *= d
    return dim, lead, -(-shape[dim] // world_size), row


def layout_slots(params: Sequence[tuple[str, nn.Parameter]], world_size: int) -> tuple[tuple[ParamSlot, ...], int]:
    """The slots of these parameters in one chunk, and the elements their pieces take in a shard."""
    slots, offset = [], 0
    for name, param in params:
        dim, lead, rows, row = _cut(param.shape, world_size)
        piece = lead * rows * row
        slots.append(ParamSlot(name, param, world_size * offset, param.numel(), param.shape, offset, piece, rows, row,
                               dim, lead))
        offset += piece
    return tuple(slots), offset


def padded_shard_size(params: Sequence[tuple[str, nn.Parameter]] | Sequence[torch.Size], world_size: int, size: int) -> int:
    """A chunk's shard size: the plan's ``size / world_size``, or more when the per-parameter padding needs it."""
    total = 0
    for item in params:
        shape = item if isinstance(item, torch.Size) else item[1].shape
        _, lead, rows, row = _cut(shape, world_size)
        total += lead * rows * row
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
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def rewrap(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` in ``like``'s form: a DTensor with ``like``'s sharding when ``like`` is one, else ``local`` itself.

    For code that moves an optimizer state's local values (placement policies): the state
    must stay a DTensor like its parameter."""
    if isinstance(like, DTensor):
        return DTensor(local, like._spec, requires_grad=False)
    return local
