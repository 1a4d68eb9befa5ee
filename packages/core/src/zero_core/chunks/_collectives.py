"""The collectives of chunks and gather groups, as free functions.

[Note: allocation apart from the call]
Every all-gather and reduce-scatter the runtime issues for parameters and gradients is one of
the functions here. Each first takes the buffers it needs (from the chunk's or group's
:class:`~zero_core.chunks._buffers.BufferPool`, or the chunk's own full buffer), marks the chunk as
gathering with the object that will complete it, and only then issues the collective on the
comm backend and hands it the work handle. Where a buffer is allocated is decided apart from
the call that fills it, which is what CUDA streams need (allocate on the stream that consumes
the buffer, issue on the communication stream) and what keeps the chunk's state changes in
one place: a chunk changes state only through its own transitions (``begin_gather``,
``wait``, ``release``), never inside a collective.

The streams themselves are [Note: streams of the data plane] in ``zero_core.base._streams``:
all-gathers are issued on the chunk's all-gather stream (:func:`_issue_all_gather`) after the
compute stream's event, reduce-scatters on its reduce-scatter stream after the same, and every
completion makes the compute stream wait the collective's event before it copies out or lands
anything. On CPU those calls do nothing.

The completion objects (``_CopyOut``, ``_Unpack``, ``_CopiesOut``, ``PendingReduction``) copy results
out and return buffers; a ``PendingReduction`` completes on the reducer's waiter thread and touches
only the chunk's gradients (:meth:`~zero_core.chunks._chunk_grads.ChunkGradients.land`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from zero_core.base._devices import to_host
from zero_core.base._host_memory import advise_huge_pages
from zero_core.base._state import ChunkState
from zero_core.base._streams import Streams
from zero_core.chunks.chunk import Chunk
from zero_core.comm.backend import CommBackend, Pending

if TYPE_CHECKING:
    from zero_core.chunks._group import GatherGroup

__all__ = ["PendingReduction", "broadcast_from_rank0", "gather_chunk", "gather_for_peers", "gather_group", "gather_master",
           "gather_master_shards", "exchange_pieces", "refresh_chunk", "refresh_group", "refresh_group_shard", "reduce_gradients", "sum_over_ranks"]


# -- parameters: all-gathers ----------------------------------------------------------------------------
def gather_chunk(chunk: Chunk, comm: CommBackend, *, async_op: bool = False) -> None:
    """SHARDED (or SHARDED_POST_FORWARD) -> GATHERED, or GATHERING with ``async_op``: one all-gather into the
    chunk's full buffer. From SHARDED_POST_FORWARD the kept part is gathered inside its group of ``k`` ranks."""
    if chunk.persistent:
        return
    chunk.check_state_mover("gather it")
    comm = chunk.comm_for(comm)
    if chunk.state is ChunkState.SHARDED_POST_FORWARD:
        # the kept copy is already what the last gather delivered: exact, see [Note: collectives that may be lossy]
        comm, send = chunk.comms.sub, chunk.take_post_forward_copy()
        done_order = params = False
    else:
        send = chunk.gather_send()
        done_order = params = True
    streams = chunk.streams
    received = None if chunk.direct else chunk.pool.take(chunk.size, chunk.dtype, chunk.device, zeroed=False,
                                                         stream=streams.all_gather)
    done = _CopyOut(chunk, received, gather_order=done_order, held=send)
    chunk.begin_gather(done)  # allocates the full buffer: the ranks' shards side by side are it when direct
    done.pending = _issue_all_gather(streams, comm, chunk.full if received is None else received, send,
                                     async_op=async_op, params=params)
    if not async_op:
        chunk.wait()


def gather_for_peers(chunk: Chunk, comm: CommBackend) -> None:
    """Join an all-gather of this chunk that other ranks need, without changing local state."""
    scratch = chunk.pool.take(chunk.size, chunk.dtype, chunk.device, zeroed=False)
    # the peers gather it for compute: the same collective as theirs (see [Note: collectives that may be lossy])
    chunk.comm_for(comm).all_gather_params(scratch, chunk.gather_send())
    chunk.pool.give(scratch)


