"""Chunks: flat buffers of parameters, sharded evenly over the data-parallel ranks.

[Note: parameter views]
While a chunk is gathered, every parameter it holds is a view into the chunk's
``full`` buffer (``param.data = full[offset:offset + numel].view(shape)``), so modules
and autograd see ordinary parameters. Releasing frees the buffer's storage in place
(``untyped_storage().resize_(0)``) and points each parameter at an empty tensor, so
code that touches a parameter of a sharded chunk fails with a shape error instead of
reading freed memory. Gathering re-allocates the same storage object and points the
parameters back at their views. Tensors autograd saved in forward (``weight.t()`` and
the like) are views of that same storage, so they are valid again after the backward
re-gather.

Each rank owns the slice ``[rank * shard_size, (rank + 1) * shard_size)`` of the
full buffer; it lives in ``shard``, and the next gather publishes its updates.

[Note: stages and dtypes]
What a chunk keeps between steps depends on the stage and the compute dtype:

=====  ==========================================  =========================================
stage  parameters                                  gradients
=====  ==========================================  =========================================
1      full buffer kept; master shard              one full-size buffer kept (replicated);
                                                   this rank's mean lands in its own slice
2      full buffer kept; master shard              full-size buffer only during backward;
                                                   the mean shard is kept
3      full buffer only while gathered; shard      as stage 2
=====  ==========================================  =========================================

The master shard is in the parameters' own dtype. When the compute dtype is the
same, a kept full buffer holds the master shard as a view of its own slice, so stages
1 and 2 hold parameters once. With 16-bit compute, the full buffer is 16-bit and the
master shard a separate fp32 tensor; gathers send the shard cast to 16 bits. Gradients
accumulate in the compute dtype, are cast to the reduce dtype for the reduce-scatter,
and reach the optimizer in the master dtype, divided by ``world_size x loss scale``.
After a step, stages 1 and 2 refresh their own slice from the master shard and
all-gather the updated slices in place.

[Note: optimizer segments]
The optimizer does not see the shard as one tensor. It sees one ``nn.Parameter`` per
piece of a parameter that falls into this rank's shard (a *segment*, a view into
``shard``). So a parameter that got no gradient on any rank keeps ``grad=None`` and
torch's optimizers skip it exactly as they would in one process (no weight decay, no
step count), per-group hyperparameters apply per parameter, and padding carries no
optimizer state. Elementwise optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, ...)
therefore match single-process training; optimizers that look at a whole tensor
(trust ratios, factored second moments) see each rank's piece instead.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zero_core._state import ChunkState, MemoryTier
from zero_core.comm import CommBackend, Pending

__all__ = ["BufferPool", "Chunk", "ChunkSpec", "ParamInfo", "ParamSlot", "Segment"]


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """A parameter as the strategy sees it when planning.

    Attributes:
        name: Fully qualified name (the first one, for parameters shared under several names).
        param: The parameter itself.
        group: Index of the optimizer param group that holds it, or ``None``.
    """

    name: str
    param: nn.Parameter
    group: int | None

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def key(self) -> tuple[object, ...]:
        """Parameters may share a chunk only if these agree."""
        return (self.param.dtype, self.param.requires_grad, self.group)


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
    """Where one parameter lives inside its chunk's full buffer."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


@dataclass(frozen=True, slots=True)
class Segment:
    """The part of one parameter inside this rank's shard. See [Note: optimizer segments].

    Attributes:
        slot: Index of the parameter in the chunk's slots.
        begin: Offset of the segment inside the shard.
        param: What the optimizer updates: a view of the shard.
    """

    slot: int
    begin: int
    param: nn.Parameter


