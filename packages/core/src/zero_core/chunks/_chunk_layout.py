"""A chunk's layout on one rank: where each parameter sits in the full buffer and in the shard.

See [Note: chunk layout] in ``zero_core.chunks.chunk``. Fixed when the chunk is built; every method
is a pure view or copy between the layout's two orders (parameter-major full buffers,
rank-major collective buffers), so the chunk's storage, its gradients and the collectives
share one description of the bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

from zero_core.chunks._slots import ChunkSpec, ParamSlot, layout_slots, rewrap, to_local

__all__ = ["ChunkLayout", "dense", "dtensor", "repoint"]


class ChunkLayout:
    """Slots, shard size and the views between the parameter-major and rank-major orders."""

    def __init__(self, spec: ChunkSpec, *, rank: int, world_size: int, outer: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size
        # Groups of ranks whose shards one all-gather of the shard group carries together (see [Note: optimizer
        # states across replicas] in zero_core.chunks.chunk): 1 unless the shards are cut over the replicas too.
        self.outer = outer
        self.slots: tuple[ParamSlot, ...]
        self.slots, pieces_numel = layout_slots([(p.name, p.param) for p in spec.params], world_size)
        # A chunk of one parameter needs no padding beyond its piece: then its full buffer and the ranks' shards
        # side by side are the same layout, and it gathers and reduces in place (no copy-out, no copy-in).
        self.shard_size = pieces_numel if len(self.slots) == 1 else max(spec.size // world_size, pieces_numel)
        self.size = self.shard_size * world_size
        # Column sizes of a (world_size, shard_size) view: each parameter's piece, then the shard's tail padding.
        tail = self.shard_size - pieces_numel
        self.split_sizes = [s.piece for s in self.slots] + ([tail] if tail else [])
        self.has_replicated = any(s.replicated for s in self.slots)
        # A parameter cut along a later dimension (see [Note: shard dimension] in zero_core.chunks._slots): its pieces are
        # blocks of the full buffer, not ranges, so the copies between the two orders go slot by slot.
        self.strided = any(s.strided for s in self.slots)
        # One column: parameter-major and rank-major coincide (see the shard size above).
        self.direct = len(self.split_sizes) == 1 and not self.strided
        # The chunk's own full buffer and its regions as copy_out's targets, by leading shape: built once (a stage-3
        # chunk's buffer keeps its storage object when it is freed and gathered again, so views of it stay valid);
        # 190 views per gather cost more than the copy on a thin model.
        self._full: torch.Tensor | None = None
        self._targets: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def bind_full(self, full: torch.Tensor) -> None:
        """``full`` is the chunk's own full buffer for good: :meth:`copy_out` into it reuses its regions' views."""
        self._full, self._targets = full, {}

    def regions(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """``buf`` (parameter-major, ``size`` elements) cut into every rank's piece of each parameter, then the
        shards' tail padding: ``(world_size, piece)`` views (``ParamSlot.columns``' shapes for a strided slot)."""
        out, at = [], 0
        for slot in self.slots:
            out.append(slot.columns(buf[at : at + self.world_size * slot.piece], self.world_size))
            at += self.world_size * slot.piece
        if len(self.split_sizes) > len(self.slots):
            out.append(buf[at : at + self.world_size * self.split_sizes[-1]].view(self.world_size, -1))
        return out

    def own_pieces(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """This rank's padded piece of each parameter inside a parameter-major buffer (full or gradient): flat
        views, or ``(lead, run)`` blocks for strided slots."""
        if not self.strided:
            return [buf[s.offset + self.rank * s.piece : s.offset + (self.rank + 1) * s.piece] for s in self.slots]
        return [slot.of_rank(region, self.rank) for slot, region in zip(self.slots, self.regions(buf))]

    def shard_pieces(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's padded piece inside a shard (``shard_size`` elements)."""
        return [shard[s.shard_offset : s.shard_offset + s.piece] for s in self.slots]

    def tail(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """The shard's tail padding inside ``buf``'s own rank row (empty list when there is none)."""
        if len(self.split_sizes) == len(self.slots):
            return []
        return [self.regions(buf)[-1][self.rank]]

    def scatter_own(self, shard: torch.Tensor, buf: torch.Tensor) -> None:
        """Write a shard (``shard_size`` elements) into this rank's pieces of a parameter-major buffer."""
        own = self.own_pieces(buf) + self.tail(buf)
        with torch.no_grad():
            if not self.strided:
                torch.split_with_sizes_copy(shard, self.split_sizes, out=own)
                return
            for part, piece in zip(shard.split(self.split_sizes), own):
                piece.copy_(part.view(piece.shape))

    def local(self, i: int, piece: torch.Tensor) -> torch.Tensor:
        """Parameter ``i``'s padded ``piece`` cut to this rank's rows, in the sharded parameter's local shape."""
        shape = self.slots[i].local_shape(self.rank)
        return piece[: shape.numel()].view(shape)

    def copy_out(self, rank_major: torch.Tensor, full: torch.Tensor) -> None:
        """Fill ``full`` (parameter-major) from a ``(world_size, shard_size)`` view of the ranks' shards, or an
        ``(outer, world_size / outer, shard_size)`` one (:meth:`from_gather_order`)."""
        with torch.no_grad():
            lead = tuple(rank_major.shape[:-1])
            if self.direct:
                full.view(*lead, self.shard_size).copy_(rank_major)
            elif self.strided:
                for slot, column, region in zip(self._grid_slots(), rank_major.split(self.split_sizes, dim=-1),
                                                self.regions(full)):
                    if slot is not None:  # the ranks as a grid (see [Note: two-dimension cut] in zero_core.chunks._slots)
                        region.copy_(column.reshape(region.shape))  # a gather-order view is copied once more here
                        continue
                    region.view(*lead, *region.shape[1:]).copy_(column.view(*lead, *region.shape[1:]))
            else:
                if not rank_major.is_contiguous() and dense(rank_major):
                    # A gather-order view: dense, its leading dimensions permuted. CUDA's fast path of
                    # split_with_sizes_copy takes any dense input and reads it as if contiguous (torch 2.11,
                    # aten/src/ATen/native/cuda/TensorShape.cu), which scrambled the replicas' rows on an H200.
                    # Strided inputs that are not dense (a group's block) take torch's exact composite path.
                    rank_major = rank_major.contiguous()
                torch.split_with_sizes_copy(rank_major, self.split_sizes, dim=-1, out=self._copy_targets(full, lead))

    def _grid_slots(self) -> list[ParamSlot | None]:
        """Each column of :attr:`split_sizes`: its slot if cut in two dimensions, else ``None`` (the tail too)."""
        return [s if s.split > 1 else None for s in self.slots] + [None] * (len(self.split_sizes) - len(self.slots))

    def _copy_targets(self, full: torch.Tensor, lead: tuple[int, ...]) -> list[torch.Tensor]:
        if full is not self._full:
            return [r.view(*lead, r.shape[-1]) for r in self.regions(full)]
        targets = self._targets.get(lead)
        if targets is None:
            targets = self._targets[lead] = [r.view(*lead, r.shape[-1]) for r in self.regions(full)]
        return targets

    def copy_in(self, flat: torch.Tensor, out: torch.Tensor, *, gather_order: bool = False) -> None:
        """Lay a parameter-major buffer out rank-major into ``out`` (``size`` elements), casting to its dtype.

        ``gather_order``: in the order of the shard group's collectives instead, each shard group rank's
        ``outer`` shards together (see [Note: optimizer states across replicas] in ``zero_core.chunks.chunk``)."""
        with torch.no_grad():
            if self.strided:
                lead = (self.outer, self.world_size // self.outer) if gather_order else (self.world_size,)
                target = out.view(lead[-1], lead[0], self.shard_size).transpose(0, 1) if len(lead) == 2 else \
                    out.view(self.world_size, self.shard_size)
                for slot, column, region in zip(self._grid_slots(), target.split(self.split_sizes, dim=-1),
                                                self.regions(flat)):
                    if slot is not None:  # the ranks as a grid (see [Note: two-dimension cut] in zero_core.chunks._slots)
                        column.copy_(region.reshape(*lead, slot.piece).view(column.shape))
                        continue
                    column.view(*lead, *region.shape[1:]).copy_(region.view(*lead, *region.shape[1:]))
                return
            if not gather_order or self.outer == 1:
                torch.cat(self.regions(flat), dim=1, out=out.view(self.world_size, self.shard_size))
                return
            lead = (self.outer, self.world_size // self.outer)
            torch.cat([r.view(*lead, r.shape[-1]) for r in self.regions(flat)], dim=2,
                      out=out.view(lead[1], lead[0], self.shard_size).transpose(0, 1))

    def from_gather_order(self, block: torch.Tensor) -> torch.Tensor:
        """A ``(shard group ranks, outer * shard_size)`` block as the shard group's all-gather leaves it, viewed in
        rank order for :meth:`copy_out` (no copy)."""
        if self.outer == 1:
            return block
        return block.unflatten(1, (self.outer, self.shard_size)).transpose(0, 1)


def dense(t: torch.Tensor) -> bool:
    """Whether ``t`` fills its memory without gaps or overlaps in some order of its dimensions (torch's C++
    ``is_non_overlapping_and_dense``, which Python does not expose)."""
    expected = 1
    for size, stride in sorted(((t.size(d), t.stride(d)) for d in range(t.dim()) if t.size(d) != 1), key=lambda x: x[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def dtensor(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A DTensor over ``local`` (a view into a chunk's buffer) that ``copy.deepcopy``, ``pickle`` and ``torch.save``
    accept.

    torch gives a DTensor's wrapper its local tensor's storage offset. A wrapper has no storage, and
    deepcopy and the serializers tell "no storage" by a null data pointer, which the offset of a piece
    past the start of its chunk makes non-null: they then copy the wrapper's invalid storage and fail
    ("invalid python storage"). A wrapper at offset 0 is treated as what it is: its local tensor is
    copied or saved (the whole chunk shard once, which the pieces share)."""
    out = torch.Tensor._make_wrapper_subclass(
        DTensor, spec.shape, strides=spec.stride, storage_offset=0, dtype=local.dtype,
        device=local.device, layout=local.layout, requires_grad=False)
    out._spec = spec
    out._local_tensor = local
    return out


def repoint(param: nn.Parameter, local: torch.Tensor) -> None:
    """Make ``local`` the sharded parameter's data, keeping the object (the optimizer's key, the model's entry)."""
    if not isinstance(param, DTensor):
        param.data = local
        return
    if param._local_tensor.device == local.device:
        param._local_tensor = local
        return
    # A DTensor's device is fixed when it is made, and a shard that moved to another device (host offload) needs
    # a wrapper there: a new one is swapped into the same object, with its attributes and its gradient moved along.
    attrs, grad = dict(param.__dict__), param.grad
    fresh = nn.Parameter(DTensor(local, param._spec, requires_grad=False), requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, fresh)
    param.__dict__.update(attrs)
    if grad is not None:
        param.grad = rewrap(grad, to_local(grad).to(local.device))