def gather_group(group: GatherGroup, comm: CommBackend, *, async_op: bool = False, keep: bool = True) -> None:
    """All-gather a group; members not gathered yet are filled unless ``keep=False`` (a gather only peers need)."""
    comm = group.comm or comm
    chunks = group.chunks
    targets = [c for c in chunks if not c.is_gathered] if keep else []
    if len(chunks) == 1:
        if targets:
            gather_chunk(targets[0], comm, async_op=async_op)
        else:
            gather_for_peers(chunks[0], comm)
        return
    if all(c.state is ChunkState.SHARDED_POST_FORWARD for c in chunks):  # copies kept by the forward
        _gather_copies(group, targets, async_op=async_op)
        return
    streams = group.pool.streams
    send = group.pool.take(group.shard_numel, group.dtype, group.device, zeroed=False)
    streams.wrote(send, streams.compute)
    offset = 0
    with torch.no_grad():
        for chunk in chunks:
            send[offset : offset + chunk.gather_numel].copy_(chunk.gather_send())
            offset += chunk.gather_numel
    received = group.pool.take(group.world_size * group.shard_numel, group.dtype, group.device, zeroed=False,
                               stream=streams.all_gather)
    unpack = _Unpack(group, send, received, chunks, targets)
    for chunk in targets:
        chunk.begin_gather(unpack)
    unpack.pending = _issue_all_gather(streams, comm, received, send, async_op=True, params=True)
    if not targets:
        unpack.wait()
        return
    if not async_op:
        for chunk in targets:
            chunk.wait()