class BufferPool:
    """Reusable full-size buffers (gradients, receive buffers), keyed by (size, dtype, device).

    Fresh multi-megabyte CPU allocations are mapped anew and page-faulted on first touch,
    which cost about as much as the gradient copy itself; a pool keeps the few buffers a
    backward has in flight at once. Thread-safe: the reduction waiter returns buffers.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        # Bytes of buffers taken and not given back (in use by a backward or a reduction in flight).
        self.lent = 0

    def take(self, size: int, dtype: torch.dtype, device: torch.device, *, zeroed: bool = True) -> torch.Tensor:
        """A buffer of ``size`` elements, zero-filled unless ``zeroed=False`` (a buffer about to be overwritten)."""
        with self._lock:
            free = self._free.get((size, dtype, device))
            buf = free.pop() if free else None
            self.lent += size * dtype.itemsize
        if buf is None:
            return torch.zeros(size, dtype=dtype, device=device) if zeroed else torch.empty(size, dtype=dtype, device=device)
        return buf.zero_() if zeroed else buf

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault((buf.numel(), buf.dtype, buf.device), []).append(buf)
            self.lent -= buf.numel() * buf.element_size()

    def keep(self, buf: torch.Tensor) -> None:
        """``buf`` was taken and will never come back (it became a gradient): stop counting it as lent."""
        with self._lock:
            self.lent -= buf.numel() * buf.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the idle buffers the pool keeps."""
        with self._lock:
            return sum(b.numel() * b.element_size() for bufs in self._free.values() for b in bufs)


