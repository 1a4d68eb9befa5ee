"""The comm backend interface and the per-step communication counters.

A comm backend runs the collectives a shard strategy needs over one process group.
Every backend counts what it does in a :class:`CommStats`, so tests can assert exact
call and byte counts and benchmarks can compare them with the theoretical volume.

Bytes are counted the way bandwidth-optimal ring algorithms move them (the same
convention as nccl-tests' bus bandwidth): for a collective over ``N`` ranks on a
payload of ``S`` bytes (the full, unsharded size) each rank sends

* all-gather and reduce-scatter: ``(N - 1) / N * S``;
* all-reduce: ``2 * (N - 1) / N * S``;
* broadcast: ``(N - 1) / N * S`` (pipelined ring).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from zero_core.api import ZeroConfig

__all__ = ["CollectiveCount", "CollectiveKind", "CommBackend", "CommStats", "Pending", "ring_bytes_sent"]


class CollectiveKind(enum.Enum):
    """The collectives a backend runs; the key of every counter."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    OBJECT = "object"  # small pickled metadata exchanges at setup
    CONTROL = "control"  # scalar agreements that keep ranks' collective order identical


def ring_bytes_sent(kind: CollectiveKind, payload_bytes: int, world_size: int) -> int:
    """Bytes one rank sends for a collective whose full payload is ``payload_bytes``."""
    if world_size <= 1:
        return 0
    if kind is CollectiveKind.ALL_REDUCE:
        return 2 * (world_size - 1) * payload_bytes // world_size
    return (world_size - 1) * payload_bytes // world_size


@dataclass
class CollectiveCount:
    """Calls made and bytes this rank sent for one collective kind."""

    calls: int = 0
    bytes_sent: int = 0

    def add(self, bytes_sent: int) -> None:
        self.calls += 1
        self.bytes_sent += bytes_sent


@dataclass
class CommStats:
    """Counters of one rank, split into setup and per-step records.

    ``current`` accumulates until :meth:`end_step`; each finished step is appended to
    ``steps``, which keeps the last ``window`` steps only (a long run must not grow
    memory), while ``totals`` and ``step_count`` count every step ever finished,
    exactly. What happened before the first step (``end_setup``) lands in ``setup``.
    """

    window: int = 256
    current: dict[CollectiveKind, CollectiveCount] = field(default_factory=dict)
    setup: dict[CollectiveKind, CollectiveCount] = field(default_factory=dict)
    steps: deque[dict[CollectiveKind, CollectiveCount]] = field(init=False)
    totals: dict[CollectiveKind, CollectiveCount] = field(default_factory=dict)
    step_count: int = 0

    def __post_init__(self) -> None:
        self.steps = deque(maxlen=self.window)

    def record(self, kind: CollectiveKind, bytes_sent: int) -> None:
        self.current.setdefault(kind, CollectiveCount()).add(bytes_sent)

    def end_setup(self) -> None:
        self.setup, self.current = self.current, {}

    def end_step(self) -> dict[CollectiveKind, CollectiveCount]:
        finished, self.current = self.current, {}
        self.steps.append(finished)
        self.step_count += 1
        for kind, count in finished.items():
            total = self.totals.setdefault(kind, CollectiveCount())
            total.calls += count.calls
            total.bytes_sent += count.bytes_sent
        return finished

    @staticmethod
    def calls(record: dict[CollectiveKind, CollectiveCount], kind: CollectiveKind) -> int:
        return record[kind].calls if kind in record else 0

    @staticmethod
    def bytes_sent(record: dict[CollectiveKind, CollectiveCount], kind: CollectiveKind | None = None) -> int:
        if kind is None:
            return sum(c.bytes_sent for c in record.values())
        return record[kind].bytes_sent if kind in record else 0

    def summary(self, record: dict[CollectiveKind, CollectiveCount] | None = None) -> dict[str, dict[str, int]]:
        """A JSON-friendly view of one record (the last finished step by default)."""
        if record is None:
            record = self.steps[-1] if self.steps else self.current
        return {k.value: {"calls": c.calls, "bytes_sent": c.bytes_sent} for k, c in record.items()}


