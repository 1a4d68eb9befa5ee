"""Packing many small reduce-scatters into a few large ones.

[Note: reduce-scatter buckets]
A collective has a fixed cost per call (a launch, a rendezvous, for gloo a round of
messages) on top of its bytes, so reduce-scattering hundreds of small gradients one at
a time spends most of its time on that cost. The bucketer copies small inputs into a
bucket, one per (dtype, device, comm backend), and reduce-scatters the whole bucket
in one collective when the next input does not fit, or at :meth:`flush`.

Layout. A bucket's buffer is ``(world_size, capacity)``: row ``r`` holds what goes to
rank ``r``, and an input of ``n`` elements per rank takes columns ``[offset, offset + n)``
of every row. A reduce-scatter sends rank ``r`` the ``r``-th contiguous slice of a flat
input, so the launched tensor must hold rank ``r``'s elements at ``[r * filled, (r + 1)
* filled)``; which position that is depends on ``filled``, unknown until launch. No
fixed layout gives a valid prefix for every fill, so a full bucket is launched as it
is, and a partial one first moves rows ``1 .. world_size - 1`` to the front, in place
(row 0 is already there). Launching ``[0, world_size * filled)`` then sends exactly the
queued bytes: no padding on the wire and no second buffer. The move touches
``(world_size - 1) / world_size`` of the queued data, which is what ``contiguous()`` on
the ``[:, :filled]`` view would copy, without allocating its result.

Lifecycle. A bucket is FREED (no buffer), EMPTY, FILLING or LAUNCHED (see
:class:`BucketState`). A launched bucket's buffer is busy until its collective
completes, and :meth:`ReduceScatterBucketer.reduce_scatter_async` must never block on a
collective (another rank may be unable to launch its half until this rank moves on),
so the next input of that key goes to another bucket: a spare EMPTY or FREED one, or
a new one. Completion returns the buffer to EMPTY. With a waiter completing
reductions as they finish, that is two buffers per key.

Order. Every rank must issue the same collectives in the same order, so collectives are
launched only by :meth:`~ReduceScatterBucketer.reduce_scatter_async` and
:meth:`~ReduceScatterBucketer.flush`, whose calls are part of each rank's program, never
by :meth:`Ticket.wait`, which a waiter thread calls whenever it gets to it. An input
larger than a bucket is launched at once in its own collective, before the smaller
inputs still queued, so callbacks do not run in call order: they run in launch order,
and within one bucket in the order the inputs were queued.

Threads. A ticket may be waited on from another thread while the issuing thread goes
on queueing and flushing. One lock guards the buckets and the launch queue and is
never held while waiting on a collective. Collectives complete strictly in launch
order, each under its own lock, by whichever thread gets to it first: the collective is
waited on and its callbacks run exactly once, and a thread that finds it taken waits
for that lock and then moves on to the next.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from zero_core import ZeroError
from zero_core.plugin import CommError

if TYPE_CHECKING:
    from zero_core.plugin import CommBackend, Pending

__all__ = ["Bucket", "BucketCallbackError", "BucketError", "BucketState", "ReduceScatterBucketer", "Ticket"]

Callback = Callable[[torch.Tensor], None]
Inputs = torch.Tensor | Sequence[torch.Tensor]

# A partial bucket's rows move to the front in at most this many non-overlapping copies
# per row; rows that would need more (they move only a little) go through a temporary.
_MAX_PIECES = 8


class BucketError(ZeroError):
    """A bucket or the bucketer was used in a state that does not allow it."""


class BucketCallbackError(ZeroError):
    """A reduce-scatter's callback raised; the other callbacks of its collective still ran."""


class BucketState(enum.Enum):
    """Where a :class:`Bucket` is in its life; see [Note: reduce-scatter buckets]."""

    FREED = "freed"  # no buffer: allocate() before use
    EMPTY = "empty"  # buffer allocated, nothing queued
    FILLING = "filling"  # inputs queued, not launched yet
    LAUNCHED = "launched"  # its reduce-scatter is in flight; the buffer is busy until it completes