class Chunk:
    """A flat, evenly sharded buffer of parameters. See [Note: parameter views] and [Note: stages and dtypes]."""

    def __init__(
        self, index: int, spec: ChunkSpec, *, rank: int, world_size: int, device: torch.device,
        pool: BufferPool | None = None, stage: int = 3, compute_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None, gradient_predivide_factor: float = 1.0, keep_gathered: bool = False,
    ) -> None:
        if spec.size % world_size:
            raise ValueError(f"chunk size {spec.size} is not a multiple of the world size {world_size}")
        if spec.used > spec.size:
            raise ValueError(f"chunk {index} holds {spec.used} elements but its size is {spec.size}")
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        first = spec.params[0]
        # Identity and layout: fixed for the chunk's life.
        self.index = index
        self.size = spec.size
        self.world_size = world_size
        self.rank = rank
        self.shard_size = spec.size // world_size
        self.device = device
        self.stage = stage
        # The optimizer updates the shard in the parameters' own dtype; forward and backward run in ``dtype``.
        self.master_dtype = first.param.dtype
        floating = self.master_dtype.is_floating_point
        self.dtype = compute_dtype if (compute_dtype is not None and floating) else self.master_dtype
        self.reduce_dtype = reduce_dtype if (reduce_dtype is not None and floating) else self.master_dtype
        self.predivide = float(gradient_predivide_factor)
        self.requires_grad = first.param.requires_grad
        self.group = first.group
        self.slots: tuple[ParamSlot, ...] = self._layout(spec.params)
        self.used = spec.used
        # Stages 1 and 2 keep the full buffer for the whole run, and so does a single rank; at stage 3 a
        # placement policy may keep some chunks gathered too (zero-offload's shard_param_frac).
        self.persistent = stage < 3 or world_size == 1 or keep_gathered
        # In one dtype, a kept full buffer holds the shard: the optimizer updates it in place.
        self.shard_is_view = self.persistent and self.dtype == self.master_dtype
        # Runtime state, changed only through the transition methods below.
        self.state = ChunkState.GATHERED
        self.tier = MemoryTier.DEVICE
        self.full = torch.empty(self.size, dtype=self.dtype, device=device)
        self._views = tuple(self.full[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots)
        if not self.persistent:  # allocated by pack() (or never, by begin_fill()): building every chunk costs nothing
            self.full.untyped_storage().resize_(0)
        self._empty = torch.empty(0, dtype=self.dtype, device=device)
        self._pending_gather: Pending | None = None
        self.pool = pool or BufferPool()
        self.shard: torch.Tensor = self.full
        self.segments: tuple[Segment, ...] = ()
        # Mean gradient of this rank's shard from the last backward, until published to segments.
        self.reduced_grad: torch.Tensor | None = None
        # Per slot: did the parameter get a gradient on this rank since the last publish (every backward of
        # a no_sync accumulation included)? Set by the engine's post-accumulate-grad hook.
        self.got_grad = [False] * len(self.slots)
        # Full-size gradient buffer of the running backward; parameters' .grad are views of it.
        self._grad_flat: torch.Tensor | None = None
        # Stage 1 keeps one full-size gradient buffer for the whole run (gradients are replicated).
        self.grad_full: torch.Tensor | None = None
        # Where reduced gradients go; None: where the master shard is. Set by placement policies.
        self.grad_device: torch.device | None = None

    @staticmethod
    def _layout(params: Sequence[ParamInfo]) -> tuple[ParamSlot, ...]:
        slots, offset = [], 0
        for info in params:
            slots.append(ParamSlot(info.name, info.param, offset, info.numel, info.param.shape))
            offset += info.numel
        return tuple(slots)

    # -- setup ---------------------------------------------------------------------
    def pack(self, comm: CommBackend, *, broadcast_from_rank0: bool) -> None:
        """Copy the parameters into the chunk, keep this rank's shard, point params at views.

        Each parameter's original storage is dropped as soon as it is copied, so at no
        point does a rank hold more than its parameters plus one full chunk (two when the
        compute dtype differs: the master copy is staged in the parameters' dtype).
        """
        self._assert_state(ChunkState.GATHERED)
        with torch.no_grad():
            self.full.untyped_storage().resize_(self.size * self.full.element_size())
            self.full.zero_()
            staging = self.full if self.dtype == self.master_dtype else torch.zeros(
                self.size, dtype=self.master_dtype, device=self.device)
            for slot, view in zip(self.slots, self._views):
                staging[slot.offset : slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
                slot.param.data = view
            if broadcast_from_rank0 and self.world_size > 1:
                comm.broadcast(staging, src=0)
            begin = self.rank * self.shard_size
            if staging is not self.full:
                self.full.copy_(staging)
            if self.shard_is_view:
                self.shard = self.full[begin : begin + self.shard_size]
            else:
                self.shard = staging[begin : begin + self.shard_size].clone()
            del staging
            if not self.persistent:
                self.release()
        if self.requires_grad:
            self.segments = self._segments()

    def begin_fill(self) -> None:
        """Allocate this rank's shard (and a kept full buffer), zeroed, for values that arrive one parameter at a time.

        The alternative to :meth:`pack` for parameters that hold no values (meta tensors under
        :func:`zero_core.lazy_init`): the values come through :meth:`fill`, and a stage-3 chunk
        never allocates its full buffer here.
        """
        self._assert_state(ChunkState.GATHERED)
        begin = self.rank * self.shard_size
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
                self.shard = (self.full[begin : begin + self.shard_size] if self.shard_is_view
                              else torch.zeros(self.shard_size, dtype=self.master_dtype, device=self.device))
            else:
                self.shard = torch.zeros(self.shard_size, dtype=self.master_dtype, device=self.device)
                for slot in self.slots:
                    slot.param.data = self._empty
                self.state = ChunkState.SHARDED
        if self.requires_grad:
            self.segments = self._segments()

    def own_range(self, slot: int) -> tuple[int, int]:
        """The elements ``[lo, hi)`` of parameter ``slot`` (flattened) that fall into this rank's shard (``lo == hi``: none)."""
        s = self.slots[slot]
        begin = self.rank * self.shard_size
        lo = min(max(begin, s.offset), s.offset + s.numel)
        hi = max(min(begin + self.shard_size, s.offset + s.numel), lo)
        return lo - s.offset, hi - s.offset

    @torch.no_grad()
    def fill(self, slot: int, values: torch.Tensor, *, lo: int = 0) -> None:
        """Write parameter ``slot``'s values (flattened, starting at element ``lo``) into this rank's shard.

        ``values`` must cover at least :meth:`own_range`; only that part is read. The shard
        must be in memory (see ``PlacementPolicy.before_load``). A kept full buffer is brought
        up to date by :meth:`publish_parameters` once every slot is filled.
        """
        s = self.slots[slot]
        begin = self.rank * self.shard_size
        a, b = self.own_range(slot)
        if a < b:
            self.shard[s.offset + a - begin : s.offset + b - begin].copy_(values[a - lo : b - lo])

    def _segments(self) -> tuple[Segment, ...]:
        begin, end = self.rank * self.shard_size, (self.rank + 1) * self.shard_size
        segments = []
        for i, slot in enumerate(self.slots):
            lo, hi = max(slot.offset, begin), min(slot.offset + slot.numel, end)
            if lo < hi:
                segments.append(Segment(i, lo - begin, nn.Parameter(self.shard[lo - begin : hi - begin])))
        return tuple(segments)

    # -- transitions ----------------------------------------------------------------
    def _assert_state(self, *states: ChunkState) -> None:
        assert self.state in states, f"chunk {self.index} is {self.state.value}, expected one of {[s.value for s in states]}"

    @property
    def is_gathered(self) -> bool:
        """Whether the full buffer exists or is being filled (GATHERING counts: it needs no new all-gather)."""
        return self.state is not ChunkState.SHARDED

    def gather(self, comm: CommBackend, *, async_op: bool = False) -> None:
        """SHARDED -> GATHERED (or GATHERING with ``async_op``): re-allocate the full buffer and all-gather into it."""
        if self.persistent:
            return
        self._assert_state(ChunkState.SHARDED)
        self.full.untyped_storage().resize_(self.size * self.full.element_size())
        pending = comm.all_gather(self.full, self._compute_shard(), async_op=async_op)
        if async_op and pending is not None:
            self._pending_gather = pending
            self.state = ChunkState.GATHERING
        else:
            self._to_gathered()

    def begin_gather(self, pending: Pending) -> None:
        """SHARDED -> GATHERING for an all-gather someone else issued (a gather group's), which
        fills the full buffer by the time ``pending.wait()`` returns."""
        self._assert_state(ChunkState.SHARDED)
        self.full.untyped_storage().resize_(self.size * self.full.element_size())
        self._pending_gather = pending
        self.state = ChunkState.GATHERING

    def wait(self) -> None:
        """GATHERING -> GATHERED: wait for the in-flight all-gather (no-op in other states)."""
        if self.state is ChunkState.GATHERING:
            pending, self._pending_gather = self._pending_gather, None
            assert pending is not None
            pending.wait()
            self._to_gathered()

    def _to_gathered(self) -> None:
        for slot, view in zip(self.slots, self._views):
            slot.param.data = view
        self.state = ChunkState.GATHERED

    def release(self) -> None:
        """GATHERED -> SHARDED: free the full buffer's storage; parameters become empty tensors."""
        if self.persistent:
            return
        self.wait()
        self._assert_state(ChunkState.GATHERED)
        self.full.untyped_storage().resize_(0)
        for slot in self.slots:
            slot.param.data = self._empty
        self.state = ChunkState.SHARDED

    def gather_for_peers(self, comm: CommBackend) -> None:
        """Join an all-gather of this chunk that other ranks need, without changing local state."""
        scratch = torch.empty(self.size, dtype=self.dtype, device=self.device)
        comm.all_gather(scratch, self._compute_shard())

    def _compute_shard(self) -> torch.Tensor:
        """This rank's shard in the compute dtype, on the compute device: what an all-gather sends."""
        return self.shard.to(self.device, self.dtype, non_blocking=True)

    def refresh_own_slice(self) -> torch.Tensor:
        """Copy the updated master shard into this rank's slice of a kept full buffer; return the slice."""
        begin = self.rank * self.shard_size
        own = self.full[begin : begin + self.shard_size]
        # a shard out of memory (on disk) was copied here by its placement policy before it left
        if not self.shard_is_view and self.shard_in_memory:
            with torch.no_grad():
                own.copy_(self.shard)
        return own

    def move_shard(self, device: torch.device) -> None:
        """Keep the master shard (and so its gradients and optimizer states) on ``device`` from now on.

        Gathers copy the shard to the compute device; reduced gradients are moved to the
        shard's device, not copied. Host shards are pinned when the compute device is CUDA.
        """
        if self.shard.device == device:
            return
        pin = device.type == "cpu" and self.device.type == "cuda"
        with torch.no_grad():
            shard = torch.empty(self.shard_size, dtype=self.master_dtype, device=device, pin_memory=pin)
            shard.copy_(self.shard)
        self.replace_shard(shard)

    def replace_shard(self, shard: torch.Tensor) -> None:
        """Make ``shard`` (same size and dtype, any device) the master shard, keeping the optimizer's segments.

        Each segment's parameter is re-pointed (``param.data = ...``), never replaced, so the
        optimizer's state keeps its keys. Placement policies call this at any time between
        uses; the old shard's storage is dropped with its last reference. To take a shard
        out of memory (to disk), pass :meth:`absent_shard`.
        """
        if shard.shape != (self.shard_size,) or shard.dtype != self.master_dtype:
            raise ValueError(
                f"chunk {self.index}'s shard must be a {self.master_dtype} tensor of shape ({self.shard_size},), "
                f"got {shard.dtype} {tuple(shard.shape)}"
            )
        self.shard = shard
        self.shard_is_view = False
        for seg in self.segments:
            seg.param.data = shard[seg.begin : seg.begin + seg.param.numel()]

    def absent_shard(self) -> torch.Tensor:
        """A stand-in for a shard that is not in memory: the right shape, one shared element, NaN.

        In-place updates of it fail ("more than one element of the written-to tensor refers to
        a single memory location") and reads give NaN, so an optimizer or gather that touches a
        shard the policy did not bring back fails loudly instead of using stale values.
        """
        fill = float("nan") if self.master_dtype.is_floating_point else 0
        return torch.full((1,), fill, dtype=self.master_dtype).expand(self.shard_size)

    @property
    def shard_in_memory(self) -> bool:
        """False while the shard is :meth:`absent_shard` (on disk)."""
        return self.shard_size == 0 or self.shard.stride(0) != 0

    def publish_parameters(self, comm: CommBackend, *, async_op: bool = False) -> Pending | None:
        """After an optimizer step, bring a kept full buffer up to date with the updated shards.

        Stages 1 and 2: the rank's slice is refreshed from its master shard and the
        slices are all-gathered in place. One rank with a separate master: a cast copy.
        Stage 3 needs nothing: the next gather reads the shard.
        """
        if not self.persistent:
            return None
        self._assert_state(ChunkState.GATHERED)
        own = self.refresh_own_slice()
        if self.world_size == 1:
            return None
        return comm.all_gather(self.full, own, async_op=async_op)

    @property
    def has_unreduced_gradients(self) -> bool:
        """Gradients accumulated (inside ``no_sync``) but not reduce-scattered yet."""
        return self._grad_flat is not None

    def prepare_gradients(self) -> None:
        """Point every parameter's ``.grad`` at a zeroed full-size buffer before backward reaches it.

        Autograd then accumulates in place into the buffer (no per-parameter gradient
        tensors, no copy), and the buffer is what gets reduce-scattered. Stage 1 reuses
        its one kept buffer; the other stages borrow one from the pool for this backward.
        """
        if self._grad_flat is not None or not self.requires_grad:
            return
        self._grad_flat = self._take_grad_buffer()
        for slot in self.slots:
            if slot.param.grad is None:
                slot.param.grad = self._grad_flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def _take_grad_buffer(self) -> torch.Tensor:
        if self.stage != 1:
            return self.pool.take(self.size, self.dtype, self.device)
        if self.grad_full is None:
            self.grad_full = torch.zeros(self.size, dtype=self.dtype, device=self.device)
            return self.grad_full
        # Gradients published from the last backward may be views of this buffer's own slice (they
        # accumulate until a step): move them out before the buffer is zeroed for this backward.
        storage = self.grad_full.untyped_storage().data_ptr()
        for seg in self.segments:
            grad = seg.param.grad
            if grad is not None and grad.untyped_storage().data_ptr() == storage:
                seg.param.grad = grad.clone()
        return self.grad_full.zero_()

    def reduce_gradients(self, comm: CommBackend, *, loss_scale: float = 1.0) -> _Reduction:
        """Start reducing this backward's parameter gradients to this rank's shard (mean over ranks).

        Returns the handle that completes it, leaving the result, in the master dtype and
        divided by ``loss_scale``, in ``reduced_grad``. Parameters that got no gradient on
        this rank contribute zeros. Gradients autograd placed elsewhere than the prepared
        buffer are copied in; every ``.grad`` is dropped.
        """
        flat, self._grad_flat = self._grad_flat, None
        if flat is None:
            flat = self._take_grad_buffer()
        for slot in self.slots:
            grad = slot.param.grad
            if grad is not None:
                target = flat[slot.offset : slot.offset + slot.numel]
                if grad.data_ptr() != target.data_ptr():
                    target.copy_(grad.reshape(-1))
                slot.param.grad = None
        pooled = flat if flat is not self.grad_full else None
        send = flat if flat.dtype == self.reduce_dtype else flat.to(self.reduce_dtype)
        if send is not flat and pooled is not None:  # the cast copy is what travels: the buffer is free again
            self.pool.give(pooled)
            pooled = None
        divisor = self.world_size * loss_scale
        if self.predivide != 1.0 and self.world_size > 1:
            send.div_(self.predivide)  # flat is consumed by this reduction: dividing in place is safe
            divisor /= self.predivide
        if self.world_size == 1:  # the buffer itself becomes the gradient: never back to the pool
            if pooled is not None:
                self.pool.keep(pooled)
            return _Reduction(self, None, send, None, divisor)
        begin = self.rank * self.shard_size
        if self.stage == 1 and send is flat:
            reduced = flat[begin : begin + self.shard_size]  # in place: the gradient stays in the kept buffer
        else:
            reduced = torch.empty(self.shard_size, dtype=self.reduce_dtype, device=self.device)
        pending = comm.reduce_scatter(reduced, send, async_op=True)
        if pooled is not None and getattr(pending, "input_released", False):
            self.pool.give(pooled)  # a bucketing backend copied it: reuse it for the next gradient now
            pooled = None
        return _Reduction(self, pending, reduced, pooled, divisor)

    def publish_gradients(self, present: Sequence[bool]) -> None:
        """Hand the reduced gradient to the optimizer's segments, as autograd would to parameters.

        ``present[i]`` says whether slot ``i`` got a gradient on any rank; segments of the
        others keep their ``.grad`` untouched (``None`` after ``zero_grad``), so the
        optimizer skips them. Gradients add to existing ones, so several backwards
        before a step accumulate.
        """
        reduced, self.reduced_grad = self.reduced_grad, None
        self.got_grad = [False] * len(self.slots)
        if reduced is None:
            return
        for seg in self.segments:
            if not present[seg.slot]:
                continue
            piece = reduced[seg.begin : seg.begin + seg.param.numel()]
            if seg.param.grad is None:
                seg.param.grad = piece
            else:
                seg.param.grad.add_(piece)

    # -- accounting -----------------------------------------------------------------
    @property
    def padding(self) -> int:
        return self.size - self.used

    @property
    def shard_bytes(self) -> int:
        return self.shard_size * self.shard.element_size()

    @property
    def full_bytes(self) -> int:
        return self.size * self.full.element_size()

    def __repr__(self) -> str:
        return (
            f"Chunk(index={self.index}, params={len(self.slots)}, used={self.used}, size={self.size}, "
            f"shard={self.shard_size}, state={self.state.value}, tier={self.tier.value})"
        )


class _Reduction:
    """A chunk's gradient reduce-scatter in flight; ``complete()`` stores the mean in the chunk."""

    def __init__(
        self, chunk: Chunk, pending: Pending | None, reduced: torch.Tensor, pooled: torch.Tensor | None,
        divisor: float,
    ) -> None:
        self._chunk, self._pending, self._reduced, self._pooled = chunk, pending, reduced, pooled
        self._divisor = divisor

    def complete(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        if self._reduced is not None:
            # moved to where the master shard lives (the host, when offloaded), never copied and kept twice
            chunk = self._chunk
            grad = self._reduced.to(chunk.grad_device or chunk.shard.device, chunk.master_dtype)
            if self._divisor != 1.0:
                grad.div_(self._divisor)
            self._chunk.reduced_grad = grad
            self._reduced = None
        if self._pooled is not None:  # the collective is done with it
            self._chunk.pool.give(self._pooled)
            self._pooled = None
