"""A chunk's gradients, from the buffer autograd accumulates into to the optimizer's ``.grad``.

[Note: a gradient's three places]
A gradient lives in exactly one of three places at a time, all owned by :class:`ChunkGradients`:

1. the *full-size buffer* of the running backward (``.grad`` of every unsharded parameter is a
   view of it, so autograd accumulates in place; stage 1 keeps one for the whole run); at one rank, where the
   reduction is the identity, autograd's own gradient on the unsharded parameter instead, moved from there to
   place 3 as it is (see [Note: gradients handed over as autograd made them]);
2. the *reduced pieces*: this rank's mean, one piece per parameter, from the reduction's
   completion until the engine hands them over;
3. the sharded parameter's ``.grad``: what the optimizer reads, added to across backwards
   until ``zero_grad``.

(2 and 3 overlap while a reduction's pieces wait for the end of backward: see [Note: gradients handed
over as they land].)

:meth:`ChunkGradients.take_for_reduction` moves 1 to the collectives, :meth:`~ChunkGradients.land`
receives 2 from them (on the reducer's waiter thread: it touches nothing else), and
:meth:`~ChunkGradients.hand_over` (and before it, where exact, :meth:`~ChunkGradients.hand_over_landed`)
turns 2 into 3. :meth:`~ChunkGradients.discard` empties 1 and 2.
The object reads its chunk's layout and sharded parameters, which are fixed once the chunk is
packed, and is the only writer of the gradient state.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from zero_core.base._accounting import engine_work
from zero_core.chunks._slots import to_local

__all__ = ["ChunkGradients"]


def _idle_references() -> int:
    """What ``sys.getrefcount`` says of an object held by one list and one local variable and nothing else: the
    shape of the check in :meth:`ChunkGradients._lend` (measured, not assumed: the interpreter's count of the call's
    own argument differs between Python versions)."""
    lent = [object()]
    held = lent[0]
    return sys.getrefcount(held)


_IDLE_REFERENCES = _idle_references()
# Tensor._use_count (the C++ tensor's strong references): without it no wrapper is ever lent twice
_CAN_COUNT_USES = hasattr(torch.Tensor, "_use_count")


class ChunkGradients:
    """The gradient state of one chunk; see [Note: a gradient's three places]."""

    def __init__(self, chunk: Any) -> None:
        # The chunk (zero_core.chunks.chunk.Chunk, typed loosely: that module sits above this one): read for its layout,
        # its storage's dtype and device, its pool and its sharded parameters; never written.
        self._chunk = chunk
        # 1: the running backward's full-size buffer; stage 1's buffer kept across steps (gradients are replicated).
        self._flat: torch.Tensor | None = None
        # Where each slot's view of ``_flat`` begins (data_ptr), taken once with the buffer: every later gradient of
        # the chunk is checked against it (a gradient hook per parameter, every backward). Addresses, not the views:
        # a view held here would be a second reference to the parameter's ``.grad``, and autograd accumulates in
        # place only into a gradient nothing else holds (it would add out of place, and every gradient be copied).
        self._ptrs: list[int] = []
        # Each slot's geometry, read from the layout once (it is fixed once the chunk is packed): see [Note: one view
        # op per gradient].
        self._local_geometry: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self._full_geometry: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
        # Each slot's DTensor wrapper arguments for its reduced gradient (its sharded parameter's spec, with the
        # spec's global shape and strides as tuples), read once per spec: see [Note: one view op per gradient].
        self._wrap_args: list[tuple[Any, tuple[int, ...], tuple[int, ...]] | None] = [None] * len(chunk.slots)
        # Each slot's DTensor gradient wrapper from its last hand-over, lent again once nothing else holds it, and
        # whether any may still hold its gradient: see [Note: gradient wrappers lent again].
        self._wrappers: list[Any] = [None] * len(chunk.slots)
        self._lent = False
        # At one rank: the buffer a reduction took and each slot's view of it that was its unsharded parameter's
        # ``.grad`` (None where autograd put the gradient elsewhere), from take_for_reduction to the hand-over, and
        # whether those views are the reduced pieces too (asked once); see [Note: one view op per gradient].
        self._views: tuple[torch.Tensor, list[torch.Tensor | None]] | None = None
        self._views_are_pieces: bool | None = None
        self.kept: torch.Tensor | None = None
        # 2: this rank's mean gradient from the last backward, until handed over: where it landed (a 1-D buffer) and
        # where each slot's piece begins in it, or (``_pieces``) one tensor per slot; see :attr:`reduced`.
        self._landed: tuple[torch.Tensor, list[int]] | None = None
        self._shard_offsets: list[int] | None = None  # where each slot's piece begins in a shard (read once, in land)
        self._pieces: list[torch.Tensor] | None = None
        # Per slot: did the parameter get a gradient on this rank since the last hand-over (every backward of a
        # no_sync accumulation included)? Set by the reducer when autograd accumulates.
        self.got = [False] * len(chunk.slots)
        # Where reduced gradients go; None: where the master shard is. Set by placement policies.
        self.target_device: torch.device | None = None
        # Whether :meth:`hand_over_landed` hands a slot's gradient to its ``.grad`` before the end of backward where
        # that is exact (set by the engine; see [Note: gradients handed over as they land]), and the slots it did so
        # for since the last hand-over or discard.
        self.hands_early = False
        self._early = [False] * len(chunk.slots)
        # Whether the chunk may hand autograd's own gradients to its sharded parameters (set by the engine from its
        # placement policy; the chunk's own conditions are added when first asked), and whether the running backward
        # does (set when it begins): see [Note: gradients handed over as autograd made them].
        self.may_hand_directly = False
        self._directly_ok: bool | None = None
        self.direct = False

    @property
    def unreduced(self) -> bool:
        """Gradients accumulated (inside ``no_sync``) but not reduce-scattered yet."""
        return self._flat is not None

    @property
    def device(self) -> torch.device:
        """Where reduced gradients land: ``target_device`` when a placement policy set one, else the master shard's."""
        return self.target_device if self.target_device is not None else self._chunk.shard_device

    def prepare(self) -> None:
        """Point every trainable parameter's ``.grad`` at a zeroed full-size buffer before backward reaches it.

        Autograd then accumulates in place into the buffer (no per-parameter gradient
        tensors, no copy), and the buffer is what gets reduce-scattered. Stage 1 reuses
        its one kept buffer; the other stages borrow one from the pool for this backward.
        """
        if self._flat is not None or not self._chunk.requires_grad:
            return
        for slot, view in zip(self._chunk.slots, self._set_flat(self._take())):
            if slot.param.grad is None and slot.param.requires_grad:
                slot.param.grad = view

    def _set_flat(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Take ``flat`` as this backward's buffer; each slot's view of it, in the parameter's shape.

        [Note: one view op per gradient]
        A slot's view of a buffer is made with one ``as_strided`` (about 1 us) instead of a slice and a
        ``view`` (two ops, about 2 us), from each slot's shape, strides and offset read once: a backward makes
        two such views per parameter (its ``.grad`` into this buffer, its reduced piece for the sharded
        ``.grad``), about 400 on a 48-block model. Both buffers are 1-D and contiguous, so the view is the
        same tensor the slice and ``view`` made. Shapes are kept as plain tuples: torch parses a ``torch.Size``
        argument more slowly than a tuple (about 0.3 us an ``as_strided``, the same for a DTensor wrapper's
        shape), and the hand-over makes each sharded ``.grad``'s DTensor wrapper from arguments read once per
        slot instead of from its spec's properties and the view's dtype and device each time.

        At one rank the reduction lands in this very buffer (``reduce_gradients`` sends it and it becomes the
        gradient), where each slot's reduced piece has its full view's shape, strides and offset: the hand-over
        then reuses the views autograd accumulated into (held from ``take_for_reduction``, once no ``.grad``
        points at them) instead of making each slot's view a second time."""
        self._flat = flat
        geometry = self._full_geometry
        if not geometry:
            geometry = self._full_geometry = [(tuple(s.shape), _contiguous_stride(s.shape), s.offset)
                                              for s in self._chunk.slots]
        at = flat.storage_offset()
        views = [flat.as_strided(shape, stride, at + offset) for shape, stride, offset in geometry]
        base, size = flat.data_ptr(), flat.element_size()  # a view's address is its offset's, one call per chunk
        self._ptrs = [base + offset * size for _, _, offset in geometry]
        return views

    def adopt(self, index: int) -> None:
        """Parameter ``index``'s gradient has just been accumulated: make sure it lives in this backward's buffer.

        At stages 2 and 3 no buffer is prepared before backward reaches the chunk (see [Note: gradient
        buffers on arrival] in ``zero_core.runtime._engine``): the first gradient to arrive was made by autograd, so the
        buffer is taken now and the gradient copied in, and every other trainable parameter's ``.grad`` points
        at its zeroed view, where autograd accumulates in place as for a prepared buffer.
        """
        self.got[index] = True
        if self._flat is not None:
            grad = self._chunk.slots[index].param.grad
            if grad is None or grad.data_ptr() == self._ptrs[index]:  # autograd added in place: nothing to do
                return
        elif self.direct:  # autograd's gradient stays where it is until the launch hands it over
            return
        self._take_in(index)

    def begin_backward(self, *, sync: bool) -> None:
        """A backward begins (``sync``: outside ``no_sync()``): decide whether it hands gradients over as autograd
        made them. See [Note: gradients handed over as autograd made them]."""
        self.release_idle()  # before this backward makes any gradient: see [Note: gradient wrappers lent again]
        ok = self._directly_ok
        if ok is None:
            chunk = self._chunk
            # autograd gives each unsharded parameter a gradient of its dtype, device, shape and (dense) strides:
            # these make it one of its sharded parameter's too, and are fixed once the chunk is packed
            ok = self._directly_ok = (
                chunk.world_size == 1 and chunk.replicas == 1 and chunk.outer == 1 and chunk.stage != 1
                and (chunk.comms is None or chunk.comms.replicate is None)
                and chunk.dtype == chunk.master_dtype == chunk.reduce_dtype
                and len(chunk.segments) == len(chunk.slots)
                and all(seg.slot == i for i, seg in enumerate(chunk.segments))
                and all(shape == tuple(s.shape) and (not s.param.is_contiguous() or
                                                     stride == _contiguous_stride(s.param.shape))
                        for (shape, stride), s in zip(self._geometry(), chunk.slots)))
        # the master shard where autograd's gradients are (a shard offloaded to the host takes them through the buffer)
        self.direct = (sync and ok and self.may_hand_directly and self._flat is None and self.target_device is None
                       and self._chunk.shard_device == self._chunk.device)

    def hand_over_directly(self) -> bool:
        """The running backward's reduction at one rank, where it is the identity: each gradient autograd made
        becomes its sharded parameter's ``.grad`` as it is. False, with nothing changed, where that would not be
        exact; the caller then reduces as usual.

        [Note: gradients handed over as autograd made them]
        At one rank, with nothing to sum over replicas, no loss scale, and the compute, reduce and master dtypes all
        one, a chunk's reduction is the identity: the buffer ``take_for_reduction`` fills and the views the
        hand-over cuts from it are copies of what autograd made. So a backward that begins outside ``no_sync()``,
        with no buffer taken and the master shard on the compute device (``begin_backward``), takes none: autograd
        keeps each unsharded parameter's gradient where it made it (as in plain PyTorch), and the launch moves it to
        the sharded parameter's ``.grad`` (wrapped as a DTensor under a process group). It does so only where every
        gradient of the chunk is a detached dense tensor (autograd gives it its parameter's dtype, device, shape and
        strides, which at one rank are the sharded parameter's: checked once per chunk) and that ``.grad`` is None
        (the conditions of [Note: gradients handed over as they land]); otherwise the gradients are copied into a
        buffer and reduced as before (``take_for_reduction`` takes one when none was). The engine allows it only under a
        placement policy that neither moves shards after backward nor watches computes: a policy that traces the
        step's memory counts tensors autograd made as activations, and would count these gradients too.
        A ``no_sync()`` backward takes its buffer as before, since its gradients wait there for a later backward."""
        chunk = self._chunk
        device = chunk.shard_device
        if self.target_device is not None or self._flat is not None or device != chunk.device:
            return False
        got, slots, strided = self.got, chunk.slots, torch.strided
        for seg in chunk.segments:
            i = seg.slot
            grad = slots[i].param.grad
            if grad is None:
                if got[i]:  # it arrived and was set to None since: the reduction hands over zeros there
                    return False
                continue
            if (not got[i] or grad.requires_grad or grad.layout is not strided or seg.param.grad is not None
                    or not seg.param.requires_grad):
                return False
        early = self._early
        if chunk.mesh is None:
            for seg in chunk.segments:
                i = seg.slot
                slot = slots[i]
                grad = slot.param.grad
                if grad is not None:
                    seg.param.grad = grad
                    slot.param.grad = None
                    early[i] = True
            return True
        # this runs for every parameter in every backward: see [Note: gradient wrappers lent again]
        lend = self._lend
        for seg in chunk.segments:
            i = seg.slot
            slot = slots[i]
            grad = slot.param.grad
            if grad is not None:
                wrapped = lend(i, seg.param._spec, grad, device)
                slot.param.grad = None
                seg.param.grad = wrapped
                early[i] = True
        return True

    def _lend(self, i: int, spec: Any, local: torch.Tensor, device: torch.device) -> DTensor:
        """``local`` as slot ``i``'s DTensor gradient of sharding ``spec`` on ``device``: the slot's wrapper from
        the last hand-over where nothing else holds it, otherwise a new one (Chunk.wrap of a segment, inlined).

        [Note: gradient wrappers lent again]
        Under a process group each hand-over gives every sharded parameter a DTensor ``.grad``, a Python wrapper
        around the local gradient. Making one costs about 4 us in a step's context and freeing it about 1 more:
        about 1 ms of a 48-block model's step at one rank (195 parameters), of the 3 or so the process group adds
        to a step there. So each slot keeps the wrapper it lent last and lends it again with the new local tensor
        when, after ``zero_grad`` dropped it, nothing else holds it: no Python reference but this one
        (``sys.getrefcount``, against the count :func:`_idle_references` measured for this shape of code), no C++
        one (``Tensor._use_count``: not a ``.grad``, not saved by a graph), no weak reference, no attribute set on
        it, no ``requires_grad``, and the same sharding, dtype and device. Whatever could observe the object
        (a user's reference to an old ``.grad``, a hook, a graph) makes a new one, as without this. An idle wrapper
        would keep its last gradient alive after ``zero_grad``, which plain PyTorch frees: the wrapped model's
        next forward, and the next backward before it makes any gradient (``zero_grad`` may come between the two),
        let those go (:meth:`release_idle`; a wrapper a weak reference can reach is dropped whole)."""
        held = self._wrappers[i]
        if (held is not None and sys.getrefcount(held) == _IDLE_REFERENCES and held._spec is spec
                and held.dtype is local.dtype and held.device == device and not held.requires_grad
                and held._use_count() == 1 and not held.__dict__ and not weakref.getweakrefcount(held)):
            held._local_tensor = local
            self._lent = True
            return held
        args = self._wrap_args[i]
        if args is None or args[0] is not spec:
            args = self._wrap_args[i] = (spec, tuple(spec.shape), tuple(spec.stride))
        wrapped = torch.Tensor._make_wrapper_subclass(
            DTensor, args[1], strides=args[2], storage_offset=0, dtype=local.dtype, device=device,
            layout=torch.strided, requires_grad=False)
        wrapped._spec = spec
        wrapped._local_tensor = local
        if _CAN_COUNT_USES:
            self._wrappers[i] = wrapped
            self._lent = True
        return wrapped

    def release_idle(self) -> None:
        """Let go of the gradients of the wrappers nothing holds any more (``zero_grad`` dropped them): see
        [Note: gradient wrappers lent again]. The wrapped model's forward calls it for every chunk."""
        if not self._lent:
            return
        lent, wrappers = False, self._wrappers
        for i in range(len(wrappers)):
            held = wrappers[i]
            if held is None:
                continue
            if sys.getrefcount(held) == _IDLE_REFERENCES and held._use_count() == 1:
                if weakref.getweakrefcount(held):  # a weak reference can still reach it: let it go whole
                    wrappers[i] = None
                else:
                    held._local_tensor = None
            else:
                lent = True
        self._lent = lent

    @engine_work  # the buffer it may take is model data; the fast path above allocates nothing
    def _take_in(self, index: int) -> None:
        """:meth:`adopt` with something to do: the first gradient of the chunk, or one autograd put elsewhere."""
        slots = self._chunk.slots
        if self._flat is not None:  # replaced behind our back: take it in
            slot = slots[index]
            grad = slot.param.grad
            assert grad is not None
            target = self._flat[slot.offset : slot.offset + slot.numel]
            target.copy_(grad.detach().reshape(-1))  # see [Note: copies without no_grad]
            slot.param.grad = target.view(slot.shape)
            return
        # Always copied, even where autograd's tensor has the buffer's layout: what the engine keeps must be the
        # engine's allocation, or a memory tracer would count it as activations (see zero_core.base._accounting).
        # [Note: copies without no_grad]
        # The buffer never requires grad, and a detached source records nothing, so these copies need no
        # ``torch.no_grad()`` block (about five Python calls each, two per chunk a backward); a gradient with a
        # graph of its own (``create_graph=True``) lands without it, as it did under no_grad.
        for s, view in zip(slots, self._set_flat(self._take())):
            grad = s.param.grad
            if grad is not None:
                view.copy_(grad.detach() if grad.requires_grad else grad)  # detached only where it has a graph
                s.param.grad = view
            elif s.param.requires_grad:
                s.param.grad = view

    def discard(self) -> None:
        """Drop every gradient not yet handed to the optimizer: the running backward's, a ``no_sync()`` window's,
        a reduction's result. The sharded parameters' gradients stay as they are."""
        flat, self._flat, self._ptrs, self._views = self._flat, None, [], None
        if flat is not None and flat is not self.kept:
            self._chunk.pool.give(flat)
        for slot in self._chunk.slots:
            slot.param.grad = None
        if any(self._early):  # they had no gradient before this backward's reduction landed: they have none again
            for seg in self._chunk.segments:
                if self._early[seg.slot]:
                    seg.param.grad = None
            self._early = [False] * len(self._chunk.slots)
        self.reduced = None
        self.got = [False] * len(self._chunk.slots)

    def _take(self) -> torch.Tensor:
        chunk = self._chunk
        if chunk.stage != 1:
            return chunk.pool.take(chunk.size, chunk.dtype, chunk.device)
        if self.kept is None:
            self.kept = torch.zeros(chunk.size, dtype=chunk.dtype, device=chunk.device)
            return self.kept
        # Gradients handed over from the last backward may be views of this buffer's own pieces (they
        # accumulate until a step): move them out before the buffer is zeroed for this backward.
        storage = self.kept.untyped_storage().data_ptr()
        for seg in chunk.segments:
            grad = seg.param.grad
            if grad is not None and to_local(grad).untyped_storage().data_ptr() == storage:
                seg.param.grad = chunk.wrap(seg.slot, to_local(grad).clone())
        return self.kept.zero_()

    def take_for_reduction(self) -> torch.Tensor:
        """Hand over this backward's gradients as one full-size, parameter-major buffer; every ``.grad`` is dropped.

        Gradients autograd placed elsewhere than the prepared buffer are copied in; each rank's
        piece of a replicated (zero-dimensional) parameter carries its gradient, so every rank
        gets the sum. The caller (:func:`zero_core.chunks._collectives.reduce_gradients`) gives a pooled
        buffer back; stage 1's kept buffer is never pooled."""
        chunk = self._chunk
        flat, ptrs, self._flat, self._ptrs = self._flat, self._ptrs, None, []
        if flat is None:
            flat = self._take()
            ptrs = [-1] * len(chunk.slots)  # nothing points into a fresh buffer
        # at one rank, the views autograd accumulated into, for the hand-over (see [Note: one view op per gradient])
        views: list[torch.Tensor | None] | None = [None] * len(ptrs) if chunk.world_size == 1 else None
        for i, (slot, ptr) in enumerate(zip(chunk.slots, ptrs)):  # see [Note: copies without no_grad]
            grad = slot.param.grad
            if grad is not None:
                if grad.data_ptr() != ptr:
                    flat[slot.offset : slot.offset + slot.numel].copy_(grad.detach().reshape(-1))
                elif views is not None:
                    views[i] = grad
                slot.param.grad = None
        self._views = (flat, views) if views is not None else None
        if chunk.layout.has_replicated:
            for slot, region in zip(chunk.slots, chunk.layout.regions(flat)):
                if slot.replicated:
                    region.copy_(region[:1].expand_as(region))
        return flat

    def land(self, reduced: torch.Tensor) -> None:
        """The reduction completed with ``reduced``, this rank's mean shard (master dtype, on :attr:`device`): keep it
        as one piece per slot. Stage 1 keeps the pieces in its kept full-size buffer when nothing moved them
        elsewhere, so gradients are held once."""
        layout, kept = self._chunk.layout, self.kept
        if kept is not None and layout.world_size > 1 and reduced.device == kept.device and \
                reduced.dtype == kept.dtype and not layout.strided:
            layout.scatter_own(reduced, kept)
            self._landed = (kept, [s.offset + layout.rank * s.piece for s in layout.slots])  # own_pieces(kept)'s
        elif reduced.dim() == 1 and reduced.is_contiguous():
            # the pieces, one after another as in the shard (shard_pieces, and split by split_sizes, cut the same);
            # their offsets read once, the layout being fixed once packed
            if self._shard_offsets is None:
                self._shard_offsets = [s.shard_offset for s in layout.slots]
            self._landed = (reduced, self._shard_offsets)
        else:
            self.reduced = list(reduced.split(layout.split_sizes)[: len(layout.slots)])

    @property
    def reduced(self) -> list[torch.Tensor] | None:
        """This rank's mean gradient pieces from the last backward (one padded piece per slot, 1-D), until handed
        over; None when there are none. Made when asked: the hand-over cuts each slot's piece straight from where
        the reduction landed (see [Note: one view op per gradient])."""
        if self._pieces is None and self._landed is not None:
            base, offsets = self._landed
            self._pieces = [base[at : at + s.piece] for at, s in zip(offsets, self._chunk.layout.slots)]
        return self._pieces

    @reduced.setter
    def reduced(self, pieces: list[torch.Tensor] | None) -> None:
        self._landed = None
        self._pieces = pieces

    def _local_piece(self, i: int) -> torch.Tensor:
        """Slot ``i``'s reduced gradient cut to this rank's rows, in the sharded parameter's local shape (the padded
        piece's first elements, as ``ChunkLayout.local`` cuts it)."""
        shape, stride = self._geometry()[i]
        landed = self._landed
        if landed is not None:
            base, offsets = landed
            return base.as_strided(shape, stride, base.storage_offset() + offsets[i])
        assert self._pieces is not None
        return self._pieces[i][: math.prod(shape)].view(shape)

    @property
    def landed(self) -> bool:
        """This backward's reduction landed (its pieces wait for the hand-over). Set last by :meth:`land`, so the
        training thread may ask while the waiter thread lands."""
        return self._landed is not None or self._pieces is not None

    def hand_over_landed(self) -> None:
        """[Note: gradients handed over as they land]
        FSDP2 sets a unit's sharded ``.grad`` as soon as its reduce-scatter is issued; hooks and code that
        run later in the same backward (a hook on an earlier layer) can read it. Zero hands a slot's reduced
        gradient to its sharded parameter's ``.grad`` once the reduction has landed, on the training thread:
        at once at one rank (where a reduction completes on it), else at the next gradient that arrives
        after the waiter thread landed it (``GradientReducer.hand_over_landed``; the training thread never
        waits for a reduction inside a backward), and at the end of backward for the rest. Only on the
        training thread, because autograd may accumulate into a sharded parameter's ``.grad`` in the same
        backward (a term computed from the sharded parameters after the forward), and it runs nodes and the
        engine's hooks on that thread one after another. It does so wherever the result is certain to equal
        what the end of backward would hand over:

        - the slot got a gradient on this rank (``got``), so the ranks' agreement on which parameters got one
          (``GradientReducer.hand_over``, one collective at the end of backward) cannot say otherwise;
        - its ``.grad`` is None, so nothing is added in place: a backward that raises is undone by setting it
          back to None (:meth:`discard`), exactly; a gradient that accumulates onto an earlier backward's
          (several backwards before a step) is added at the end of backward, as before;
        - gradients stay where the master shard is (``target_device`` None) and the placement policy does not
          move shards after backward (the engine sets ``hands_early`` only then): a gradient must sit on its
          parameter's device.

        The other slots (no gradient on this rank, or one to add to) get theirs at the end of backward, as
        before; their pieces stay in ``reduced`` until then. ``no_sync()`` backwards reduce nothing, so land
        nothing. Only the sharded parameters' ``.grad`` is written here, which nothing in the engine reads
        during a backward."""
        if not self.hands_early or self.target_device is not None or not self.landed:
            return
        chunk, got, early, landed = self._chunk, self.got, self._early, self._landed
        if landed is None:  # pieces moved or cut by slot: the general way
            for seg in chunk.segments:
                i = seg.slot
                if got[i] and seg.param.grad is None and seg.param.requires_grad:
                    seg.param.grad = chunk.wrap(i, self._local_piece(i))
                    early[i] = True
            return
        # _local_piece, inlined, and Chunk.wrap (of a segment) as _lend: this runs for every parameter in every
        # backward (see [Note: one view op per gradient] and [Note: gradient wrappers lent again])
        base, offsets = landed
        at, geometry = base.storage_offset(), self._geometry()
        views = self._held_views(base, offsets)
        if chunk.mesh is None:
            for seg in chunk.segments:
                i = seg.slot
                param = seg.param
                if got[i] and param.grad is None and param.requires_grad:
                    shape, stride = geometry[i]
                    view = views[i] if views is not None else None
                    param.grad = view if view is not None and view.stride() == stride else \
                        base.as_strided(shape, stride, at + offsets[i])
                    early[i] = True
            return
        lend, device = self._lend, base.device
        for seg in chunk.segments:
            i = seg.slot
            param = seg.param
            if got[i] and param.grad is None and param.requires_grad:
                shape, stride = geometry[i]
                view = views[i] if views is not None else None
                local = view if view is not None and view.stride() == stride else \
                    base.as_strided(shape, stride, at + offsets[i])
                param.grad = lend(i, param._spec, local, device)
                early[i] = True

    def _held_views(self, base: torch.Tensor, offsets: list[int]) -> list[torch.Tensor | None] | None:
        """The views held from ``take_for_reduction`` (taken: they are used once) if the reduction landed in their
        buffer and each slot's piece there is its full view (one rank: the same shape, strides and offset)."""
        held, self._views = self._views, None
        if held is None or held[0] is not base:
            return None
        full = self._full_geometry
        if self._views_are_pieces is None and full:  # the layout is fixed once packed: asked once (with the views')
            self._views_are_pieces = [(shape, stride) for shape, stride, _ in full] == self._geometry() and \
                [offset for _, _, offset in full] == list(offsets)
        return held[1] if self._views_are_pieces else None

    def _geometry(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Each slot's local shape on this rank and its contiguous strides (read once: the layout is fixed once
        packed), as tuples (see [Note: one view op per gradient])."""
        if not self._local_geometry:
            layout = self._chunk.layout
            shapes = [s.local_shape(layout.rank) for s in layout.slots]
            self._local_geometry = [(tuple(shape), _contiguous_stride(shape)) for shape in shapes]
        return self._local_geometry

    def move_reduced(self, device: torch.device) -> None:
        """Route reduced gradients to ``device`` from now on, moving any not yet handed over (placement policies)."""
        self.target_device = device
        reduced = self.reduced
        if reduced is not None:
            self.reduced = [g.to(device) for g in reduced]

    def hand_over(self, present: Sequence[bool]) -> None:
        """Hand the reduced gradient to the sharded parameters, as autograd would to parameters.

        ``present[i]`` says whether slot ``i`` got a gradient on any rank; the others keep
        their ``.grad`` untouched (``None`` after ``zero_grad``), so the optimizer skips
        them. Gradients add to existing ones, so several backwards before a step accumulate. Slots handed over
        when their reduction landed are skipped (see [Note: gradients handed over as they land]).
        """
        chunk = self._chunk
        self.got = [False] * len(chunk.slots)
        early, self._early = self._early, [False] * len(chunk.slots)
        self._views = None
        if not self.landed:
            return
        if all(early):  # every slot was handed over as its reduction landed (the usual case at one rank)
            self.reduced = None
            return
        try:
            for seg in chunk.segments:
                if not present[seg.slot] or not seg.param.requires_grad or early[seg.slot]:
                    continue
                piece = self._local_piece(seg.slot)  # this rank's rows of the padded piece (ChunkLayout.local)
                if seg.param.grad is None:
                    seg.param.grad = chunk.wrap(seg.slot, piece)
                else:
                    with torch.no_grad():
                        seg.param.grad.add_(chunk.wrap(seg.slot, piece))
        finally:
            self.reduced = None


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (torch's rule: a dimension of size 0 counts as 1)."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))
