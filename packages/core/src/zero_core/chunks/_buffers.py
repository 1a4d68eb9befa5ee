"""The one allocator of full-size buffers: gathered receive buffers, gradient buffers, send buffers.

Every collective of :mod:`zero_core.chunks._collectives` takes its buffers here before it is issued
(allocation apart from the call), so the buffers a phase needs are reused within it and
dropped after it; see [Note: no idle buffers between steps] in ``zero_core.runtime._engine``. On CUDA a buffer
comes back with the event after which it is free, and the next borrower's stream waits that event (no
``record_stream``): see [Note: streams of the data plane] in ``zero_core.base._streams``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from zero_core.base._host_memory import advise_huge_pages
from zero_core.base._streams import NO_STREAMS, Streams

__all__ = ["BufferPool"]


class BufferPool:
    """Reusable full-size buffers (gradients, receive buffers), keyed by (size, dtype, device).

    Fresh multi-megabyte CPU allocations are mapped anew and page-faulted on first touch
    (in 2 MiB pages where the kernel allows, see [Note: huge pages for the engine's host
    buffers] in ``zero_core.base._host_memory``), which cost about as much as the gradient copy
    itself; a pool keeps the few buffers a
    backward has in flight at once. It keeps them for one phase only (:meth:`clear`): see
    [Note: no idle buffers between steps] in ``zero_core.runtime._engine``. Thread-safe: the
    reduction waiter returns buffers.
    """

    def __init__(self, streams: Streams = NO_STREAMS) -> None:
        self.streams = streams
        # each idle buffer with the event after which it is free (None: free in the compute stream's order)
        self._free: dict[tuple[int, torch.dtype, torch.device], list[tuple[torch.Tensor, Any]]] = {}
        self._lock = threading.Lock()
        # Bytes of buffers taken and not given back (in use by a backward or a reduction in flight).
        self.lent = 0

    def take(self, size: int, dtype: torch.dtype, device: torch.device, *, zeroed: bool = True,
             stream: Any = None) -> torch.Tensor:
        """A buffer of ``size`` elements, zero-filled unless ``zeroed=False`` (a buffer about to be overwritten).

        ``stream`` is the stream that uses it first (the compute stream when ``None``): it waits the event the
        buffer came back with before it is handed out. New buffers are allocated on the compute stream, the one that
        consumes every pooled buffer (see [Note: streams of the data plane] in ``zero_core.base._streams``)."""
        streams = self.streams
        with self._lock:
            free = self._free.get((size, dtype, device))
            buf, event = free.pop() if free else (None, None)
            self.lent += size * dtype.itemsize
        if streams is NO_STREAMS:  # nothing to order (the host): none of the stream calls below, one per chunk each
            if buf is None:
                buf = advise_huge_pages(torch.empty(size, dtype=dtype, device=device))
            return buf.zero_() if zeroed else buf
        if stream is None:
            stream = streams.compute
        if buf is None:
            # advised before the first touch: see [Note: huge pages for the engine's host buffers]
            buf = advise_huge_pages(torch.empty(size, dtype=dtype, device=device))
            streams.allocated(buf, streams.compute)
        else:
            streams.wait(stream, event)
        if zeroed:
            streams.wrote(buf, stream)
            with streams.on(stream):
                buf.zero_()
        return buf

    def give(self, buf: torch.Tensor, after: Any = None) -> None:
        """Take back ``buf``, free once ``after`` (an event of the stream that used it last) has passed; ``None``: free
        in the compute stream's order (the compute stream used it last, or waited for whoever did): the pool
        records the compute stream's event now, which the next borrower's stream waits."""
        if after is None:
            after = self.streams.record(self.streams.compute)
        with self._lock:
            self._free.setdefault((buf.numel(), buf.dtype, buf.device), []).append((buf, after))
            self.lent -= buf.numel() * buf.element_size()

    def keep(self, buf: torch.Tensor) -> None:
        """``buf`` was taken and will never come back (it became a gradient): stop counting it as lent."""
        with self._lock:
            self.lent -= buf.numel() * buf.element_size()

    def clear(self) -> None:
        """Drop the idle buffers (the lent ones come back and are kept until the next ``clear``).

        The engine clears its pool when a backward's reductions are done and after each step, so no
        full-size buffer sits idle between steps: the memory goes back to the allocator, where the next
        forward's activations reuse it, instead of being reserved for a phase that is over."""
        streams = self.streams
        with self._lock:
            free, self._free = self._free, {}
        for bufs in free.values():
            for buf, event in bufs:
                streams.wait(streams.compute, event)  # the caching allocator reuses it in the compute stream's order
                streams.dropped(buf)

    @property
    def nbytes(self) -> int:
        """Bytes of the idle buffers the pool keeps."""
        with self._lock:
            return sum(b.numel() * b.element_size() for bufs in self._free.values() for b, _ in bufs)