class _Entry:
    """One queued input: where it sits in its collective and whom to hand the result."""

    __slots__ = ("callback", "numel", "offset", "shape")

    def __init__(self, offset: int, shape: torch.Size, callback: Callback | None) -> None:
        self.offset, self.shape, self.callback = offset, shape, callback
        self.numel = shape.numel()


class _Collective:
    """One reduce-scatter of the bucketer: queued (in a bucket or alone), then launched, then completed.

    Every ticket of an input it carries points at it. ``seq`` is set at launch and
    ``done`` at completion; ``lock`` makes completion happen exactly once.
    """

    def __init__(self, dtype: torch.dtype, bucket: Bucket | None) -> None:
        self.dtype, self.bucket = dtype, bucket
        self.entries: list[_Entry] = []
        self.seq: int | None = None
        self.pending: Pending | None = None
        self.output: torch.Tensor | None = None
        self.keep: torch.Tensor | None = None  # the input of an unbucketed launch must outlive it
        self.failure: BaseException | None = None
        self.done = False
        self.lock = threading.Lock()

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)

    def describe(self) -> str:
        where = f"#{self.seq}" if self.seq is not None else "(not launched)"
        return f"bucketed reduce-scatter {where} of {self.numel} elements per rank ({self.dtype}, {len(self.entries)} input(s))"

    def run_callbacks(self) -> BucketCallbackError | None:
        """Hand every input its reduced shard, in queue order; return the first failure, wrapped."""
        assert self.output is not None
        first: BucketCallbackError | None = None
        for entry in self.entries:
            if entry.callback is None:
                continue
            try:
                entry.callback(self.output[entry.offset : entry.offset + entry.numel].view(entry.shape))
            except Exception as err:  # the other inputs' results must still be delivered
                if first is None:
                    first = BucketCallbackError(
                        f"the callback of a reduce-scatter of {entry.numel} elements ({self.dtype}, shape "
                        f"{tuple(entry.shape)}) in {self.describe()} raised {type(err).__name__}: {err}. "
                        "The other callbacks of that collective ran and the bucketer is still usable."
                    )
                    first.__cause__ = err
        return first


def _move_left(flat: torch.Tensor, src: int, dst: int, n: int) -> None:
    """``flat[dst:dst + n] = flat[src:src + n]`` for ``dst < src``, where the two may overlap."""
    shift = src - dst
    if shift >= n:
        flat[dst : dst + n].copy_(flat[src : src + n])
    elif shift * _MAX_PIECES >= n:
        # front to back, in pieces no longer than the shift: a piece never overlaps its destination,
        # and it only overwrites elements that earlier pieces have already moved
        for start in range(0, n, shift):
            k = min(shift, n - start)
            flat[dst + start : dst + start + k].copy_(flat[src + start : src + start + k])
    else:
        flat[dst : dst + n].copy_(flat[src : src + n].clone())