class Pending(Protocol):
    """An asynchronous collective in flight.

    A backend that has already copied a reduce-scatter's input (into a bucket) may set
    ``input_released = True`` on the pending it returns; the caller may then reuse the
    input at once instead of keeping it until :meth:`wait`.
    """

    def wait(self) -> None:
        """Block until it completes (raising on timeout or failure)."""


class _ClosedGroup:
    """Stands for the process group of a closed backend: any collective given it fails at once."""

    def __repr__(self) -> str:
        return "<process group of a closed zero engine>"


class CommBackend(ABC):
    """Collectives over one process group, with counters and a timeout on every call.

    Implementations are constructed by the engine with the process group (``None``
    for the default group, or when running a single process) and a timeout. Inputs
    and outputs are flat, contiguous tensors; ``all_gather`` concatenates the ranks'
    inputs in rank order into ``output`` and ``reduce_scatter`` leaves rank ``r``
    the ``r``-th equal slice of the reduced input.

    Subclass :class:`zero_core.testing.CommBackendConformance` to test a backend.
    """

    name: ClassVar[str]

    def __init__(self, group: Any = None, *, timeout: timedelta = timedelta(minutes=5)) -> None:
        self.group = group
        self.timeout = timeout
        self.stats = CommStats()

    @classmethod
    def from_config(cls, group: Any, *, timeout: timedelta, config: ZeroConfig) -> CommBackend:
        """How :func:`zero_core.shard` builds the backend; override to read options from ``config``."""
        return cls(group, timeout=timeout)

    @classmethod
    def estimate_reduce_scatter_calls(cls, shard_numels: Sequence[int], *, element_size: int, world_size: int,
                                      config: ZeroConfig) -> int:
        """Reduce-scatter calls one step makes for gradients of these shard sizes (in reduction order).

        For :func:`zero_core.estimate`; a backend that merges or splits reduce-scatters
        overrides it. The default: one call per chunk.
        """
        return len(shard_numels)

    def flush(self) -> None:
        """Issue every reduce-scatter the backend still holds back, and complete them all.

        The engine calls it on every rank at the end of each backward, before it reads the
        reduced gradients. Backends that run each collective when asked need nothing here;
        bucketing backends launch their partial buckets.
        """

    def free(self) -> None:
        """Release buffers the backend keeps between steps (they are re-allocated on next use)."""

    def close(self) -> None:
        """Release the buffers and the reference to the process group; the backend cannot communicate afterwards.

        The engine calls it from ``close()``, so that ``torch.distributed.destroy_process_group()``
        frees the group at once instead of at interpreter exit.
        """
        self.free()
        self.group = _ClosedGroup()

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank in the group."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of ranks in the group."""

    @abstractmethod
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Pending | None:
        """Gather every rank's ``input`` into ``output`` (``world_size * input.numel()``).

        With ``async_op=True`` return a :class:`Pending` to wait on before reading ``output``.
        """

    @abstractmethod
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Pending | None:
        """Sum ``input`` over ranks and keep this rank's slice in ``output``.

        With ``async_op=True`` return a :class:`Pending` to wait on; ``input`` must stay
        alive and unchanged until then.
        """

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """Reduce ``tensor`` in place over ranks with ``op`` (``sum`` or ``max``)."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Copy ``tensor`` from rank ``src`` to every rank, in place."""

    @abstractmethod
    def agree_min(self, value: int) -> int:
        """The minimum of ``value`` over ranks (counted as :attr:`CollectiveKind.CONTROL`)."""

    @abstractmethod
    def agree_any(self, flags: torch.Tensor) -> torch.Tensor:
        """Elementwise OR of a 1-D ``uint8`` tensor over ranks (counted as :attr:`CollectiveKind.CONTROL`)."""

    @abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather a small picklable object from every rank, in rank order."""
