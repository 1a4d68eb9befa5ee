"""Freed host buffers go back to the system. See [Note: host memory that is freed is returned].

[Note: host memory that is freed is returned]
On the CPU every buffer the engine frees (a stage-3 full buffer after its chunk's
compute, a gradient or send buffer after its reduction, a reduced shard at
``zero_grad``) goes to glibc's malloc. glibc maps an allocation of at least its *mmap
threshold* on its own and unmaps it on free; smaller ones come from its heap, which
keeps freed memory. The threshold starts at 128 KiB and rises to the size of every
mapped block that is freed, up to 32 MiB, so after the first step a chunk-sized buffer
(a few MiB to tens of MiB) lands in the heap, where buffers of many sizes and lifetimes
(chunks, activations, the optimizer's temporaries) interleave and fragment. The resident
set then holds memory no tensor uses: on GPT-2 small at 2 gloo ranks, 300 to 1,000 MiB
at the step's peak (``nox -s bench``, "allocator slack"), more than the gradient shards.

So ``shard()`` fixes the threshold at 4 MiB (``mallopt(M_MMAP_THRESHOLD)``), which also
stops it rising: every buffer of a chunk's size is mapped on its own and returned when
freed, while small allocations keep the heap's speed. Measured on that model: the peak
resident set at stage 2 fell from 3,150 to 2,462 MiB with the same step time (the
allocator's slack at the peak from 304 to 264 MiB, the rest being buffers no longer kept).
The setting is process-wide, as an allocator's is; ``ZeroConfig(release_host_memory=False)``
leaves malloc as it is. Other C libraries (musl, macOS) are left alone, and so is CUDA
memory (the caching allocator returns nothing either way; reserved bytes are its own).

[Note: huge pages for the engine's host buffers]
A buffer mapped on its own is faulted in page by page on first touch, 4 KiB at a time: a
stage-3 step on a 48-block model (``nox -s bench --model thin-48``) allocates about 200 MiB
of such buffers (gathered full buffers, receive and send buffers, reduced gradients) and
spent about 70 ms of its 470 ms in those faults. Where the kernel's transparent huge pages
are enabled on request (``/sys/kernel/mm/transparent_hugepage/enabled`` reads
``[madvise]``, the common default), the engine asks for them on each host buffer of at
least 4 MiB it allocates, before touching it (``madvise(MADV_HUGEPAGE)`` on its whole
2 MiB pages, torch's own ``THP_MEM_ALLOC_ENABLE`` for just the engine's buffers): one fault
per 2 MiB. Measured on that model at 2 ranks: 476 to 399 ms per step, peak resident set
754 to 765 MiB. Memory stays returned on free as above; with ``always`` the kernel does it
anyway, with ``never`` nothing is asked, and with ``release_host_memory=False`` (buffers in
malloc's heap, where advice would outlive them) neither.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable

import torch

__all__ = ["MMAP_THRESHOLD_BYTES", "advise_huge_pages", "return_freed_host_memory"]

MMAP_THRESHOLD_BYTES = 4 << 20
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_MADV_HUGEPAGE = 14  # linux/mman.h
_HUGE_PAGE = 2 << 20
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
# Set once shard() fixed the threshold: buffers of at least 4 MiB are then mappings of their own, which advice
# about their pages concerns alone (in malloc's heap it would outlive them).
_mapped_alone = False


@functools.cache
def return_freed_host_memory() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` (once per process); False where there is no glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: other C libraries' mallopt takes other parameters
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    global _mapped_alone
    _mapped_alone = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    return _mapped_alone


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` where transparent huge pages are given on request only (``[madvise]``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open(_THP_MODE) as f:
            if "[madvise]" not in f.read():
                return None  # "always": the kernel gives them unasked; "never": it refuses
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def advise_huge_pages(buf: torch.Tensor) -> torch.Tensor:
    """Ask for transparent huge pages on a fresh host buffer's whole 2 MiB pages, before it is touched; returns
    ``buf``. See [Note: huge pages for the engine's host buffers]. No-op on other devices, below 4 MiB, where
    the kernel does not take the advice, and unless ``shard()`` fixed malloc's mmap threshold (with
    ``ZeroConfig(release_host_memory=False)`` malloc and its pages are left as they are)."""
    nbytes = buf.numel() * buf.element_size()
    if not _mapped_alone or nbytes < MMAP_THRESHOLD_BYTES or buf.device.type != "cpu":  # size first: the device is an object made per ask
        return buf
    madvise = _madvise()
    if madvise is None:
        return buf
    start = buf.data_ptr()
    lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    hi = (start + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if hi > lo:
        madvise(lo, hi - lo, _MADV_HUGEPAGE)  # advice only: a refusal (EINVAL, ENOMEM) leaves ordinary pages
    return buf
