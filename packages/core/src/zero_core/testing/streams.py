"""A test double for the data plane's streams: it checks [Note: streams of the data plane] on CPU.

Install it with :func:`record_streams` around ``shard()`` (and the steps): every chunk built inside gets a
:class:`RecordingStreams` instead of CUDA's (or the CPU's none). The recorder keeps a vector clock per stream
(what of every other stream's work it has waited for, through events) and, per buffer (tensor storage), who wrote
it last and who read it since. It reports a :class:`StreamViolation` when a buffer is

- **read** on one stream before an event of the stream that wrote it was waited there;
- **reused** (written again) before the event of a stream that read or wrote it since was waited there;
- **freed** (:meth:`Streams.dropped`, or a pool's ``clear``) before the stream it was allocated for waited every
  stream that used it (the caching allocator hands freed memory out again in that stream's order).

The data plane declares what it does with a buffer (:meth:`Streams.wrote`, :meth:`Streams.read`, ...); those calls
do nothing on a real device. Counters (:attr:`RecordingStreams.counts`) let a test show the check was not vacuous.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from zero_core.base._streams import Streams, install_streams

__all__ = ["RecordedEvent", "RecordedStream", "RecordingStreams", "StreamViolation", "record_streams"]


class StreamViolation(AssertionError):
    """A buffer used across streams without the event that orders it (see the module docstring)."""


@dataclass(frozen=True, eq=False)
class RecordedStream:
    name: str

    def __repr__(self) -> str:
        return f"<{self.name} stream>"


@dataclass(frozen=True, eq=False)
class RecordedEvent:
    """An event on ``stream``: it covers the work of every stream up to the epochs in ``clock``."""

    stream: RecordedStream
    clock: dict[RecordedStream, int]


@dataclass
class _Buffer:
    allocated_for: RecordedStream | None
    # (stream, epoch) of the last write, and the latest epoch of each stream's reads since
    written: tuple[RecordedStream, int] | None
    reads: dict[RecordedStream, int] = field(default_factory=dict)
    what: str = ""
    # the compute stream's work so far when a side stream wrote it (to see work that overlapped compute)
    compute_work: int = 0


class RecordingStreams(Streams):
    """Streams and events as vector clocks, and buffers as who wrote and read them: see the module docstring.

    ``strict``: raise at the first violation (the traceback points at the faulty call); otherwise collect them in
    :attr:`violations` for :meth:`check` to report all at once."""

    active = True

    def __init__(self, *, strict: bool = False) -> None:
        self.compute = RecordedStream("compute")
        self.all_gather = RecordedStream("all-gather")
        self.reduce_scatter = RecordedStream("reduce-scatter")
        self.copy = RecordedStream("copy")
        self.host = RecordedStream("host")
        self.strict = strict
        self._lock = threading.RLock()
        # each stream's clock: its own epoch (work enqueued since its last event) and what it waited of the others
        self._clocks: dict[RecordedStream, dict[RecordedStream, int]] = {
            s: {s: 0} for s in (self.compute, self.all_gather, self.reduce_scatter, self.copy, self.host)}
        self._buffers: dict[int, _Buffer] = {}
        self._local = threading.local()
        self.violations: list[str] = []
        # what the data plane did, by kind; "overlapped": buffers a side stream wrote that the compute stream read
        # only after other compute work in between (a prefetch that travelled while another unit computed)
        self.counts: Counter[str] = Counter()
        self._compute_work = 0

    # -- streams and events -------------------------------------------------------------------
    @contextlib.contextmanager
    def _on(self, stream: RecordedStream) -> Iterator[None]:
        stack = self._stack()
        stack.append(stream)
        self.counts[f"on {stream.name}"] += 1
        try:
            yield
        finally:
            stack.pop()

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self._on(stream)

    def _stack(self) -> list[RecordedStream]:
        stack: list[RecordedStream] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    @property
    def current(self) -> RecordedStream:
        """The stream the calling thread enqueues on (the compute stream outside any ``on``)."""
        stack = self._stack()
        return stack[-1] if stack else self.compute

    def record(self, stream: Any) -> RecordedEvent:
        with self._lock:
            clock = self._clocks[stream]
            event = RecordedEvent(stream, dict(clock))
            clock[stream] += 1  # later work on the stream is not covered by this event
            self.counts[f"record {stream.name}"] += 1
            return event

    def wait(self, stream: Any, event: Any) -> None:
        if event is None:
            return
        with self._lock:
            clock = self._clocks[stream]
            for other, epoch in event.clock.items():
                if clock.get(other, -1) < epoch:
                    clock[other] = epoch
            if event.stream is not stream:
                self.counts[f"{stream.name} waits {event.stream.name}"] += 1

    def _sees(self, stream: RecordedStream, at: tuple[RecordedStream, int]) -> bool:
        """Whether ``stream``'s work from now on is ordered after the work of ``at`` (a stream and its epoch)."""
        other, epoch = at
        return other is stream or self._clocks[stream].get(other, -1) >= epoch

    def _now(self, stream: RecordedStream) -> tuple[RecordedStream, int]:
        return stream, self._clocks[stream][stream]

    # -- buffers -----------------------------------------------------------------------------
    @staticmethod
    def _key(buf: torch.Tensor) -> int:
        return buf.untyped_storage().data_ptr()

    def _violation(self, message: str) -> None:
        where = "".join(traceback.format_stack(limit=8)[:-2])
        self.violations.append(f"{message}\n{where}")
        if self.strict:
            raise StreamViolation(message)

    def allocated(self, buf: torch.Tensor, stream: Any) -> None:
        with self._lock:
            self.counts["allocated"] += 1
            key = self._key(buf)
            if key:
                self._buffers[key] = _Buffer(stream, self._now(stream), what=f"{buf.numel()} x {buf.dtype}")

    def wrote(self, buf: torch.Tensor, stream: Any) -> None:
        with self._lock:
            self.counts[f"write on {stream.name}"] += 1
            key = self._key(buf)
            if not key:
                return
            record = self._buffers.get(key)
            if record is None:
                self._buffers[key] = _Buffer(None, self._now(stream), what=f"{buf.numel()} x {buf.dtype}")
                return
            if record.written is not None and not self._sees(stream, record.written):
                self._violation(f"a buffer ({record.what}) written on the {stream.name} stream before the event of the "
                                f"{record.written[0].name} stream, which wrote it")
            for reader, epoch in record.reads.items():
                if not self._sees(stream, (reader, epoch)):
                    self._violation(f"a buffer ({record.what}) reused (written) on the {stream.name} stream before the "
                                    f"event of its consumer, the {reader.name} stream")
            record.written, record.reads = self._now(stream), {}
            record.compute_work = self._compute_work

    def read(self, buf: torch.Tensor, stream: Any) -> None:
        with self._lock:
            self.counts[f"read on {stream.name}"] += 1
            key = self._key(buf)
            record = self._buffers.get(key) if key else None
            if record is None:
                return
            if record.written is not None and not self._sees(stream, record.written):
                self._violation(f"a buffer ({record.what}) read on the {stream.name} stream before the event of the "
                                f"{record.written[0].name} stream, which wrote it")
            record.reads[stream] = self._clocks[stream][stream]
            if stream is self.compute:
                if record.written is not None and record.written[0] is not stream and \
                        self._compute_work > record.compute_work:
                    self.counts["overlapped"] += 1
                self._compute_work += 1

    def dropped(self, buf: torch.Tensor) -> None:
        with self._lock:
            self.counts["dropped"] += 1
            key = self._key(buf)
            record = self._buffers.pop(key, None) if key else None
            if record is None:
                return
            owner = record.allocated_for or self.compute
            users = ([record.written] if record.written is not None else []) + list(record.reads.items())
            for user in users:
                if not self._sees(owner, user):
                    self._violation(f"a buffer ({record.what}) freed while in use: the {user[0].name} stream used it "
                                    f"and the {owner.name} stream, which reuses its memory, has not waited its event")

    # -- for tests -----------------------------------------------------------------------------
    def computing(self) -> None:
        """The compute stream runs model work now (a test's module hook says so): a buffer a side stream wrote
        before and the compute stream reads after counts as ``overlapped``."""
        with self._lock:
            self._compute_work += 1

    def check(self) -> None:
        """Raise :class:`StreamViolation` listing every violation recorded so far."""
        if self.violations:
            raise StreamViolation(f"{len(self.violations)} stream violation(s):\n\n" + "\n\n".join(self.violations))


@contextlib.contextmanager
def record_streams(*, strict: bool = False) -> Iterator[RecordingStreams]:
    """Give every model sharded inside the block one :class:`RecordingStreams` (whatever its device)."""
    recorder = RecordingStreams(strict=strict)
    with install_streams(lambda device: recorder):
        yield recorder
