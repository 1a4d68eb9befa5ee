"""The streams of the data plane: CUDA streams and events on a GPU, the same calls doing nothing on CPU.

[Note: streams of the data plane]
On CUDA the data plane runs on four streams of the compute device, as FSDP2 does:

- the **compute** stream (the current stream when ``shard()`` ran): forward, backward, the optimizer, and every
  copy-out of a gathered buffer into the parameters;
- the **all-gather** stream: every all-gather of parameters;
- the **reduce-scatter** stream: every reduce-scatter of gradients;
- the **copy** stream: host<->device copies of master shards and offloaded gradients (pinned host buffers).

The host counts as one more stream (``host``): waiting an event there blocks the host until it passes, which a
copy into host memory needs before the host reads it.

Four rules keep them apart without ``record_stream``:

1. A stream reads what another wrote only after waiting an event the writer recorded after the write
   (``wait(stream, record(writer))``): an all-gather waits the compute stream's event (its send buffer was packed
   there), the copy-out waits the all-gather's, a reduce-scatter waits the compute stream's, the gradient's landing
   waits the reduce-scatter's.
2. Every buffer is allocated on the stream that consumes it, the compute stream (receive buffers are read by the
   copy-out, send buffers written by the packing, gradients read by the optimizer), so the caching allocator's
   stream-ordered reuse is safe for it; a side stream that writes such a buffer first waits the compute stream's
   event recorded after the allocation (rule 1).
3. A pooled buffer goes back to its :class:`~zero_core.chunks._buffers.BufferPool` with the event after which it
   is free (``give(buf, after=event)``); the pool makes the next borrower's stream wait that event before handing
   it out. A buffer a side stream used is dropped only after the compute stream has waited that stream's event.
4. The next unit's all-gather is issued (on the all-gather stream) before the current unit computes, and awaited
   by event when its unit needs it, never by blocking the host.

The calls that say what a buffer is used for (:meth:`Streams.wrote`, :meth:`Streams.read`,
:meth:`Streams.allocated`, :meth:`Streams.dropped`) do nothing here or on CUDA: they are for the recording double
(``zero_core.testing.streams``), which checks the rules above on CPU. On CPU every call is a no-op on an object
built once, so the hot path pays a method call and nothing else.

Which ``Streams`` a device gets is decided in one place, :func:`streams_for`, at ``shard()``; tests install a
recorder there with :func:`install_streams` (``zero_core.testing.streams.record_streams``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["CudaStreams", "Streams", "install_streams", "streams_for"]

_NO_CONTEXT = contextlib.nullcontext()


class Streams:
    """No streams: every call is a no-op (the CPU, and any device without CUDA streams).

    The stream attributes are opaque handles; ``None`` here. ``record`` returns an event to hand to ``wait`` or to
    :meth:`BufferPool.give` (``None`` here)."""

    active = False
    compute: Any = None
    all_gather: Any = None
    reduce_scatter: Any = None
    copy: Any = None
    host: Any = None

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Run what the block enqueues on ``stream``."""
        return _NO_CONTEXT

    def record(self, stream: Any) -> Any:
        """An event on ``stream`` after the work enqueued on it so far."""
        return None

    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream``'s later work wait ``event`` (``None``: nothing to wait for)."""

    # What the data plane does with a buffer, for the recording double; no-ops on real devices.
    def allocated(self, buf: torch.Tensor, stream: Any) -> None:
        """``buf`` was just allocated for ``stream``."""

    def wrote(self, buf: torch.Tensor, stream: Any) -> None:
        """``stream`` writes ``buf`` (enqueued now)."""

    def read(self, buf: torch.Tensor, stream: Any) -> None:
        """``stream`` reads ``buf`` (enqueued now)."""

    def dropped(self, buf: torch.Tensor) -> None:
        """The data plane lets go of ``buf``'s memory (its last reference, or a storage resized to nothing)."""


class CudaStreams(Streams):
    """The streams of one CUDA device (see [Note: streams of the data plane])."""

    active = True
    host = "host"  # wait(host, event) blocks the host until the event passes

    def __init__(self, device: torch.device) -> None:
        self.compute = torch.cuda.current_stream(device)
        # higher priority than compute, as FSDP2 does: a collective waiting behind compute kernels delays the next unit
        self.all_gather = torch.cuda.Stream(device, priority=-1)
        self.reduce_scatter = torch.cuda.Stream(device, priority=-1)
        self.copy = torch.cuda.Stream(device)

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def record(self, stream: Any) -> Any:
        return stream.record_event()

    def wait(self, stream: Any, event: Any) -> None:
        if event is None:
            return
        if stream is self.host:
            event.synchronize()
        else:
            stream.wait_event(event)


NO_STREAMS = Streams()
_cuda: dict[torch.device, CudaStreams] = {}
_factory: Callable[[torch.device], Streams] | None = None


def streams_for(device: torch.device) -> Streams:
    """The streams of ``device``'s data plane: one :class:`CudaStreams` per CUDA device, none elsewhere, or what a
    test installed (:func:`install_streams`)."""
    if _factory is not None:
        return _factory(device)
    if device.type != "cuda":
        return NO_STREAMS
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _cuda:
        _cuda[device] = CudaStreams(device)
    return _cuda[device]


@contextlib.contextmanager
def install_streams(factory: Callable[[torch.device], Streams]) -> Iterator[None]:
    """Inside the block, :func:`streams_for` answers with ``factory(device)`` (the seam tests use to install a
    recording double; models sharded inside keep theirs after it)."""
    global _factory
    previous, _factory = _factory, factory
    try:
        yield
    finally:
        _factory = previous
