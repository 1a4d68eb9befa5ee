"""The ``bucketed`` comm backend: the torch backend with gradient reduce-scatters packed into buckets."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from zero_comm._bucketer import ReduceScatterBucketer, Ticket
from zero_comm._torch_backend import TorchCommBackend, check_reduce_scatter_sizes
from zero_core import CommStats
from zero_core.plugin import CommBackend

if TYPE_CHECKING:
    from zero_core import ZeroConfig
    from zero_core.plugin import Pending

__all__ = ["BucketedCommBackend"]


class _QueuedReduceScatter:
    """The :class:`~zero_core.plugin.Pending` of a bucketed reduce-scatter.

    A wait on the thread that queued the input flushes first: that thread is the only one
    that launches collectives, so it would otherwise wait for a launch that cannot come, and
    a flush there happens at the same point of every rank's program. Any other thread (the
    engine's reduction waiter) only waits, see [Note: reduce-scatter buckets].
    """

    def __init__(self, backend: BucketedCommBackend, ticket: Ticket) -> None:
        self._backend, self._ticket, self._thread = backend, ticket, threading.get_ident()
        self.input_released = ticket.input_released

    def wait(self) -> None:
        if not self._ticket.launched and threading.get_ident() == self._thread:
            self._backend.flush()
        self._ticket.wait()


class BucketedCommBackend(TorchCommBackend):
    """The torch backend, with reduce-scatters bucketed by a :class:`ReduceScatterBucketer`.

    ``reduce_scatter(async_op=True)`` only queues the input (copying it into a bucket
    unless it is larger than one); buckets launch when full and at :meth:`flush`, which
    the engine calls at the end of every backward. A synchronous ``reduce_scatter``
    flushes. Every other collective is the torch backend's.

    The bucketer launches through an inner torch backend over the same group, so that a
    launch does not come back into the bucketing; it shares :attr:`stats` (also after
    ``stats`` is reassigned), so each collective on the wire is counted once.

    Args:
        bucket_size_mb: MiB of one bucket, split over the ranks (``ZeroConfig.reduce_bucket_mb``);
            ``<= 0`` sends every reduce-scatter at once.
    """

    name = "bucketed"

    def __init__(self, group: Any = None, *, timeout: timedelta = timedelta(minutes=5), bucket_size_mb: float = 25.0) -> None:
        super().__init__(group, timeout=timeout)
        self._inner = TorchCommBackend(group, timeout=timeout)
        self._inner.stats = self.stats
        self.bucketer = ReduceScatterBucketer(bucket_size_mb)

    @classmethod
    def from_config(cls, group: Any, *, timeout: timedelta, config: ZeroConfig) -> CommBackend:
        return cls(group, timeout=timeout, bucket_size_mb=config.reduce_bucket_mb)

    @classmethod
    def estimate_reduce_scatter_calls(cls, shard_numels: Sequence[int], *, element_size: int, world_size: int,
                                      config: ZeroConfig) -> int:
        """The bucket rule: a bucket that cannot take the next input launches first, an input
        larger than a bucket goes alone, and the last partial bucket goes at the flush."""
        if config.reduce_bucket_mb <= 0:
            return len(shard_numels)
        capacity = max(1, int(config.reduce_bucket_mb * 2**20) // element_size // world_size)
        calls, filled = 0, 0
        for numel in shard_numels:
            if numel == 0:
                continue
            if numel > capacity:
                calls += 1
                continue
            if filled + numel > capacity:
                calls, filled = calls + 1, 0
            filled += numel
        return calls + (filled > 0)

    @property
    def stats(self) -> CommStats:
        return self._stats

    @stats.setter
    def stats(self, value: CommStats) -> None:
        self._stats = value
        inner = self.__dict__.get("_inner")  # absent while CommBackend.__init__ sets the first one
        if inner is not None:
            inner.stats = value

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Pending | None:
        check_reduce_scatter_sizes(output, input, self.world_size)
        if self.world_size == 1:
            output.copy_(input.reshape(output.shape))
            return None

        def store(shard: torch.Tensor) -> None:
            output.copy_(shard.reshape(output.shape))

        ticket = self.bucketer.reduce_scatter_async(input.reshape(self.world_size, -1), self._inner, store)
        if async_op:
            return _QueuedReduceScatter(self, ticket)
        self.flush()
        return None

    def flush(self) -> None:
        self.bucketer.flush()

    def free(self) -> None:
        super().free()
        self._inner.free()
        self.bucketer.free()

    @property
    def buffer_bytes(self) -> int:
        return super().buffer_bytes + self._inner.buffer_bytes + self.bucketer.nbytes

    def expect_reduce_scatters(self, numels: Sequence[int]) -> None:
        # a model smaller than a bucket fills one bucket: allocating the full reduce_bucket_mb would only add memory
        self.bucketer.limit(sum(numels))

    def close(self) -> None:
        super().close()
        self._inner.close()