class Bucket:
    """One buffer of ``(world_size, capacity)`` elements for one (dtype, device, comm) key.

    Created FREED; :meth:`allocate` gives it a buffer. See [Note: reduce-scatter buckets]
    for the layout and the states.
    """

    def __init__(self, world_size: int, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        if world_size < 1 or capacity < 1:
            raise CommError(f"a bucket needs world_size >= 1 and capacity >= 1, got {world_size} and {capacity}")
        self.world_size, self.capacity, self.dtype, self.device = world_size, capacity, dtype, torch.device(device)
        self.filled = 0
        self._state = BucketState.FREED
        self._data: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._collective: _Collective | None = None

    @property
    def state(self) -> BucketState:
        return self._state

    @property
    def queued(self) -> int:
        """Inputs waiting in this bucket for its launch."""
        return len(self._collective.entries) if self._state is BucketState.FILLING and self._collective else 0

    def _expect(self, action: str, *states: BucketState) -> None:
        if self._state in states:
            return
        if self._state is BucketState.FREED:
            raise BucketError(f"cannot {action} this bucket: its buffer was freed; call allocate() first")
        allowed = " or ".join(s.name for s in states)
        raise BucketError(f"cannot {action} a bucket in state {self._state.name} (needs {allowed})")

    def allocate(self) -> None:
        """FREED -> EMPTY: give the bucket its buffers. Does nothing if it has them."""
        if self._state is not BucketState.FREED:
            return
        # Uninitialised is fine: a launch sends only positions that inputs were copied into.
        self._data = torch.empty((self.world_size, self.capacity), dtype=self.dtype, device=self.device)
        self._output = torch.empty(self.capacity, dtype=self.dtype, device=self.device)
        self._state = BucketState.EMPTY

    def can_take(self, numel: int) -> bool:
        """Whether an input of ``numel`` elements per rank still fits."""
        return self.filled + numel <= self.capacity

    def append(self, inputs: Inputs, callback: Callback | None) -> int:
        """EMPTY/FILLING -> FILLING: copy in one input (a ``(world_size, ...)`` tensor or a list of
        ``world_size`` tensors); return its offset in every row."""
        self._expect("append to", BucketState.EMPTY, BucketState.FILLING)
        assert self._data is not None
        if isinstance(inputs, torch.Tensor):
            shape = inputs.shape[1:]
        else:
            shape = inputs[0].shape
        numel = shape.numel()
        if not self.can_take(numel):
            raise BucketError(
                f"a bucket holding {self.filled} of {self.capacity} elements per rank cannot take {numel} more; launch it first"
            )
        offset = self.filled
        columns = self._data[:, offset : offset + numel]
        if isinstance(inputs, torch.Tensor):
            columns.copy_(inputs.reshape(self.world_size, numel))
        else:
            for row, tensor in zip(columns, inputs):
                row.copy_(tensor.reshape(-1))
        if self._state is BucketState.EMPTY:
            self._collective = _Collective(self.dtype, self)
            self._state = BucketState.FILLING
        assert self._collective is not None
        self._collective.entries.append(_Entry(offset, shape, callback))
        self.filled += numel
        return offset

    def launch(self, comm: CommBackend) -> _Collective:
        """FILLING -> LAUNCHED: start one reduce-scatter of everything queued."""
        self._expect("launch", BucketState.FILLING)
        assert self._data is not None and self._output is not None and self._collective is not None
        n, rows = self.filled, self.world_size
        flat = self._data.view(-1)
        if n < self.capacity:  # see [Note: reduce-scatter buckets] for why rows move to the front
            for r in range(1, rows):
                _move_left(flat, r * self.capacity, r * n, n)
        collective, output = self._collective, self._output[:n]
        collective.output = output
        self._state = BucketState.LAUNCHED
        collective.pending = comm.reduce_scatter(output, flat[: rows * n], async_op=True)
        return collective

    def recycle(self) -> None:
        """LAUNCHED -> EMPTY: its collective completed; the buffer takes new inputs."""
        self._expect("recycle", BucketState.LAUNCHED)
        self.filled = 0
        self._collective = None
        self._state = BucketState.EMPTY

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers it holds (0 when freed)."""
        return sum(t.numel() * t.element_size() for t in (self._data, self._output) if t is not None)

    def free(self) -> None:
        """EMPTY -> FREED: drop the buffers. Does nothing if already freed."""
        if self._state in (BucketState.FILLING, BucketState.LAUNCHED):
            raise BucketError(
                f"cannot free a bucket in state {self._state.name}: its inputs have not been reduced yet; "
                "call ReduceScatterBucketer.flush() first"
            )
        self._data = self._output = None
        self._state = BucketState.FREED

    def __repr__(self) -> str:
        return (
            f"Bucket(world_size={self.world_size}, capacity={self.capacity}, dtype={self.dtype}, device={self.device}, "
            f"state={self._state.name}, filled={self.filled})"
        )


class Ticket:
    """The handle of one :meth:`ReduceScatterBucketer.reduce_scatter_async` (a :class:`zero_core.plugin.Pending`)."""

    def __init__(self, bucketer: ReduceScatterBucketer, collective: _Collective, comm: CommBackend,
                 *, input_released: bool) -> None:
        self._bucketer, self._collective, self._comm = bucketer, collective, comm
        #: The input was copied into a bucket (or was empty): the caller may reuse it at once.
        self.input_released = input_released

    @property
    def launched(self) -> bool:
        """Whether the collective carrying this input has been issued."""
        return self._collective.seq is not None or self._collective.done

    @property
    def done(self) -> bool:
        """Whether the callback has run (or the collective failed)."""
        return self._collective.done

    def wait(self) -> None:
        """Block until this input's callback has run.

        Never launches a collective: waits up to the comm's timeout for the issuing thread to
        launch the bucket, then completes every collective launched before this one and this
        one, in launch order. Raises :class:`BucketCallbackError` if a callback it ran raised.
        """
        self._bucketer._wait(self._collective, self._comm)


def _check_inputs(inputs: Inputs, world_size: int) -> tuple[torch.Size, torch.dtype, torch.device]:
    """The shape, dtype and device of one rank's input, after checking ``inputs`` is one per rank."""
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() == 0 or inputs.shape[0] != world_size:
            got = "a 0-d tensor" if inputs.dim() == 0 else f"a tensor whose first dimension is {inputs.shape[0]}"
            raise CommError(
                f"reduce_scatter_async got {got} but comm.world_size is {world_size}; pass a tensor of shape "
                f"({world_size}, ...) with one row per rank, or a list of {world_size} tensors"
            )
        return inputs.shape[1:], inputs.dtype, inputs.device
    if not isinstance(inputs, (list, tuple)):
        raise CommError(
            f"reduce_scatter_async takes a list of comm.world_size tensors or one tensor with a row per rank, "
            f"got {type(inputs).__name__}"
        )
    if not inputs:
        raise CommError(f"reduce_scatter_async got an empty list of inputs; pass comm.world_size = {world_size} tensors, one per rank")
    if len(inputs) != world_size:
        raise CommError(
            f"reduce_scatter_async got {len(inputs)} inputs but comm.world_size is {world_size}; pass one tensor per rank"
        )
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise CommError(f"reduce_scatter_async inputs[{i}] is a {type(t).__name__}, not a tensor; pass one tensor per rank")
    first = inputs[0]
    for i, t in enumerate(inputs[1:], start=1):
        for what in ("shape", "dtype", "device"):
            mine, theirs = getattr(t, what), getattr(first, what)
            if mine != theirs:
                shown = (tuple(mine), tuple(theirs)) if what == "shape" else (mine, theirs)
                raise CommError(
                    f"reduce_scatter_async inputs[{i}] has {what} {shown[0]} but inputs[0] has {shown[1]}; "
                    "every rank's input must have the same shape, dtype and device"
                )
    return first.shape, first.dtype, first.device


class ReduceScatterBucketer:
    """Bucket small reduce-scatters into large ones; see [Note: reduce-scatter buckets].

    Args:
        bucket_size_mb: MiB of one bucket, split evenly over the ranks; ``<= 0`` launches
            every input in a collective of its own.

    ``launched`` counts the collectives issued so far.
    """

    def __init__(self, bucket_size_mb: float = 25.0) -> None:
        self.bucket_size_mb = bucket_size_mb
        self.launched = 0
        self._lock = threading.Lock()
        self._launched_cond = threading.Condition(self._lock)
        self._buckets: dict[tuple[torch.dtype, torch.device, CommBackend], list[Bucket]] = {}  # keys in creation order
        self._in_flight: deque[_Collective] = deque()  # in launch order
        self._limit: int | None = None  # elements per rank no bucket needs to exceed (see limit())

    def capacity(self, dtype: torch.dtype, world_size: int) -> int:
        """Elements per rank a bucket of ``dtype`` holds (0 when bucketing is off)."""
        if self.bucket_size_mb <= 0:
            return 0
        full = max(1, int(self.bucket_size_mb * 2**20) // dtype.itemsize // world_size)
        return full if self._limit is None else min(full, self._limit)

    def limit(self, numel: int) -> None:
        """Make no bucket larger than ``numel`` elements per rank: what every input one backward queues adds up to.
        Every input still fits, and the bucket rule launches the same collectives (a bucket holding all of them
        launches only at the flush)."""
        self._limit = max(1, int(numel))

    @property
    def nbytes(self) -> int:
        """Bytes of the buckets' buffers allocated now."""
        with self._lock:
            return sum(b.nbytes for buckets in self._buckets.values() for b in buckets)

    @property
    def buckets(self) -> list[Bucket]:
        """Every bucket, in creation order."""
        with self._lock:
            return [b for buckets in self._buckets.values() for b in buckets]

    @property
    def in_flight(self) -> int:
        """Collectives launched and not yet completed."""
        with self._lock:
            return len(self._in_flight)

    def reduce_scatter_async(self, inputs: Inputs, comm: CommBackend, callback: Callback | None = None) -> Ticket:
        """Queue one reduce-scatter; ``callback(shard)`` gets this rank's sum over ranks.

        ``inputs`` is a list of ``comm.world_size`` tensors of one shape, dtype and device
        (``inputs[r]`` goes to rank ``r``), or one tensor with a row per rank (a contiguous
        one larger than a bucket is sent without a copy). ``shard`` has the shape of one
        rank's input and may be a view into a bucket, valid only during the callback.
        Callbacks are only guaranteed to have run after :meth:`flush` or the ticket's ``wait()``.
        """
        shape, dtype, device = _check_inputs(inputs, comm.world_size)
        numel = shape.numel()
        if numel == 0:  # nothing to send: every rank skips it alike
            collective = _Collective(dtype, None)
            collective.done = True
            if callback is not None:
                callback(torch.empty(shape, dtype=dtype, device=device))
            return Ticket(self, collective, comm, input_released=True)
        capacity = self.capacity(dtype, comm.world_size)
        with self._lock:
            if numel > capacity:
                return Ticket(self, self._launch_alone(inputs, shape, dtype, device, comm, callback), comm,
                              input_released=False)  # sent as it is: it must outlive the collective
            key = (dtype, torch.device(device), comm)
            bucket = self._open_bucket(key, capacity)
            if not bucket.can_take(numel):
                self._launch(bucket, comm)
                bucket = self._open_bucket(key, capacity)  # the launched one is busy until it completes
            bucket.allocate()
            bucket.append(inputs, callback)
            assert bucket._collective is not None
            return Ticket(self, bucket._collective, comm, input_released=True)

    def flush(self) -> None:
        """Launch every partial bucket and complete every collective; then every callback has run.

        Buckets launch in the order their keys first appeared (a key fills one bucket at a
        time), the same on every rank. Once everything has completed, raises the first error:
        a :class:`BucketCallbackError`, or a collective's own failure.
        """
        with self._lock:
            for (_, _, comm), buckets in self._buckets.items():
                for bucket in buckets:
                    if bucket.state is BucketState.FILLING:
                        self._launch(bucket, comm)
            last = self._in_flight[-1] if self._in_flight else None
        if last is not None:
            self._complete_through(last)

    def free(self) -> None:
        """Drop every bucket's buffer; the next :meth:`reduce_scatter_async` allocates again."""
        with self._lock:
            queued = sum(b.queued for buckets in self._buckets.values() for b in buckets)
            if queued or self._in_flight:
                raise BucketError(
                    f"free() while {queued} input(s) are queued and {len(self._in_flight)} reduce-scatter(s) are in flight "
                    "would drop their results; call flush() first"
                )
            for buckets in self._buckets.values():
                for bucket in buckets:
                    bucket.free()

    # -- internals (the caller holds self._lock unless said otherwise) ---------------------------
    def _open_bucket(self, key: tuple[torch.dtype, torch.device, CommBackend], capacity: int) -> Bucket:
        """The key's FILLING bucket, else a spare one, else a new one."""
        buckets = self._buckets.setdefault(key, [])
        spare = None
        for bucket in buckets:
            if bucket.state is BucketState.FILLING:
                return bucket
            if spare is None and bucket.state is not BucketState.LAUNCHED:
                spare = bucket
        if spare is None:
            spare = Bucket(key[2].world_size, capacity, key[0], key[1])
            buckets.append(spare)
        return spare

    def _issued(self, collective: _Collective) -> None:
        collective.seq = self.launched
        self.launched += 1
        self._in_flight.append(collective)
        self._launched_cond.notify_all()

    def _launch(self, bucket: Bucket, comm: CommBackend) -> None:
        try:
            collective = bucket.launch(comm)
        except Exception as err:
            # The rows have moved already, so the queued inputs are lost: fail their tickets loudly.
            failed = bucket._collective
            if bucket.state is BucketState.LAUNCHED and failed is not None:
                failed.failure, failed.done = err, True
                bucket.recycle()
                self._launched_cond.notify_all()
            raise
        self._issued(collective)

    def _launch_alone(
        self, inputs: Inputs, shape: torch.Size, dtype: torch.dtype, device: torch.device, comm: CommBackend,
        callback: Callback | None,
    ) -> _Collective:
        collective = _Collective(dtype, None)
        collective.entries.append(_Entry(0, shape, callback))
        if isinstance(inputs, torch.Tensor):
            send = inputs.reshape(-1)  # a view when contiguous: no copy for large inputs
        else:
            send = torch.cat([t.reshape(-1) for t in inputs])
        collective.output = torch.empty(shape.numel(), dtype=dtype, device=device)
        collective.keep = send
        collective.pending = comm.reduce_scatter(collective.output, send, async_op=True)
        self._issued(collective)
        return collective

    # -- completion (called without self._lock) --------------------------------------------------
    def _wait(self, collective: _Collective, comm: CommBackend) -> None:
        if not collective.done:
            timeout = comm.timeout.total_seconds()
            with self._launched_cond:
                launched = self._launched_cond.wait_for(lambda: collective.seq is not None or collective.done, timeout)
            if not launched:
                raise BucketError(
                    f"waited {timeout:.1f}s for a {collective.describe()}: it is queued in a bucket that was never "
                    "flushed; call flush() on the thread that queues the inputs (collectives are launched only there, "
                    "so that every rank issues them in the same order)"
                )
            self._complete_through(collective)
        if collective.failure is not None:
            raise BucketError(f"{collective.describe()} failed: {collective.failure}") from collective.failure

    def _complete_through(self, target: _Collective) -> None:
        """Complete collectives in launch order up to and including ``target``; raise the first error after."""
        first: BaseException | None = None
        while True:
            with self._lock:
                if target.done or not self._in_flight:
                    break
                head = self._in_flight[0]
            error = self._complete(head)
            if first is None:
                first = error
        if first is not None:
            raise first

    def _complete(self, collective: _Collective) -> BaseException | None:
        """Wait for one launched collective and run its callbacks, unless another thread did."""
        with collective.lock:
            if collective.done:
                return None
            error: BaseException | None
            try:
                if collective.pending is not None:
                    collective.pending.wait()
            except Exception as err:  # the collective itself failed: there is no result to hand out
                collective.failure = error = err
            else:
                error = collective.run_callbacks()
            with self._lock:
                collective.done = True
                head = self._in_flight.popleft()
                assert head is collective, "collectives complete in launch order"
                if collective.bucket is not None:
                    collective.bucket.recycle()
                collective.pending = collective.keep = collective.output = None
            return error
