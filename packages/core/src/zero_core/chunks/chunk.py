"""Chunks: flat buffers of parameters, sharded evenly over the data-parallel ranks.

[Note: chunk layout]
Every parameter is cut along dim 0 in ``torch.chunk`` sizes: with ``N`` ranks and
``d0`` rows, each rank owns ``c = ceil(d0 / N)`` rows (the last ranks fewer, maybe
none). A parameter's *piece* is ``c`` rows, the same size on every rank (the rows a
rank does not own are padding). A rank's shard of a chunk is its pieces of the chunk's
parameters, one after another, at the same offsets on every rank, then zeros up to the
shard size. So the shard of parameter ``i`` on rank ``r`` is exactly ``torch.chunk``'s
piece ``r``: a DTensor with ``Shard(0)`` over the data-parallel mesh, which is what
``torch.distributed.tensor``, ``torch.nn.utils.clip_grad_norm_``, the foreach optimizers
and ``torch.distributed.checkpoint`` understand. A zero-dimensional parameter is
replicated: every rank holds it whole (a one-element piece) and its gradient is summed.
A parameter that dim 0 would pad by more than 1% (fused MoE experts) is cut the same way
along a later dimension instead, ``Shard(d)``: see [Note: shard dimension] in
``zero_core.chunks._slots``; "rows" below are then entries of that dimension. A matrix no
single dimension of which the ranks divide is cut in two, a grid of equal pieces (``(Shard(0),
Shard(d))`` on a 2-D mesh over the same ranks): see [Note: two-dimension cut] there.

The full buffer is parameter-major: parameter ``i`` occupies ``N`` pieces, rank 0's
first, so it is contiguous and has its original shape. An all-gather leaves the
ranks' shards rank-major; one ``split_with_sizes_copy`` moves them into the full buffer
(the *copy-out*), and gradient reduction does the mirror image, one ``cat`` from the
parameter-major gradient buffer into a rank-major send buffer (the *copy-in*). Both are
one operation per chunk, whatever the number of parameters (FSDP2 does the same).

[Note: parameter views]
Each parameter has two objects. The *sharded parameter* is what the model holds and
the optimizer steps between steps: an ``nn.Parameter`` whose data is a DTensor (or,
in one process without ``torch.distributed``, a plain tensor) with the original global
shape, whose local tensor is a view of this rank's piece. The *unsharded parameter* is
the original parameter object, a view of the full buffer while the chunk is gathered
(``param.data = full[offset:offset + numel].view(shape)``); the engine registers it in
the modules for forward and backward and swaps the sharded one back when they end.
Releasing frees the full buffer's storage in place (``untyped_storage().resize_(0)``)
and points each unsharded parameter at an empty tensor, so code that touches it fails
with a shape error instead of reading freed memory. Gathering re-allocates the same
storage, so tensors autograd saved in forward are valid again in backward.

[Note: stages and dtypes]
What a chunk keeps between steps depends on the stage and the compute dtype:

=====  ==========================================  =========================================
stage  parameters                                  gradients
=====  ==========================================  =========================================
1      full buffer kept; master shard              one full-size buffer kept (replicated);
                                                   this rank's mean lands in its own pieces
2      full buffer kept; master shard              full-size buffer only during backward;
                                                   the mean shard is kept
3      full buffer only while gathered; shard      as stage 2
=====  ==========================================  =========================================

The master shard is in the parameters' own dtype. When the compute dtype is the
same, a kept full buffer holds the master values: each sharded parameter's local tensor
is a view of this rank's piece inside the full buffer (there is no separate shard), so
stages 1 and 2 hold parameters once. With 16-bit compute, the full buffer is 16-bit and
the master shard a separate fp32 tensor; gathers send the shard cast to 16 bits.
Gradients accumulate in the compute dtype, are cast to the reduce dtype for the
reduce-scatter, and reach the optimizer in the master dtype, divided by
``world_size x loss scale``. After a step, stages 1 and 2 all-gather the updated
shards into the kept full buffer.

[Note: optimizer segments]
The optimizer steps the sharded parameters themselves (one *segment* per parameter:
its piece on this rank). A parameter that got no gradient on any rank keeps
``grad=None``, so torch's optimizers skip it exactly as in one process; per-group
hyperparameters apply per parameter, and padding carries no optimizer state.
Elementwise optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, ...) therefore match
one-process training, and so do those that reduce over a whole tensor through DTensor.

[Note: optimizer states across replicas]
On a mesh ``(R, S)`` every replica normally holds the same shards: each rank steps ``1/S``
of every chunk. With ``ZeroConfig.shard_optimizer_across_replicas`` (stage 3) the chunk is
laid out over all ``N = R * S`` ranks instead (``world_size`` is ``N``, ``rank`` the rank's
place ``r * S + s`` in the mesh, its sharded parameters ``Shard(0)`` over all ``N``), so the
master shard, the reduced gradient and the optimizer states are ``1/N``. What the shard
group all-gathers is the *group shard*: the ``R`` shards of the ranks in this rank's
column of the mesh (``r' * S + s`` for every ``r'``), in the compute dtype, kept between
steps (``1/S`` of the chunk, what every rank kept before). The all-gather over the shard group
leaves them ``(S, R, shard)``, which :meth:`~zero_core.chunks._chunk_layout.ChunkLayout.from_gather_order`
views in rank order for the usual copy-out; gradients are laid out in that order by the
copy-in, reduce-scattered inside the shard group (to the group shard's ``R`` shards), then
reduce-scattered over the replicate group (to this rank's one shard) where they used to be
all-reduced. After a step (or any write to the masters) the replicate group all-gathers the
updated shards into the group shard. In one dtype the master shard is this rank's slice of
the group shard, so fp32 Adam holds ``4 psi / S + 12 psi / N`` bytes per rank.

[Note: shards made where they live]
``shard()`` asks the placement policy where each chunk's master shard starts
(``PlacementPolicy.initial_tier``) before any value arrives, and :meth:`Chunk.pack` or
:meth:`Chunk.begin_fill` makes it there: on the compute device, or in host memory (pinned
when the compute device is CUDA) for a shard the policy's ``attach`` would otherwise copy
down at once. Filled on the device and moved after, every shard of the model sat on the
device together before the first one left: a 1-3B parameter model failed in setup under a
4 GiB device budget that its training fits. Made in host memory, the device holds at most
one chunk while the chunks are built: ``pack`` stages one full buffer there (and on CUDA
the packed shard, copied down before the next chunk), ``begin_fill`` (a lazily built model,
its values replayed on the CPU) nothing. A shard the kept full buffer holds
(``shard_is_view``), or an ``outer > 1`` group shard, is the device's whatever the policy
says; ``tier`` records where the shard was made, and the policy's ``attach`` starts from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from zero_core.base._devices import copy_on_copy_stream, to_compute_device
from zero_core.base._host_memory import advise_huge_pages
from zero_core.base._state import ChunkState, MemoryTier
from zero_core.base._streams import streams_for
from zero_core.base.errors import OwnershipError, PlanError, ZeroError
from zero_core.chunks._buffers import BufferPool
from zero_core.chunks._chunk_grads import ChunkGradients
from zero_core.chunks._chunk_layout import ChunkLayout, dtensor, repoint
from zero_core.chunks._grid_mesh import grid_mesh
from zero_core.chunks._ownership import in_policy_call
from zero_core.chunks._slots import (
    ChunkSpec,
    ParamInfo,
    ParamSlot,
    Segment,
    layout_slots,
    padded_shard_size,
    rewrap,
    to_local,
)
from zero_core.comm.backend import CommBackend

# The layout records and the buffer pool live in their own modules (below this one); re-exported here,
# where every caller has always found them.
__all__ = ["BufferPool", "Chunk", "ChunkSpec", "ParamInfo", "ParamSlot", "Segment", "layout_slots", "padded_shard_size",
           "rewrap", "to_local"]


class Chunk:
    """A flat, evenly sharded buffer of parameters. See [Note: chunk layout], [Note: parameter views] and
    [Note: stages and dtypes]."""

    def __init__(
        self, index: int, spec: ChunkSpec, *, rank: int, world_size: int, device: torch.device,
        pool: BufferPool | None = None, stage: int = 3, compute_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None, gradient_predivide_factor: float = 1.0, keep_gathered: bool = False,
        keep_alone: bool = True,
        mesh: Any = None, replicas: int = 1, outer: int = 1, exact_gathers: bool = True,
        timeout: Any = None,
    ) -> None:
        if spec.size % world_size:
            raise PlanError(f"chunk size {spec.size} is not a multiple of the world size {world_size}")
        if spec.used > spec.size:
            raise PlanError(f"chunk {index} holds {spec.used} elements but its size is {spec.size}")
        if stage not in (1, 2, 3):
            raise PlanError(f"stage must be 1, 2 or 3, got {stage!r}")
        if outer < 1 or world_size % outer or (outer > 1 and (stage != 3 or keep_gathered)):
            raise PlanError(f"a chunk cut over {outer} replicas needs stage 3, not kept gathered, and a world size "
                            f"({world_size}) that is a multiple of it")
        first = spec.params[0]
        # Identity and layout: fixed for the chunk's life.
        self.index = index
        # ``rank`` and ``world_size`` are this rank's place in the chunk's shard group (see [Note: meshes] in
        # zero_core.interfaces.mesh); ``replicas`` copies of the shard group hold the same shards.
        self.world_size = world_size
        self.rank = rank
        self.replicas = replicas
        # See [Note: optimizer states across replicas]: ``outer`` replicas each hold 1/outer of the shard group's
        # shard (``world_size`` counts them all); the shard group has ``gather_world`` ranks, this one at
        # ``gather_rank``, and it sits at ``outer_rank`` among the replicas.
        self.outer = outer
        self.gather_world = world_size // outer
        self.gather_rank, self.outer_rank = rank % self.gather_world, rank // self.gather_world
        # The plan the strategy gave and the comm backends of the process groups it runs on (set by shard(); None for a chunk
        # built on its own, whose collectives run on the comm each method is given).
        self.plan: Any = None
        self.comms: Any = None
        # Where each parameter sits (see [Note: chunk layout]); its sizes are repeated here, where every reader looks.
        self.layout = ChunkLayout(spec, rank=rank, world_size=world_size, outer=outer)
        self.slots, self.shard_size, self.size = self.layout.slots, self.layout.shard_size, self.layout.size
        # One parameter gathers in place, unless the shard group's collectives carry shards out of rank order.
        self.split_sizes, self.direct = self.layout.split_sizes, self.layout.direct and outer == 1
        # What one rank sends in the shard group's all-gather (its group shard when outer > 1).
        self.gather_numel = self.shard_size * outer
        self.device = device
        self.stage = stage
        # The device mesh of the sharded parameters' DTensors; None in one process without torch.distributed.
        self.mesh = mesh
        # A parameter cut in two dimensions is a DTensor on the mesh with its shard dimension unflattened to the
        # grid (see [Note: two-dimension cut] in zero_core.chunks._slots): made here, on every rank in chunk order.
        self.grid_meshes: dict[int, Any] = {}
        if mesh is not None:
            for slot in self.slots:
                if slot.split > 1 and slot.split not in self.grid_meshes:
                    if mesh.size(mesh.ndim - 1) != world_size:
                        raise PlanError(f"chunk {index} cuts {slot.name} in two dimensions over {world_size} ranks, "
                                        f"but its mesh's last dimension has {mesh.size(mesh.ndim - 1)}")
                    self.grid_meshes[slot.split] = grid_mesh(mesh, slot.split, timeout)
        # The optimizer updates the shard in the parameters' own dtype; forward and backward run in ``dtype``.
        self.master_dtype = first.param.dtype
        floating = self.master_dtype.is_floating_point
        self.dtype = compute_dtype if (compute_dtype is not None and floating) else self.master_dtype
        self.reduce_dtype = reduce_dtype if (reduce_dtype is not None and floating) else self.master_dtype
        self.predivide = float(gradient_predivide_factor)
        self._initially_trainable = first.param.requires_grad
        self.param_group = first.param_group
        self.used = spec.used
        # Stages 1 and 2 keep the full buffer for the whole run, and so does a single rank unless its placement
        # policy keeps master shards off the device (keep_alone=False); at stage 3 a placement policy may keep some
        # chunks gathered too (zero-offload's shard_param_frac).
        self.persistent = stage < 3 or (world_size == 1 and keep_alone) or keep_gathered
        # In one dtype, a kept full buffer holds the master values: the optimizer updates this rank's pieces of it.
        # A strided piece (see [Note: shard dimension]) is not a range of the full buffer: such a chunk keeps its shard,
        # and so does one whose parameter gathers are lossy (``exact_gathers=False``: the full buffer's other ranks'
        # pieces are then not their masters, see [Note: collectives that may be lossy] in zero_core.comm.backend).
        self.shard_is_view = (self.persistent and self.dtype == self.master_dtype and not self.layout.strided
                              and exact_gathers)
        # Runtime state, changed only through the transition methods below (the collectives call them).
        self.state = ChunkState.GATHERED
        self._tier = MemoryTier.DEVICE
        # Set by shard(): the engine owns this chunk, and [Note: who moves a chunk] is asserted.
        self.owned = False
        self.full = torch.empty(self.size, dtype=self.dtype, device=device)
        self.layout.bind_full(self.full)
        self._views = tuple(self.full[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots)
        if not self.persistent:  # allocated by pack() (or never, by begin_fill()): building every chunk costs nothing
            self.full.untyped_storage().resize_(0)
        self._empty = torch.empty(0, dtype=self.dtype, device=device)
        self._pending_gather: Any = None  # the completion object of the gather in flight
        # The device's streams (no-ops on CPU): see [Note: streams of the data plane] in zero_core.base._streams.
        self.pool = pool or BufferPool(streams_for(device))
        self.streams = self.pool.streams
        # This rank's shard (master dtype), None while the kept full buffer holds it (shard_is_view).
        self._shard: torch.Tensor | None = None
        # outer > 1: the group shard (compute dtype), kept between steps; the master shard is its slice in one dtype.
        self._group_shard: torch.Tensor | None = None
        self._shard_in_group = False
        # This rank's padded piece of each parameter (master dtype): views of the shard or of the full buffer.
        self.pieces: list[torch.Tensor] = []
        self.segments: tuple[Segment, ...] = ()
        # How many times a placement policy replaced the shard: the sharded parameters' version counters restart
        # when a move swaps them to another device (see [Note: writes outside the optimizer]).
        self.shard_moves = 0
        # The gradients, from autograd's buffer to the optimizer's .grad (see [Note: a gradient's three places]).
        self.grads = ChunkGradients(self)
        # In SHARDED_POST_FORWARD only: this rank's 1/k of the rank-major gathered buffer, kept from a forward for
        # the backward's gather inside its group of k ranks (see release(keep_copy=True)).
        self._post_forward_copy: torch.Tensor | None = None

    # -- which group a collective runs on -------------------------------------------------
    def comm_for(self, given: CommBackend, role: str = "gather") -> CommBackend:
        """The chunk's own group for ``role`` when shard() gave it groups, else the one the caller passed."""
        return given if self.comms is None else getattr(self.comms, role)

    # -- layout helpers ---------------------------------------------------------------
    def wrap(self, i: int, local: torch.Tensor) -> torch.Tensor:
        """``local`` (this rank's piece of parameter ``i``, unpadded) as a tensor shaped like the sharded parameter."""
        if self.mesh is None:
            return local
        seg = self.segments[i] if self.segments else None
        if seg is not None:
            return dtensor(local, seg.param._spec)  # type: ignore[attr-defined]
        slot = self.slots[i]
        # the cut dimension (dim 0, or a later one: [Note: shard dimension]) is sharded over the mesh's last
        # dimension (the shard group); any leading dimension replicates
        # (HSDP's (Replicate(), Shard(0)), FSDP2's convention), and a zero-dimensional parameter replicates everywhere
        placements = (Replicate(),) * (self.mesh.ndim - 1) + ((Replicate(),) if slot.replicated else (Shard(slot.dim),))
        mesh = self.mesh
        if slot.split > 1:  # see [Note: two-dimension cut] in zero_core.chunks._slots
            mesh, placements = self.grid_meshes[slot.split], placements[:-1] + (Shard(0), Shard(slot.dim2))
        made = DTensor.from_local(local, mesh, placements, run_check=False, shape=slot.shape,
                                  stride=torch.empty(slot.shape, device="meta").stride())
        return dtensor(made._local_tensor, made._spec)

    @property
    def shard(self) -> torch.Tensor:
        """This rank's master shard (``shard_size`` elements). While the kept full buffer holds it
        (``shard_is_view``) this is a packed copy: write through :meth:`fill` or :meth:`replace_shard`."""
        if self._shard is not None:
            return self._shard
        return self._pack(self.pieces, self.master_dtype)

    def _pack(self, pieces: Sequence[torch.Tensor], dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(self.shard_size, dtype=dtype, device=self.device)
        tail = self.shard_size - sum(s.piece for s in self.slots)
        parts = list(pieces) + ([torch.zeros(tail, dtype=dtype, device=self.device)] if tail else [])
        with torch.no_grad():
            torch.cat([p.reshape(-1).to(self.device) for p in parts], out=out)
        return out

    # -- setup ---------------------------------------------------------------------
    def _home(self, tier: MemoryTier) -> tuple[torch.device, bool]:
        """Where a master shard made in ``tier`` lives, and whether pinned. See [Note: shards made where they live]."""
        if tier is MemoryTier.DEVICE:
            return self.device, False
        if tier is MemoryTier.HOST:
            return torch.device("cpu"), self.device.type == "cuda"
        raise PlanError(f"chunk {self.index}'s master shard can be made on the device or in host memory, not in the "
                        f"{tier.value} tier; a placement policy moves it there from the host in attach()")

    def pack(self, *, sync: Callable[[torch.Tensor], None] | None = None, tier: MemoryTier = MemoryTier.DEVICE) -> None:
        """Copy the parameters into the chunk, keep this rank's shard, point params at views.

        ``sync``, when given, makes the staged values rank 0's on every rank before the shard is
        cut (``shard()`` passes :func:`zero_core.chunks._collectives.broadcast_from_rank0` for
        ``sync_module_states``). ``tier`` is where the master shard is kept (see [Note: shards
        made where they live]).

        Each parameter's original storage is dropped as soon as it is copied, so at no
        point does a rank hold more than its parameters plus one full chunk (two when the
        compute dtype differs: the master copy is staged in the parameters' dtype).
        """
        self.check_state(ChunkState.GATHERED)
        with torch.no_grad():
            self.full.untyped_storage().resize_(self.size * self.full.element_size())
            self.full.zero_()
            staging = self.full if self.dtype == self.master_dtype else torch.zeros(
                self.size, dtype=self.master_dtype, device=self.device)
            for slot, view in zip(self.slots, self._views):
                staging[slot.offset : slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
                slot.param.data = view
            if sync is not None and self.world_size > 1:
                sync(staging)
            if self.layout.has_replicated:  # every rank's piece of a replicated parameter holds its value
                for slot, region in zip(self.slots, self.layout.regions(staging)):
                    if slot.replicated:
                        region.copy_(region[:1].expand_as(region))
            if staging is not self.full:
                self.full.copy_(staging)
            if self.shard_is_view:
                self.pieces = self.layout.own_pieces(self.full)
            elif self.outer > 1:
                self._group_shard = self._cut_group_shard()
                self._set_master(None if self._shard_in_group_possible else
                                 self._pack(self.layout.own_pieces(staging), self.master_dtype))
            else:
                shard = self._pack(self.layout.own_pieces(staging), self.master_dtype)
                home, pin = self._home(tier)
                if home != shard.device:  # packed on the device, kept in host memory: the device copy goes now
                    kept = torch.empty(self.shard_size, dtype=self.master_dtype, device=home, pin_memory=pin)
                    copy_on_copy_stream(kept, shard, self.streams)
                    shard = kept
                self._shard = shard
                self._tier = tier
                self.pieces = self.layout.shard_pieces(self._shard)
            del staging
            if not self.persistent:
                self.release()
        self._build_segments()

    def begin_fill(self, *, tier: MemoryTier = MemoryTier.DEVICE) -> None:
        """Allocate this rank's shard (and a kept full buffer), zeroed, for values that arrive one parameter at a time.

        The alternative to :meth:`pack` for parameters that hold no values (meta tensors under
        :func:`zero_core.lazy_init`): the values come through :meth:`fill`, and a stage-3 chunk
        never allocates its full buffer here. ``tier`` is where the master shard is made (see
        [Note: shards made where they live]).
        """
        self.check_state(ChunkState.GATHERED)
        for slot in self.slots:
            if slot.param.device.type == "meta":  # a meta tensor cannot take real data: swap in a real one, same object
                real = torch.Tensor._make_subclass(type(slot.param), torch.empty(0, dtype=self.master_dtype, device=self.device),
                                                   slot.param.requires_grad)
                real.__dict__.update(slot.param.__dict__)  # attributes set on the parameter (no_decay, ...) stay on it
                torch.utils.swap_tensors(slot.param, real)
        with torch.no_grad():
            if self.persistent:
                self.full.zero_()
                for slot, view in zip(self.slots, self._views):
                    slot.param.data = view
            if self.shard_is_view:
                self.pieces = self.layout.own_pieces(self.full)
            elif self.outer > 1:
                self._group_shard = torch.zeros(self.gather_numel, dtype=self.dtype, device=self.device)
                self._set_master(None if self._shard_in_group_possible else
                                 torch.zeros(self.shard_size, dtype=self.master_dtype, device=self.device))
            else:
                home, pin = self._home(tier)
                self._shard = torch.zeros(self.shard_size, dtype=self.master_dtype, device=home, pin_memory=pin)
                self._tier = tier
                self.pieces = self.layout.shard_pieces(self._shard)
            if not self.persistent:
                for slot in self.slots:
                    slot.param.data = self._empty
                self.state = ChunkState.SHARDED
        self._build_segments()

    @property
    def _shard_in_group_possible(self) -> bool:
        return self.dtype == self.master_dtype

    def _cut_group_shard(self) -> torch.Tensor:
        """The group shard of the values in the full buffer: this column's ``outer`` shards, in gather order."""
        rank_major = torch.empty(self.size, dtype=self.dtype, device=self.device)
        self.layout.copy_in(self.full, rank_major)
        rows = rank_major.view(self.outer, self.gather_world, self.shard_size)[:, self.gather_rank]
        return rows.reshape(-1).clone()

    def _set_master(self, shard: torch.Tensor | None) -> None:
        """outer > 1: ``shard`` becomes the master shard; None: this rank's slice of the group shard (one dtype)."""
        assert self._group_shard is not None
        self._shard_in_group = shard is None
        if shard is None:
            shard = self._group_shard[self.outer_rank * self.shard_size : (self.outer_rank + 1) * self.shard_size]
        self._shard = shard
        self.pieces = self.layout.shard_pieces(shard)

    @property
    def group_shard(self) -> torch.Tensor | None:
        """The group shard (see [Note: optimizer states across replicas]); None unless ``outer > 1``."""
        return self._group_shard

    def gather_send(self) -> torch.Tensor:
        """What this rank sends in the shard group's all-gather: its group shard, or its shard in the compute dtype."""
        if self._group_shard is not None:
            return self._group_shard
        return self.compute_shard()

    def outer_send(self) -> torch.Tensor:
        """This rank's updated master shard in the compute dtype, for the replicate group's all-gather into the group
        shard: a view of it when the group shard holds the master values (the all-gather then runs in place)."""
        assert self._shard is not None
        if self._shard_in_group:
            return self._shard
        return to_compute_device(self._shard, self.device, self.dtype, streams=self.streams)

    def _build_segments(self) -> None:
        """Create the sharded parameters, once: every later move re-points their local tensors."""
        segments = []
        for i, slot in enumerate(self.slots):
            local = self.layout.local(i, self.pieces[i])
            data = self.wrap(i, local) if self.mesh is not None else local
            param = nn.Parameter(data, requires_grad=slot.param.requires_grad)
            # attributes set on the original parameter (no_decay flags, HF's markers) stay visible on the sharded one
            for key, value in slot.param.__dict__.items():
                if not key.startswith("_") or key == "_is_hf_initialized":  # hooks and torch internals stay behind
                    param.__dict__.setdefault(key, value)
            segments.append(Segment(i, slot.shard_offset, param))
        self.segments = tuple(segments)

    @property
    def requires_grad(self) -> bool:
        """Whether any of the chunk's parameters is trainable now (``requires_grad`` may change between steps)."""
        if not self.segments:
            return self._initially_trainable
        for seg in self.segments:  # a loop, not any(): asked many times a step
            if seg.param.requires_grad:
                return True
        return False

    def held(self, slot: int) -> torch.Tensor:
        """The master values parameter ``slot`` has on this rank, flat, in the order of
        :meth:`~zero_core.chunks._slots.ParamSlot.runs`: a view to read or write in place."""
        return self.pieces[slot][: self.slots[slot].local_numel(self.rank)]

    def runs(self, slot: int) -> list[tuple[int, int, int]]:
        """``(lo, hi, at)``: the ranges of the flattened parameter ``slot`` this rank holds, each at ``held(slot)[at:]``."""
        return self.slots[slot].runs(self.rank)

    @torch.no_grad()
    def fill(self, slot: int, values: torch.Tensor, *, lo: int = 0) -> None:
        """Write parameter ``slot``'s values (flattened, starting at element ``lo``) into this rank's shard.

        ``values`` must cover at least every range of :meth:`runs`; only those are read. The shard
        must be in memory (see ``PlacementPolicy.before_load``). A kept full buffer is brought
        up to date by :func:`~zero_core.chunks._collectives.refresh_chunk` once every slot is filled.
        """
        held, flat = self.held(slot), values.reshape(-1)
        for a, b, at in self.runs(slot):
            held[at : at + b - a].copy_(flat[a - lo : b - lo])

    # -- transitions ----------------------------------------------------------------
    @property
    def tier(self) -> MemoryTier:
        """Where the shard lives; set by placement policies only (see [Note: who moves a chunk])."""
        return self._tier

    @tier.setter
    def tier(self, tier: MemoryTier) -> None:
        self.check_tier_mover("change its tier")
        self._tier = tier

    def check_tier_mover(self, what: str) -> None:
        if self.owned and not in_policy_call():
            raise OwnershipError(
                f"chunk {self.index}: only a placement policy, inside a hook the engine calls, may {what} "
                "(see [Note: who moves a chunk])")

    def check_state_mover(self, what: str) -> None:
        if self.owned and in_policy_call():
            raise OwnershipError(
                f"chunk {self.index}: a placement policy may not {what}; only the engine gathers and releases "
                "(see [Note: who moves a chunk])")

    def check_state(self, *states: ChunkState) -> None:
        if self.state not in states:
            raise ZeroError(f"chunk {self.index} is {self.state.value}, expected one of {[s.value for s in states]}; "
                            "this is a bug in zero or in a plugin that drives chunks directly")

    @property
    def is_gathered(self) -> bool:
        """Whether the full buffer exists or is being filled (GATHERING counts: it needs no new all-gather)."""
        return self.state is ChunkState.GATHERED or self.state is ChunkState.GATHERING

    @property
    def post_forward_copy(self) -> torch.Tensor | None:
        """The part a forward kept in SHARDED_POST_FORWARD (``None`` in every other state)."""
        return self._post_forward_copy

    def take_post_forward_copy(self) -> torch.Tensor:
        """SHARDED_POST_FORWARD -> SHARDED: hand over the kept part (to the all-gather that uses it)."""
        self.check_state(ChunkState.SHARDED_POST_FORWARD)
        copy, self._post_forward_copy = self._post_forward_copy, None
        assert copy is not None  # kept in every SHARDED_POST_FORWARD
        self.state = ChunkState.SHARDED
        return copy

    def drop_post_forward_copy(self) -> None:
        """SHARDED_POST_FORWARD -> SHARDED: no backward will use the kept part (no-op in other states)."""
        if self.state is ChunkState.SHARDED_POST_FORWARD:
            self._post_forward_copy = None
            self.state = ChunkState.SHARDED


    def begin_gather(self, pending: Any) -> None:
        """SHARDED -> GATHERING: allocate the full buffer for an all-gather about to be issued
        (:mod:`zero_core.chunks._collectives`), whose completion object ``pending`` fills it by the time
        ``pending.wait()`` returns: the buffer is taken before the call and the state changes here, never inside
        the collective (see [Note: allocation apart from the call] in ``zero_core.chunks._collectives``). A kept
        post-forward part is dropped (a gather of kept parts takes them with :meth:`take_post_forward_copy` first)."""
        self.drop_post_forward_copy()
        self.check_state(ChunkState.SHARDED)
        self.full.untyped_storage().resize_(self.size * self.full.element_size())
        advise_huge_pages(self.full)  # see [Note: huge pages for the engine's host buffers]
        self.streams.allocated(self.full, self.streams.compute)
        self._pending_gather = pending
        self.state = ChunkState.GATHERING

    def wait(self) -> None:
        """GATHERING -> GATHERED: wait for the in-flight all-gather (no-op in other states)."""
        if self.state is ChunkState.GATHERING:
            pending, self._pending_gather = self._pending_gather, None
            pending.wait()
            self.streams.read(self.full, self.streams.compute)  # what the modules compute with from here
            self._to_gathered()

    def _to_gathered(self) -> None:
        for slot, view in zip(self.slots, self._views):
            slot.param.data = view
        self.state = ChunkState.GATHERED

    def release(self, *, keep_copy: bool = False) -> None:
        """GATHERED -> SHARDED: free the full buffer's storage; parameters become empty tensors.

        ``keep_copy`` (a forward's release, with ``reshard_after_forward=k``): GATHERED ->
        SHARDED_POST_FORWARD, keeping this rank's ``1/k`` of the gathered values, so the backward
        gathers them inside its group of ``k`` ranks (:func:`~zero_core.chunks._collectives.gather_chunk`
        uses the copy, then drops it)."""
        if self.persistent:
            return
        self.check_state_mover("release it")
        self.wait()
        self.check_state(ChunkState.GATHERED)
        kept = None
        if keep_copy and self.comms is not None and self.comms.sub is not None:
            k = self.comms.sub.world_size
            rank_major = torch.empty(self.size, dtype=self.dtype, device=self.device)
            self.layout.copy_in(self.full, rank_major)
            part = self.size // k
            at = self.comms.sub.rank * part
            kept = rank_major[at : at + part].clone()
            del rank_major
        self.streams.dropped(self.full)
        self.full.untyped_storage().resize_(0)
        for slot in self.slots:
            slot.param.data = self._empty
        self._post_forward_copy = kept
        self.state = ChunkState.SHARDED if kept is None else ChunkState.SHARDED_POST_FORWARD


    def compute_shard(self) -> torch.Tensor:
        """This rank's shard in the compute dtype, on the compute device: what an all-gather sends."""
        if self._shard is None:
            return self._pack(self.layout.own_pieces(self.full), self.dtype)
        return to_compute_device(self._shard, self.device, self.dtype, streams=self.streams)

    def refresh_own_slice(self) -> None:
        """Copy the updated master shard into this rank's pieces of a kept full buffer (nothing to do while the
        buffer holds the master: ``shard_is_view``)."""
        # a shard out of memory (on disk) was copied here by its placement policy before it left
        if self._shard is not None and self.shard_in_memory:
            self.layout.scatter_own(to_compute_device(self._shard, self.device, self.dtype, streams=self.streams), self.full)

    def pack_own(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's pieces of the kept full buffer packed into ``out`` (``shard_size`` elements, compute
        dtype): what an after-step all-gather sends."""
        return self._pack(self.layout.own_pieces(self.full), self.dtype, out)

    def replace_shard(self, shard: torch.Tensor) -> None:
        """Make ``shard`` (same size and dtype, any device) the master shard, keeping the sharded parameters.

        Each sharded parameter's local tensor is re-pointed, never replaced, so the optimizer's
        state keeps its keys. Placement policies call this at any time between uses; the old
        shard's storage is dropped with its last reference. To take a shard out of memory (to
        disk), pass :func:`zero_core.interfaces.placement.absent_shard`.
        """
        self.check_tier_mover("move its shard")
        if shard.shape != (self.shard_size,) or shard.dtype != self.master_dtype:
            raise PlanError(
                f"chunk {self.index}'s shard must be a {self.master_dtype} tensor of shape ({self.shard_size},), "
                f"got {shard.dtype} {tuple(shard.shape)}"
            )
        self._shard = shard
        self.shard_is_view = False
        self._shard_in_group = False
        self.shard_moves += 1
        if shard.stride(0) == 0:  # absent: every piece is a stand-in of the right size
            self.pieces = [shard[: s.piece] for s in self.slots]
        else:
            self.pieces = self.layout.shard_pieces(shard)
        for seg in self.segments:
            repoint(seg.param, self.layout.local(seg.slot, self.pieces[seg.slot]))

    @property
    def shard_in_memory(self) -> bool:
        """False while the shard is :func:`~zero_core.interfaces.placement.absent_shard` (on disk)."""
        return self._shard is None or self.shard_size == 0 or self._shard.stride(0) != 0


    @property
    def shard_device(self) -> torch.device:
        """Where the master shard is (the compute device while the kept full buffer holds it)."""
        return self._shard.device if self._shard is not None else self.device

    # -- accounting -----------------------------------------------------------------
    @property
    def padding(self) -> int:
        return self.size - self.used

    @property
    def shard_bytes(self) -> int:
        return self.shard_size * self.master_dtype.itemsize

    @property
    def full_bytes(self) -> int:
        return self.size * self.full.element_size()

    def __repr__(self) -> str:
        return (
            f"Chunk(index={self.index}, params={len(self.slots)}, used={self.used}, size={self.size}, "
            f"shard={self.shard_size}, state={self.state.value}, tier={self.tier.value})"
        )

