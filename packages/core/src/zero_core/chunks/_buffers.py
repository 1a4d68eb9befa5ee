"""The one allocator of full-size buffers: gathered receive buffers, gradient buffers, send buffers.

Every collective of :mod:`zero_core.chunks._collectives` takes its buffers here before it is issued
(allocation apart from the call), so the buffers a phase needs are reused within it and
dropped after it; see [Note: no idle buffers between steps] in ``zero_core.runtime._engine``.
"""

from __future__ import annotations

import threading

import torch

from zero_core.base._host_memory import advise_huge_pages

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
            # advised before the first touch: see [Note: huge pages for the engine's host buffers]
            buf = advise_huge_pages(torch.empty(size, dtype=dtype, device=device))
            return buf.zero_() if zeroed else buf
        return buf.zero_() if zeroed else buf

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault((buf.numel(), buf.dtype, buf.device), []).append(buf)
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
        with self._lock:
            self._free.clear()

    @property
    def nbytes(self) -> int:
        """Bytes of the idle buffers the pool keeps."""
        with self._lock:
            return sum(b.numel() * b.element_size() for bufs in self._free.values() for b in bufs)
