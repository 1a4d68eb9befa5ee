"""Per-step communication counters: what every comm backend records, per collective kind.

Every backend counts what it does in a :class:`CommStats`, so tests can assert exact
call and byte counts and benchmarks can compare them with the theoretical volume.

Bytes are counted the way bandwidth-optimal ring algorithms move them (the same
convention as nccl-tests' bus bandwidth): for a collective over ``N`` ranks on a
payload of ``S`` bytes (the full, unsharded size) each rank sends

* all-gather and reduce-scatter: ``(N - 1) / N * S``;
* all-reduce: ``2 * (N - 1) / N * S``;
* broadcast: ``(N - 1) / N * S`` (pipelined ring).

[Note: collective timing]
Each collective's wall time is measured from its issue to the return of its ``wait()``
(for a blocking call, the call itself), and the part of it the waiting thread spent
blocked. An asynchronous collective waited on later (a prefetched all-gather) thus
spans the compute it overlapped: ``seconds`` is an upper bound on its duration and
``blocked_seconds`` (the exposed communication) a lower bound; for a blocking
collective the two are equal. Bandwidths follow nccl-tests: ``algbw = S / seconds``
on the full payload ``S``, ``busbw = bytes_sent / seconds`` on the bytes counted above,
which is ``algbw * (N - 1) / N`` for all-gather and reduce-scatter and
``algbw * 2 (N - 1) / N`` for all-reduce (nccl-tests counts a broadcast's busbw as its
algbw; here it is ``(N - 1) / N`` of it, as its counter). Timing is on by default for
collectives on CPU tensors (a ``perf_counter`` pair each) and off for CUDA tensors,
where the host does not wait for the transfer and a measurement needs a device
synchronize before the issue and after the wait (which also removes overlap):
``CommStats.timing = True`` turns that on, ``False`` turns all timing off.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CollectiveCount", "CollectiveKind", "CommStats", "ring_bytes_sent"]


class CollectiveKind(enum.Enum):
    """The collectives a backend runs; the key of every counter."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    OBJECT = "object"  # small pickled metadata exchanges at setup
    CONTROL = "control"  # scalar agreements that keep ranks' collective order identical
    ALL_TO_ALL = "all_to_all"  # whole-tensor optimizer steps: pieces to each parameter's owner and back


def ring_bytes_sent(kind: CollectiveKind, payload_bytes: int, world_size: int) -> int:
    """Bytes one rank sends for a collective whose full payload is ``payload_bytes``."""
    if world_size <= 1:
        return 0
    if kind is CollectiveKind.ALL_REDUCE:
        return 2 * (world_size - 1) * payload_bytes // world_size
    return (world_size - 1) * payload_bytes // world_size


@dataclass
class CollectiveCount:
    """Calls made and bytes this rank sent for one collective kind, and the time they took.

    ``calls``, ``bytes_sent`` and ``payload_bytes`` count every call exactly; the time
    fields cover the ``timed_calls`` whose time was measured (all of them on CPU by
    default), see [Note: collective timing] in ``zero_core.comm._comm_stats``.

    Attributes:
        calls: Collectives issued.
        bytes_sent: Bytes this rank sent in them, the ring way (``ring_bytes_sent``).
        payload_bytes: Their full (unsharded) payloads ``S``, nccl-tests' message size.
            Object exchanges count 0 (their pickled size is not counted).
        timed_calls: Calls whose time was measured.
        seconds: Wall time of the timed calls, each from issue to the return of its wait.
        blocked_seconds: The part of ``seconds`` the waiting thread spent blocked.
    """

    calls: int = 0
    bytes_sent: int = 0
    payload_bytes: int = 0
    timed_calls: int = 0
    seconds: float = 0.0
    blocked_seconds: float = 0.0

    def add(self, bytes_sent: int, payload_bytes: int = 0) -> None:
        self.calls += 1
        self.bytes_sent += bytes_sent
        self.payload_bytes += payload_bytes

    def add_time(self, seconds: float, blocked_seconds: float) -> None:
        self.timed_calls += 1
        self.seconds += seconds
        self.blocked_seconds += blocked_seconds

    def merge(self, other: CollectiveCount) -> None:
        """Add ``other``'s counts and times to these."""
        self.calls += other.calls
        self.bytes_sent += other.bytes_sent
        self.payload_bytes += other.payload_bytes
        self.timed_calls += other.timed_calls
        self.seconds += other.seconds
        self.blocked_seconds += other.blocked_seconds

    @property
    def latency_ms(self) -> float | None:
        """Mean milliseconds per timed call; ``None`` when no call was timed."""
        return 1e3 * self.seconds / self.timed_calls if self.timed_calls else None

    def _rate(self, nbytes: int) -> float | None:
        # bytes of untimed calls would inflate the rate, so it needs every call timed
        if self.timed_calls != self.calls or self.seconds <= 0 or nbytes <= 0:
            return None
        return nbytes / self.seconds / 1e9

    @property
    def algbw_gbps(self) -> float | None:
        """Algorithmic bandwidth, ``payload_bytes / seconds`` in GB/s (1e9 bytes); ``None`` unless
        every call was timed and carried bytes."""
        return self._rate(self.payload_bytes)

    @property
    def busbw_gbps(self) -> float | None:
        """Bus bandwidth, ``bytes_sent / seconds`` in GB/s (1e9 bytes): nccl-tests' busbw for
        all-gather, reduce-scatter and all-reduce; ``None`` as for :attr:`algbw_gbps`."""
        return self._rate(self.bytes_sent)


