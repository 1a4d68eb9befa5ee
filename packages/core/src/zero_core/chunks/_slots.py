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

__all__ = ["ChunkSpec", "ParamInfo", "ParamSlot", "Segment", "layout_slots", "padded_shard_size", "rewrap", "shard_cut",
           "to_local"]


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
    """The (first) dimension a parameter of ``shape`` is cut along over ``world_size`` ranks. See [Note: shard
    dimension] and [Note: two-dimension cut]."""
    return shard_cut(shape, world_size)[0]


def _one_dim(shape: Sequence[int], world_size: int) -> tuple[int, bool]:
    """The dimension of the one-dimension cut (see [Note: shard dimension]) and whether it pads by more than
    ``PADDING_TOLERANCE``."""
    if len(shape) < 2 or world_size == 1:
        return 0, False
    numel = 1
    for d in shape:
        numel *= d
    pad_rows = -(-shape[0] // world_size) * world_size - shape[0]
    if numel == 0 or pad_rows * (numel // shape[0]) <= PADDING_TOLERANCE * numel:
        return 0, False
    for d in range(1, len(shape)):
        if shape[d] % world_size == 0:
            return d, False
    return 0, True


def shard_cut(shape: Sequence[int], world_size: int) -> tuple[int, int, int]:
    """``(dim, dim2, split)``: a parameter of ``shape`` over ``world_size`` ranks is cut along ``dim`` into
    ``world_size / split`` parts and, when ``split > 1``, each of those along ``dim2`` into ``split`` parts.

    [Note: shard dimension]
    A parameter is cut along dim 0 (``Shard(0)``, as FSDP2 does by default) unless that pads it by more than
    ``PADDING_TOLERANCE`` of its elements: a fused MoE weight of 8 experts, ``(8, 28672, 4096)``, over 64 ranks
    would be one expert per rank on 8 ranks and 56 ranks of padding (8x). Such a parameter is cut along the first
    later dimension the ranks divide evenly instead (``Shard(1)`` here: 448 of the 28672 rows per rank, no padding),
    FSDP2's ``shard_placement_fn`` advice, made automatic. A rank's piece is then ``lead = prod(shape[:dim])``
    runs of the flattened parameter, stored contiguously in the shard (the sharded parameter's local tensor is
    contiguous, the DTensor's ``Shard(dim)`` piece), and the full buffer keeps the parameter contiguous in its
    own shape: the copy-out and copy-in move each rank's piece as a ``(lead, run)`` block. When no dimension
    divides evenly, the cut is in two dimensions (see [Note: two-dimension cut]) where that is exact, else it
    stays on dim 0, padded. Every reader of a slot (checkpoints, state dicts, streamed loading, the estimator)
    goes through :class:`ParamSlot`'s methods, so the choice is made once, here.

    [Note: two-dimension cut]
    At 1,024 ranks some real matrices have no dimension the ranks divide: Qwen2-7B's hidden size is 3584 = 7 x 512
    and its MLP width 18944 = 37 x 512, so every one-dimension cut of its attention and MLP matrices pads (+7.7%
    of the model); Falcon-7B's 4544 = 71 x 64 likewise. Such a matrix is cut in two dimensions instead: the
    shard group of ``W`` ranks seen as an ``(a, b)`` grid, ``a * b = W``, rank ``r`` at ``(r // b, r % b)``,
    dim 0 in ``a`` parts and a later dimension ``dim2`` in ``b`` parts, both exactly (a 3584 x 3584 matrix
    over 1024 ranks: 7 rows of 1792 columns per rank, nothing padded). The smallest ``b`` that divides
    exactly wins, so runs stay long; the first dimension is always dim 0 (``lead`` is 1), so a rank's piece
    is ``rows * mid`` runs of ``cols * tail`` elements at one stride, which the checkpoint format's
    ``[lo, hi, stride, count]`` ranges already describe.

    The sharded parameter stays a DTensor with its global shape: ``(Shard(0), Shard(dim2))`` on a 2-D device
    mesh over the same ranks (the chunk's mesh with its shard dimension unflattened to ``(a, b)``; HSDP's
    replicate dimension stays in front, ``Replicate()``), which ``full_tensor()``, ``redistribute``, DCP,
    the foreach optimizers and torch's ``clip_grad_norm_`` read (its per-mesh norm stacks go through
    [Note: torch's clip over several meshes] in ``zero_core.base._dtensor_ops``). Variable-length ("ragged")
    pieces were the other way (veScale's ``RaggedShard``), but DTensor's placements allow only
    ``torch.chunk``'s unevenness, so ragged pieces would not be DTensors torch's tools read. The price is
    setup: each grid in use is a mesh of its own, ``a + b`` new process groups (every rank takes part in
    creating each, ``R (a + b)`` on an HSDP mesh of ``R`` replicas) plus one flattened group, made once per
    chunk mesh and grid; torch reduces a norm over a grid in one collective through the flattened group.
    A chunk's collectives do not change: a piece is still ``piece`` elements at the same offset in every
    rank's shard, so only the copy-out, copy-in and the slot's geometry know the grid. Measured with
    ``zero estimate`` (either strategy, stages 2 and 3): Qwen2-7B over 1024 ranks pads 0.05% (7.66% cut in
    one dimension), Falcon-7B 0.03% (7.56%); see the table in docs/concepts.md.
    """
    dim, pads = _one_dim(shape, world_size)
    if not pads:
        return dim, 0, 1
    for split in range(2, world_size):
        if world_size % split or shape[0] % (world_size // split):
            continue
        for d in range(1, len(shape)):
            if shape[d] % split == 0:
                return 0, d, split
    return 0, 0, 1


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
        rows: Entries of the cut dimension one piece holds (``ceil(shape[dim] / (world_size / split))``).
        row: Elements per entry of the cut dimension (the product of the later dimensions).
        dim: The dimension the parameter is cut along (``Shard(dim)``).
        lead: The product of the dimensions before ``dim``: how many runs one rank's piece is in the parameter.
        dim2: With ``split > 1``, the second dimension cut (see [Note: two-dimension cut]); ``dim`` is then 0.
        split: Parts ``dim2`` is cut in (1: a one-dimension cut); ``dim`` is in ``world_size / split`` parts.
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
    dim2: int = 0
    split: int = 1

    @property
    def replicated(self) -> bool:
        """A zero-dimensional parameter: every rank holds it whole."""
        return len(self.shape) == 0

    @property
    def strided(self) -> bool:
        """Cut along a later dimension: a rank's piece is ``lead`` runs of the flattened parameter, not one range."""
        return self.lead > 1 or self.split > 1

    @property
    def grid(self) -> tuple[int, int, int, int]:
        """For a two-dimension cut: ``(mid, cols, tail)`` and the entries of ``dim2``, where a rank's piece is
        ``rows x mid x cols x tail`` of the parameter viewed as ``(shape[0], mid, shape[dim2], tail)``."""
        mid = tail = 1
        for d in self.shape[1:self.dim2]:
            mid *= d
        for d in self.shape[self.dim2 + 1:]:
            tail *= d
        return mid, self.shape[self.dim2] // self.split, tail, self.shape[self.dim2]

    def _grid_view(self, flat: torch.Tensor) -> torch.Tensor:
        """A two-dimension cut's parameter (``numel`` elements, contiguous) as ``(a, split, rows, mid, cols * tail)``:
        every rank's piece, indexed by its place in the grid (a view)."""
        mid, cols, tail, _ = self.grid
        return flat.view(-1, self.rows, mid, self.split, cols * tail).permute(0, 3, 1, 2, 4)

    def local_rows(self, rank: int) -> int:
        """Entries of the cut dimension that ``rank`` owns (``torch.chunk``'s rule)."""
        if self.replicated:
            return 1
        if self.split > 1:
            return self.rows
        return max(0, min(self.rows, self.shape[self.dim] - rank * self.rows))

    def local_shape(self, rank: int) -> torch.Size:
        if self.replicated:
            return torch.Size(())
        shape = list(self.shape)
        shape[self.dim] = self.local_rows(rank)
        if self.split > 1:
            shape[self.dim2] //= self.split
        return torch.Size(shape)

    def local_numel(self, rank: int) -> int:
        """Elements of ``rank``'s piece without its padding."""
        if self.split > 1:
            return self.piece
        return 1 if self.replicated else self.lead * self.local_rows(rank) * self.row

    def block(self, rank: int) -> tuple[int, int, int]:
        """``(dim, start, length)``: the entries of ``dim`` that hold ``rank``'s piece (the whole piece for a
        one-dimension cut; :meth:`from_block` cuts a two-dimension one's out of them)."""
        start = (rank // self.split) * self.rows if self.split > 1 else min(rank * self.rows, self.shape[self.dim])
        return self.dim, start, self.local_rows(rank)

    def from_block(self, block: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s piece of the parameter (its local shape) from the entries :meth:`block` names (a view)."""
        if self.split == 1:
            return block
        cols = self.shape[self.dim2] // self.split
        return block.narrow(self.dim2, (rank % self.split) * cols, cols)

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
        if self.split > 1:  # rows * mid runs of cols * tail elements, one entry of dim2 apart (lead is 1)
            mid, cols, tail, entries = self.grid
            n, gap = cols * tail, entries * tail
            start = (rank // self.split) * self.rows * self.row + (rank % self.split) * n
            return [(start + k * gap, start + k * gap + n, k * n) for k in range(self.rows * mid)]
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
        dim, start, length = self.block(rank)
        return self.from_block(value.reshape(self.shape).narrow(dim, start, length), rank)

    def columns(self, region: torch.Tensor, world_size: int) -> torch.Tensor:
        """The parameter's region of a parameter-major buffer (``world_size * piece`` elements) as every rank's
        piece: ``(world_size, piece)``, or ``(world_size, lead, rows * row)`` for a strided one, or
        ``(a, split, rows, mid, cols * tail)`` for a two-dimension cut (its rank dimensions first: :meth:`of_rank`;
        a view)."""
        if not self.strided:
            return region.view(world_size, self.piece)
        if self.split > 1:
            return self._grid_view(region)
        return region.view(self.lead, world_size, self.rows * self.row).transpose(0, 1)

    def rank_dims(self, world_size: int) -> tuple[int, ...]:
        """The leading dimensions of :meth:`columns` that index the ranks."""
        return (world_size // self.split, self.split) if self.split > 1 else (world_size,)

    def of_rank(self, columns: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s piece in :meth:`columns`."""
        return columns[rank // self.split, rank % self.split] if self.split > 1 else columns[rank]

    def whole(self, columns: torch.Tensor) -> torch.Tensor:
        """The parameter's value from every rank's padded piece side by side (``(world_size, piece)``, rank order)."""
        if not self.strided:
            return columns.reshape(-1)[: self.numel].view(self.shape)
        world = columns.shape[0]
        if self.split > 1:
            mid, cols, tail, _ = self.grid
            grid = columns.reshape(world // self.split, self.split, self.rows, mid, cols * tail)
            return grid.permute(0, 2, 3, 1, 4).reshape(self.shape)
        return columns.reshape(world, self.lead, self.rows * self.row).transpose(0, 1).reshape(self.shape)

    def pieces_of(self, whole: torch.Tensor, world_size: int) -> torch.Tensor:
        """The inverse of :meth:`whole`: every rank's padded piece of a whole value, ``(world_size, piece)`` (a new
        tensor, zero padded)."""
        flat = whole.reshape(-1)
        if self.split > 1:
            return self._grid_view(flat).reshape(world_size, self.piece)
        if self.strided:
            return flat.view(self.lead, world_size, self.rows * self.row).transpose(0, 1).reshape(world_size, self.piece)
        out = flat.new_zeros(world_size * self.piece)
        out[: self.numel] = flat
        return out.view(world_size, self.piece)


def _cut(shape: Sequence[int], world_size: int) -> tuple[int, int, int, int, int, int]:
    """``(dim, lead, rows, row, dim2, split)`` of a parameter of ``shape`` cut over ``world_size`` ranks; its piece is
    ``lead * rows * row / split`` elements."""
    if len(shape) == 0:
        return 0, 1, 1, 1, 0, 1
    dim, dim2, split = shard_cut(shape, world_size)
    lead = row = 1
    for d in shape[:dim]:
        lead *= d
    for d in shape[dim + 1:]:
        row *= d
    return dim, lead, -(-shape[dim] // (world_size // split)), row, dim2, split


def layout_slots(params: Sequence[tuple[str, nn.Parameter]], world_size: int) -> tuple[tuple[ParamSlot, ...], int]:
    """The slots of these parameters in one chunk, and the elements their pieces take in a shard."""
    slots, offset = [], 0
    for name, param in params:
        dim, lead, rows, row, dim2, split = _cut(param.shape, world_size)
        piece = lead * rows * row // split
        slots.append(ParamSlot(name, param, world_size * offset, param.numel(), param.shape, offset, piece, rows, row,
                               dim, lead, dim2, split))
        offset += piece
    return tuple(slots), offset


def padded_shard_size(params: Sequence[tuple[str, nn.Parameter]] | Sequence[torch.Size], world_size: int, size: int) -> int:
    """A chunk's shard size: the plan's ``size / world_size``, or more when the per-parameter padding needs it."""
    total = 0
    for item in params:
        shape = item if isinstance(item, torch.Size) else item[1].shape
        _, lead, rows, row, _, split = _cut(shape, world_size)
        total += lead * rows * row // split
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