def _gather_copies(group: GatherGroup, targets: Sequence[Chunk], *, async_op: bool) -> None:
    """The members' kept copies (each ``1/k`` of its rank-major buffer) gathered in one all-gather over the group
    of ``k``; each member's rank-major buffer is its column block of the result. Only under a static graph
    (shard() checks), so every rank holds copies of the same members."""
    sub = group.chunks[0].comms.sub
    k = sub.world_size
    parts = [c.size // k for c in group.chunks]
    streams = group.pool.streams
    send = torch.cat([c.take_post_forward_copy() for c in group.chunks])
    streams.allocated(send, streams.compute)
    received = group.pool.take(k * sum(parts), group.dtype, group.device, zeroed=False, stream=streams.all_gather)
    unpack = _CopiesOut(group, received, parts, targets, held=send)
    for chunk in targets:
        chunk.begin_gather(unpack)
    unpack.pending = _issue_all_gather(streams, sub, received, send, async_op=True, params=False)
    if not async_op:
        for chunk in targets:
            chunk.wait()
    elif not targets:
        unpack.wait()


def refresh_chunk(chunk: Chunk, comm: CommBackend, *, async_op: bool = False) -> Pending | None:
    """After an optimizer step (or a load), bring a kept full buffer up to date with the updated shards.

    Stages 1 and 2: the rank's pieces are refreshed from its master shard and the ranks'
    pieces all-gathered and copied out. One rank with a separate master: a cast copy.
    Stage 3 needs nothing: the next gather reads the shard.
    """
    if not chunk.persistent:
        return None
    chunk.check_state(ChunkState.GATHERED)
    comm = chunk.comm_for(comm)
    chunk.refresh_own_slice()
    if chunk.world_size == 1:  # the full buffer is this rank's slice: nothing to send
        return None
    streams = chunk.streams
    if chunk.direct:  # in place: this rank's slice of the full buffer is what it sends
        own = chunk.full[chunk.rank * chunk.shard_size : (chunk.rank + 1) * chunk.shard_size]
        copy = _CopyOut(chunk, None)
        copy.pending = _issue_all_gather(streams, comm, chunk.full, own, async_op=async_op, params=True)
    else:
        # pooled, like the receive buffer: a fresh send buffer every step would be faulted in page by page
        send = chunk.pool.take(chunk.shard_size, chunk.dtype, chunk.device, zeroed=False)
        streams.wrote(send, streams.compute)
        chunk.pack_own(send)
        received = chunk.pool.take(chunk.size, chunk.dtype, chunk.device, zeroed=False, stream=streams.all_gather)
        copy = _CopyOut(chunk, received, send=send)
        copy.pending = _issue_all_gather(streams, comm, received, send, async_op=async_op, params=True)
    if not async_op:
        copy.wait()
        return None
    return copy


def refresh_group(group: GatherGroup, comm: CommBackend, *, members: Sequence[Chunk] | None = None) -> list[Pending | None]:
    """After a step, bring the kept full buffers of a group's trainable members (or of ``members``) up to date
    (see :func:`refresh_chunk`)."""
    comm = group.comm or comm
    refreshed = group.refreshed if members is None else tuple(members)
    if len(refreshed) <= 1 or group.world_size == 1:
        return [refresh_chunk(c, comm, async_op=True) for c in refreshed]
    numel = sum(c.shard_size for c in refreshed)
    streams = group.pool.streams
    send = group.pool.take(numel, group.dtype, group.device, zeroed=False)
    streams.wrote(send, streams.compute)
    offset = 0
    for chunk in refreshed:
        chunk.refresh_own_slice()
        chunk.pack_own(send[offset : offset + chunk.shard_size])
        offset += chunk.shard_size
    received = group.pool.take(group.world_size * numel, group.dtype, group.device, zeroed=False,
                               stream=streams.all_gather)
    unpack = _Unpack(group, send, received, refreshed, refreshed)
    unpack.pending = _issue_all_gather(streams, comm, received, send, async_op=True, params=True)
    return [unpack]


def refresh_group_shard(chunk: Chunk) -> None:
    """After an optimizer step (or a write to the masters), bring the group shard of a chunk cut over the replicas
    up to date: one all-gather of the updated shards over the replicate group (see [Note: optimizer states across
    replicas] in ``zero_core.chunks.chunk``). Other chunks need nothing."""
    shard = chunk.group_shard
    if shard is None or not chunk.shard_in_memory:
        return
    chunk.comms.outer.all_gather(shard, chunk.outer_send())


def _issue_all_gather(streams: Streams, comm: CommBackend, out: torch.Tensor, send: torch.Tensor, *,
                      async_op: bool, params: bool) -> Pending | None:
    """Issue an all-gather on the all-gather stream, after the compute stream's work so far (which packed ``send``
    and allocated ``out``): see [Note: streams of the data plane] in ``zero_core.base._streams``. Its completion
    object lands it (:meth:`_Gathered._land`). ``params``: parameter values for compute, which a backend may send
    lossily (:meth:`~zero_core.comm.backend.CommBackend.all_gather_params`); else exact."""
    gather = streams.all_gather
    streams.wait(gather, streams.record(streams.compute))
    streams.read(send, gather)
    streams.wrote(out, gather)
    with streams.on(gather):
        if params:
            return comm.all_gather_params(out, send, async_op=async_op)
        return comm.all_gather(out, send, async_op=async_op)


class _Gathered:
    """An all-gather in flight on the all-gather stream. :meth:`_land` (once) waits for it and makes the compute
    stream wait its event; until then it holds ``held``, an unpooled send buffer, which dropped earlier would let the
    allocator give its memory to the compute stream while the all-gather still reads it (no ``record_stream``)."""

    def __init__(self, streams: Streams, held: torch.Tensor | None) -> None:
        self._streams, self._held = streams, held
        self.pending: Pending | None = None
        self._landed = False

    def _land(self) -> bool:
        """Whether this call landed it (False when an earlier one did)."""
        if self._landed:
            return False
        self._landed = True
        streams = self._streams
        if self.pending is not None:
            with streams.on(streams.all_gather):
                self.pending.wait()
            self.pending = None
        streams.wait(streams.compute, streams.record(streams.all_gather))
        if self._held is not None:
            streams.dropped(self._held)
            self._held = None
        return True


class _CopyOut(_Gathered):
    """A chunk's all-gather in flight; ``wait()`` (idempotent) copies the ranks' shards out into its full buffer
    (nothing to copy when the chunk gathered in place). ``gather_order``: the shard group's all-gather of group
    shards, whose rows are in the shard group's order (:meth:`ChunkLayout.from_gather_order`). ``send``: a pooled
    send buffer (an after-step refresh), given back once the gather is done; ``held``: an unpooled one."""

    def __init__(self, chunk: Chunk, received: torch.Tensor | None, *, gather_order: bool = False,
                 send: torch.Tensor | None = None, held: torch.Tensor | None = None) -> None:
        super().__init__(chunk.streams, held)
        self._chunk, self._received, self._send = chunk, received, send
        self._gather_order = gather_order

    def wait(self) -> None:
        if not self._land():
            return
        chunk, streams = self._chunk, self._streams
        if self._send is not None:
            chunk.pool.give(self._send)
            self._send = None
        if self._received is None:  # gathered in place (a one-parameter chunk)
            return
        received, self._received = self._received, None
        streams.read(received, streams.compute)
        streams.wrote(chunk.full, streams.compute)
        if self._gather_order:
            rows = chunk.layout.from_gather_order(received.view(chunk.gather_world, chunk.gather_numel))
        else:
            rows = received.view(chunk.world_size, chunk.shard_size)
        chunk.layout.copy_out(rows, chunk.full)
        chunk.pool.give(received)


class _Unpack(_Gathered):
    """A group's all-gather in flight; ``wait()`` (idempotent) cuts each target's full buffer out of it.

    ``packed`` are the chunks whose shards the send buffer holds, in order; ``targets`` those to fill.
    """

    def __init__(self, group: GatherGroup, send: torch.Tensor, received: torch.Tensor, packed: Sequence[Chunk],
                 targets: Sequence[Chunk]) -> None:
        super().__init__(group.pool.streams, None)
        self._group = group
        self._packed, self._targets = tuple(packed), {id(c) for c in targets}
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = (send, received)

    def wait(self) -> None:
        if not self._land():
            return
        streams = self._streams
        assert self._buffers is not None  # kept until the one landing
        send, received = self._buffers
        self._buffers = None
        streams.read(received, streams.compute)
        packed = received.view(self._group.world_size, -1)
        offset = 0
        with torch.no_grad():
            for chunk in self._packed:
                if id(chunk) in self._targets:
                    streams.wrote(chunk.full, streams.compute)
                    block = packed[:, offset : offset + chunk.gather_numel]
                    chunk.layout.copy_out(chunk.layout.from_gather_order(block), chunk.full)
                offset += chunk.gather_numel
        self._group.pool.give(send)
        self._group.pool.give(received)


class _CopiesOut(_Gathered):
    """A gather of kept copies in flight; ``wait()`` (idempotent) rebuilds each target's full buffer."""

    def __init__(self, group: GatherGroup, received: torch.Tensor, parts: Sequence[int],
                 targets: Sequence[Chunk], *, held: torch.Tensor | None = None) -> None:
        super().__init__(group.pool.streams, held)
        self._received: torch.Tensor | None  # None once waited for
        self._group, self._received = group, received
        self._parts, self._targets = list(parts), {id(c) for c in targets}

    def wait(self) -> None:
        if not self._land():
            return
        streams = self._streams
        assert self._received is not None  # kept until the one landing
        received, self._received = self._received, None
        streams.read(received, streams.compute)
        k = len(received) // sum(self._parts)
        by_rank = received.view(k, -1)
        offset = 0
        with torch.no_grad():
            for chunk, part in zip(self._group.chunks, self._parts):
                if id(chunk) in self._targets:  # rank p of the group sent ranks p*S/k .. of the chunk's rank-major buffer
                    streams.wrote(chunk.full, streams.compute)
                    chunk.layout.copy_out(by_rank[:, offset : offset + part].reshape(chunk.world_size, chunk.shard_size), chunk.full)
                offset += part
        self._group.pool.give(received)


# -- gradients: reduce-scatters ------------------------------------------------------------------------
def reduce_gradients(chunk: Chunk, comm: CommBackend, *, loss_scale: float = 1.0,
                     replicate: CommBackend | None = None, all_reduce: bool = False) -> PendingReduction:
    """Start reducing this backward's parameter gradients to this rank's shard (mean over ranks).

    ``comm`` reduces over the shard group: a reduce-scatter, or with ``all_reduce`` an
    all-reduce of the whole gradient of which this rank keeps its shard. ``replicate``
    then sums the shard over the replicas (HSDP); both run in the returned
    :class:`PendingReduction`'s ``complete()`` (on the reducer's waiter thread) except the
    reduce-scatter, which is issued here. The chunk's own groups, when shard() gave it
    some, take the place of ``comm`` and ``replicate``.

    ``complete()`` leaves the result, in the master dtype and divided by ``loss_scale``, in
    ``chunk.grads``. Parameters that got no gradient on this rank contribute zeros.
    """
    outer = None
    if chunk.comms is not None:
        comm, replicate, outer = chunk.comms.reduce, chunk.comms.replicate, chunk.comms.outer
        all_reduce = chunk.comms.all_reduce
        if all_reduce:
            comm = chunk.comms.reduce_all
    flat = chunk.grads.take_for_reduction()
    pool, streams = chunk.pool, chunk.streams
    pooled = flat if flat is not chunk.grads.kept else None
    divisor = chunk.world_size * chunk.replicas * loss_scale
    if chunk.world_size == 1:  # one rank: the layouts coincide, the buffer itself becomes the gradient
        send = flat if flat.dtype == chunk.reduce_dtype else flat.to(chunk.reduce_dtype)
        if pooled is not None:
            if send is flat:
                pool.keep(pooled)
            else:
                pool.give(pooled)
        if replicate is not None and chunk.predivide != 1.0:
            send.div_(chunk.predivide)
            divisor /= chunk.predivide
        return PendingReduction(chunk, None, send, None, divisor, replicate=replicate)
    if chunk.direct and flat.dtype == chunk.reduce_dtype:  # the gradient buffer is already rank-major: send it
        send = flat
    else:
        send = pool.take(chunk.size, chunk.reduce_dtype, chunk.device, zeroed=False)
        # rank-major (in the shard group's order), cast to the reduce dtype: the parameter-major buffer is free again
        streams.read(flat, streams.compute)
        streams.wrote(send, streams.compute)
        chunk.layout.copy_in(flat, send, gather_order=True)
        if pooled is not None:
            pool.give(pooled)
    pooled_send = None if send is chunk.grads.kept else send  # stage 1's kept buffer is never pooled
    if chunk.predivide != 1.0:
        send.div_(chunk.predivide)  # send is consumed by this reduction: dividing in place is safe
        divisor /= chunk.predivide
    if all_reduce:  # the whole gradient is summed on the waiter thread; this rank then keeps its row
        return PendingReduction(chunk, None, send, pooled_send, divisor, replicate=replicate, all_reduce=comm, outer=outer)
    # becomes the gradient: see [Note: huge pages for the engine's host buffers]. Allocated on the compute stream,
    # which consumes it; the reduce-scatter stream writes it after the compute stream's event (see [Note: streams of
    # the data plane] in zero_core.base._streams), which also orders it after the packing of ``send``.
    reduced = advise_huge_pages(torch.empty(chunk.gather_numel, dtype=chunk.reduce_dtype, device=chunk.device))
    streams.allocated(reduced, streams.compute)
    scatter = streams.reduce_scatter
    streams.wait(scatter, streams.record(streams.compute))
    streams.read(send, scatter)
    streams.wrote(reduced, scatter)
    with streams.on(scatter):
        pending = comm.reduce_scatter_grads(reduced, send, async_op=True)
    if pooled_send is not None and getattr(pending, "input_released", False):
        # a bucketing backend copied it: reuse it for the next gradient once the stream that copied it is past
        pool.give(pooled_send, after=streams.record(scatter))
        pooled_send = None
    return PendingReduction(chunk, pending, reduced, pooled_send, divisor, replicate=replicate, outer=outer)


class PendingReduction:
    """A chunk's gradient reduction in flight; ``complete()`` stores this rank's mean in ``chunk.grads``."""

    def __init__(
        self, chunk: Chunk, pending: Pending | None, reduced: torch.Tensor, pooled: torch.Tensor | None,
        divisor: float, *, replicate: CommBackend | None = None, all_reduce: CommBackend | None = None,
        outer: CommBackend | None = None,
    ) -> None:
        self._reduced: torch.Tensor | None  # None once landed in chunk.grads
        self._chunk, self._pending, self._reduced, self._pooled = chunk, pending, reduced, pooled
        self._divisor = divisor
        self._replicate, self._all_reduce, self._outer = replicate, all_reduce, outer

    def complete(self) -> None:
        chunk = self._chunk
        streams = chunk.streams
        if self._pending is not None:
            with streams.on(streams.reduce_scatter):
                self._pending.wait()
            self._pending = None
            # the rest runs on the compute stream (this is the waiter thread, whose current stream is not it), after
            # the reduce-scatter's event: see [Note: streams of the data plane] in zero_core.base._streams
            streams.wait(streams.compute, streams.record(streams.reduce_scatter))
            if self._reduced is not None:
                streams.read(self._reduced, streams.compute)
        with streams.on(streams.compute):
            self._finish(chunk)

    def _finish(self, chunk: Chunk) -> None:
        if self._all_reduce is not None and self._reduced is not None:
            # Reduction.ALL_REDUCE over the shard group: the rank-major sum, of which this rank keeps its row
            comm, self._all_reduce = self._all_reduce, None
            comm.all_reduce(self._reduced)
            self._reduced = self._reduced.view(chunk.gather_world, chunk.gather_numel)[chunk.gather_rank].clone()
        if self._replicate is not None and self._reduced is not None:
            # HSDP: the shard group's sum of this shard, summed again over the replicas that hold the same shard
            replicate, self._replicate = self._replicate, None
            replicate.all_reduce(self._reduced)
        if self._outer is not None and self._reduced is not None:
            # optimizer states across replicas: the shard group's sum of the group shard's shards, reduce-scattered
            # over the replicas to this rank's one shard
            outer, self._outer = self._outer, None
            mine = torch.empty(chunk.shard_size, dtype=self._reduced.dtype, device=self._reduced.device)
            outer.reduce_scatter_grads(mine, self._reduced)
            self._reduced = mine
        if self._reduced is not None:
            # moved to where the master shard lives (the host, when offloaded), never copied and kept twice
            grad = to_host(self._reduced, chunk.grads.device, chunk.master_dtype, streams=chunk.streams)
            if self._divisor != 1.0:
                grad.div_(self._divisor)
            chunk.grads.land(grad)
            self._reduced = None
        if self._pooled is not None:  # the collective is done with it
            chunk.pool.give(self._pooled)
            self._pooled = None


# -- values outside a step: setup, norms, inspection ----------------------------------------------------
def broadcast_from_rank0(tensor: torch.Tensor, comm: CommBackend) -> None:
    """Make ``tensor`` hold rank 0's values on every rank, in place (``sync_module_states``)."""
    if comm.world_size > 1:
        comm.broadcast(tensor, src=0)


def sum_over_ranks(tensor: torch.Tensor, comm: CommBackend, *, op: str = "sum") -> None:
    """Reduce a small tensor (a norm's partial sums) over the ranks in place; ``op`` is ``sum`` or ``max``."""
    if comm.world_size > 1:
        comm.all_reduce(tensor, op=op)


def gather_master_shards(chunk: Chunk, comm: CommBackend) -> torch.Tensor:
    """Every rank's master shard of the chunk, side by side (``(world_size, shard_size)``, master dtype, on the
    compute device), in a fresh buffer; the chunk's own state is untouched."""
    received = torch.empty(chunk.size, dtype=chunk.master_dtype, device=chunk.device)
    # shards cut over the replicas too are one per rank of the whole data-parallel group, in its order
    group = chunk.comms.everyone if chunk.outer > 1 else chunk.comm_for(comm)
    group.all_gather(received, chunk.shard.to(chunk.device))
    return received.view(chunk.world_size, chunk.shard_size)


def gather_master(chunk: Chunk, comm: CommBackend) -> torch.Tensor:
    """The chunk's full master values (parameter-major, master dtype, on the compute device), gathered from every
    rank's shard into a fresh buffer; the chunk's own state is untouched."""
    received = gather_master_shards(chunk, comm)
    full = torch.empty(chunk.size, dtype=chunk.master_dtype, device=chunk.device)
    chunk.layout.copy_out(received, full)
    return full


# -- whole-tensor optimizer steps: all-to-alls ---------------------------------------------------------
def exchange_pieces(output: torch.Tensor, input: torch.Tensor, comm: CommBackend, *, output_splits: Sequence[int],
                    input_splits: Sequence[int]) -> None:
    """Pieces of parameters to their owners or back (see [Note: whole-tensor optimizer steps]): one all-to-all."""
    comm.all_to_all(output, input, output_splits=output_splits, input_splits=input_splits)