Record = dict[CollectiveKind, CollectiveCount]  # one step's (or the setup's) counts, by kind


@dataclass
class CommStats:
    """Counters of one rank, split into setup and per-step records.

    ``current`` accumulates until :meth:`end_step`; each finished step is appended to
    ``steps``, which keeps the last ``window`` steps only (a long run must not grow
    memory), while ``totals`` and ``step_count`` count every step ever finished,
    exactly. What happened before the first step (``end_setup``) lands in ``setup``.

    A record maps each :class:`CollectiveKind` that ran to its :class:`CollectiveCount`:
    calls, bytes, and measured time, from which :attr:`CollectiveCount.latency_ms`,
    :attr:`~CollectiveCount.algbw_gbps` and :attr:`~CollectiveCount.busbw_gbps` follow.
    :meth:`table` prints a record like DeepSpeed's comms logger, with the predicted
    bytes beside the measured ones; :meth:`timed_summary` is the same as JSON.

    Attributes:
        timing: Whether collectives are timed: ``None`` (default) times those on CPU
            tensors only, ``True`` also those on CUDA tensors (a device synchronize
            before and after each, for measuring, not for training), ``False`` none.
            See [Note: collective timing] in ``zero_core.comm._comm_stats``.
        clock: Seconds for the timing (``time.perf_counter``).
    """

    window: int = 256
    current: Record = field(default_factory=dict)
    setup: Record = field(default_factory=dict)
    steps: deque[Record] = field(init=False)
    totals: Record = field(default_factory=dict)
    step_count: int = 0
    timing: bool | None = None
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False, compare=False)
    # a reduction may complete (and be timed) on the engine's waiter thread
    _lock: threading.Lock = field(init=False, repr=False, compare=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.steps = deque(maxlen=self.window)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def times(self, device: torch.device) -> bool:
        """Whether a collective on ``device`` is timed, by :attr:`timing`."""
        return device.type != "cuda" if self.timing is None else self.timing

    def record(self, kind: CollectiveKind, bytes_sent: int, *, payload_bytes: int = 0) -> CollectiveCount:
        """Count one call in the current step; returns its kind's count, for :meth:`add_time`."""
        with self._lock:
            count = self.current.setdefault(kind, CollectiveCount())
            count.add(bytes_sent, payload_bytes)
        return count

    def add_time(self, count: CollectiveCount, seconds: float, blocked_seconds: float) -> None:
        """Add one call's measured time to the count :meth:`record` returned for it (from any thread)."""
        with self._lock:
            count.add_time(seconds, blocked_seconds)

    def end_setup(self) -> None:
        with self._lock:
            self.setup, self.current = self.current, {}

    def end_step(self) -> Record:
        with self._lock:
            finished, self.current = self.current, {}
            self.steps.append(finished)
            self.step_count += 1
            for kind, count in finished.items():
                self.totals.setdefault(kind, CollectiveCount()).merge(count)
        return finished

    @staticmethod
    def calls(record: Record, kind: CollectiveKind) -> int:
        return record[kind].calls if kind in record else 0

    @staticmethod
    def bytes_sent(record: Record, kind: CollectiveKind | None = None) -> int:
        if kind is None:
            return sum(c.bytes_sent for c in record.values())
        return record[kind].bytes_sent if kind in record else 0

    @staticmethod
    def combine(records: Iterable[Record]) -> Record:
        """The sum of several records (for example ``list(stats.steps)[warmup:]``), as one new record."""
        combined: Record = {}
        for record in records:
            for kind, count in record.items():
                combined.setdefault(kind, CollectiveCount()).merge(count)
        return combined

    def _last(self, record: Record | None) -> Record:
        if record is not None:
            return record
        return self.steps[-1] if self.steps else self.current

    def summary(self, record: Record | None = None) -> dict[str, dict[str, int]]:
        """A JSON-friendly view of one record's calls and bytes (the last finished step by default)."""
        record = self._last(record)
        return {k.value: {"calls": c.calls, "bytes_sent": c.bytes_sent} for k, c in record.items()}

    def timed_summary(self, record: Record | None = None, *, steps: int = 1) -> dict[str, dict[str, float | None]]:
        """:meth:`summary` with the payload, the time and the bandwidths, per kind.

        Args:
            record: The record to show; the last finished step by default.
            steps: How many steps ``record`` sums (a :meth:`combine` of several): calls,
                bytes and seconds are divided by it, to means per step. Latency and
                bandwidths are ratios and do not change.

        Returns:
            By kind name, a mapping of every :class:`CollectiveCount` field and the
            properties ``latency_ms``, ``algbw_gbps`` and ``busbw_gbps`` (``None`` when not measured).
        """
        record = self._last(record)

        def per_step(value: float) -> float:
            return value if steps == 1 else value / steps  # one step keeps the exact integers

        return {
            k.value: {"calls": per_step(c.calls), "bytes_sent": per_step(c.bytes_sent), "payload_bytes": per_step(c.payload_bytes),
                      "timed_calls": per_step(c.timed_calls), "seconds": per_step(c.seconds),
                      "blocked_seconds": per_step(c.blocked_seconds), "latency_ms": c.latency_ms,
                      "algbw_gbps": c.algbw_gbps, "busbw_gbps": c.busbw_gbps}
            for k, c in record.items()
        }

    def table(self, record: Record | None = None, *, steps: int = 1, theory: Mapping[str, int] | None = None) -> str:
        """One line per collective kind and a total, as DeepSpeed's comms logger prints them.

        Columns: calls, bytes sent, the bytes ``theory`` predicts, total ms, mean latency
        in ms, algbw and busbw in GB/s, and blocked ms. ``-`` marks a figure that was not
        measured (timing off, or no bytes to time) or not predicted. The total row has no
        latency or algbw (they mean nothing across kinds), and a prediction only when
        ``theory`` predicts every kind in the record.

        Args:
            record: The record to show; the last finished step by default.
            steps: How many steps ``record`` sums (see :meth:`timed_summary`); calls,
                bytes and ms are shown per step.
            theory: Predicted bytes sent per step by kind name, such as
                ``zero_core.estimate(...).bytes_sent``.

        Returns:
            The table, one line per row, without a trailing newline.
        """
        record = self._last(record)
        rows = [("collective", "calls", "sent", "theory", "total ms", "latency ms", "algbw GB/s", "busbw GB/s", "blocked ms")]
        named = [(k.value, record[k]) for k in CollectiveKind if k in record]
        theory = dict(theory or {})
        if all(name in theory for name, _ in named):  # a total only when it predicts every kind that ran
            theory["total"] = sum(theory[name] for name, _ in named)
        for name, c in named + [("total", _sum(record.values()))]:
            predicted = theory.get(name)
            timed = c.timed_calls > 0
            kind_row = name != "total"
            rows.append((name, _num(c.calls / steps), _size(c.bytes_sent / steps), "-" if predicted is None else _size(predicted),
                         f"{1e3 * c.seconds / steps:.3f}" if timed else "-", _opt(c.latency_ms if kind_row else None, ".3f"),
                         _opt(c.algbw_gbps if kind_row else None, ".3g"), _opt(c.busbw_gbps, ".3g"),
                         f"{1e3 * c.blocked_seconds / steps:.3f}" if timed else "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join(
            "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
            for row in rows)


def _sum(counts: Iterable[CollectiveCount]) -> CollectiveCount:
    total = CollectiveCount()
    for count in counts:
        total.merge(count)
    return total


def _num(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else f"{value:.2f}"


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"


def _opt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
