"""The disk tier: one file per chunk part, written and read in one block each, replaced atomically.

[Note: the disk tier's I/O thread]
Every read, write and delete of a store runs on one I/O thread of its own, in the order
they were issued: a read issued after a write of the same file sees what was written,
whether the caller waited for the write or not. Python's file calls let go of the GIL
while the kernel copies, so the training thread computes (an optimizer step, a
gather) while the thread reads the next chunk's file or writes the last one's.

:meth:`DiskStore.read` and :meth:`DiskStore.write` wait for their own job, as plain
calls would. :meth:`DiskStore.read_ahead` returns at once with a :class:`Pending`
read, and inside :meth:`DiskStore.behind` writes return at once too (*write-behind*):
the store keeps the written tensors alive until their bytes are in the file, and the
first failure is raised by the next :meth:`DiskStore.flush` (the bytes a failed
write-behind held are gone by then, so the error says so). A plain write is fsynced
before it is renamed into place; write-behinds are fsynced together by ``flush``, so
the disk takes them as one stream instead of waiting out each file (a full local disk
still fails the ``write`` call itself).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from zero_offload.errors import DiskTierError

__all__ = ["DiskStore", "Pending"]


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    return tensor.view(torch.uint8).numpy().data


class Pending:
    """A read issued ahead (:meth:`DiskStore.read_ahead`): its tensors are filled once :meth:`wait` returns."""

    def __init__(self, name: str, tensors: list[torch.Tensor], future: Future[None]) -> None:
        self.name = name
        self.tensors = tensors
        self._future = future

    def wait(self) -> list[torch.Tensor]:
        """The filled tensors, once the read is done (a failed read raises its DiskTierError here)."""
        self._future.result()
        return self.tensors


class DiskStore:
    """Files under a private directory of ``root``, removed when the store is collected or the process exits.

    A write goes to ``name.tmp`` and is renamed over ``name`` only once complete, so a failed
    write (a full disk) leaves the previous file, and the caller's tensors, as they were.
    I/O runs on the store's own thread, in issue order: see [Note: the disk tier's I/O thread].

    Attributes:
        events: When a list (the default is None), the I/O thread appends ``(what, name)`` to it as each job is
            issued and done: ``"read issued"``, ``"read done"``, ``"write issued"``, ``"write done"``.
            Tests and benchmarks read the order of events from it.
        io_seconds: Wall time the I/O thread spent in reads and writes.
    """

    def __init__(self, root: str, *, rank: int) -> None:
        try:
            os.makedirs(root, exist_ok=True)
            self.directory = tempfile.mkdtemp(prefix=f"zero-rank{rank}-", dir=root)
            probe = os.path.join(self.directory, "probe")
            with open(probe, "wb") as f:
                f.write(b"0")
            os.remove(probe)
        except OSError as e:
            raise DiskTierError(
                f"the disk tier's directory {root!r} is not writable ({e.strerror or e}); "
                "set TierConfig(disk_dir=...) to a writable directory on a local disk, or None to disable the disk tier"
            ) from e
        # one thread: jobs run in issue order (see the note); it exits with the store
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"zero-disk-rank{rank}")
        self._cleanup = weakref.finalize(self, _shut, self._io, self.directory)
        self._lock = threading.Lock()
        self._behind = 0
        self._writes: list[tuple[str, Future[None]]] = []  # write-behinds not yet flushed
        self.bytes_written = 0
        self.bytes_read = 0
        self.io_seconds = 0.0
        self.events: list[tuple[str, str]] | None = None

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def note(self, what: str, name: str) -> None:
        """Append ``(what, name)`` to :attr:`events` when it is a list (the step's own events, beside the I/O's)."""
        events = self.events
        if events is not None:
            with self._lock:
                events.append((what, name))

    def _submit(self, what: str, name: str, job: Callable[[], None]) -> Future[None]:
        self.note(f"{what} issued", name)

        def run() -> None:
            start = time.perf_counter()
            try:
                job()
            finally:
                self.io_seconds += time.perf_counter() - start
                self.note(f"{what} done", name)

        return self._io.submit(run)

    # -- writes ------------------------------------------------------------------------------
    def write(self, name: str, tensors: Sequence[torch.Tensor]) -> None:
        """Write the tensors' bytes, back to back, as file ``name`` (CPU tensors; others are copied down).

        Waits until the file is complete, except inside :meth:`behind`.
        """
        data = [t.detach().to("cpu").contiguous() for t in tensors]
        behind = self._behind > 0
        # a write-behind is fsynced by flush(), after all of them: the disk sees one stream, not a wait per file
        future = self._submit("write", name, lambda: self._write(name, data, sync=not behind))
        if behind:
            self._writes.append((name, future))
        else:
            future.result()

    @contextmanager
    def behind(self) -> Iterator[None]:
        """Writes issued inside return at once (write-behind); :meth:`flush` waits for them and raises the first failure."""
        self._behind += 1
        try:
            yield
        finally:
            self._behind -= 1

    def flush(self) -> None:
        """Wait for every write-behind; raise the first one's failure, if any."""
        writes, self._writes = self._writes, []
        failure: BaseException | None = None
        for _, future in writes:
            error = future.exception()
            if error is not None and failure is None:
                failure = error
        for name in dict.fromkeys(name for name, future in writes if future.exception() is None):
            try:
                fd = os.open(self._path(name), os.O_RDONLY)
            except FileNotFoundError:  # deleted since (read back into memory): nothing to make durable
                continue
            try:
                os.fsync(fd)
            except OSError as e:
                failure = failure or DiskTierError(f"disk tier: writing {name} to {self.directory} failed: {e.strerror or e}")
            finally:
                os.close(fd)
        if failure is not None:
            raise DiskTierError(
                f"{failure} (a write-behind: the optimizer step had already moved on, so the values that write held are "
                "lost; restore from the last checkpoint)"
            ) from failure

    def _write(self, name: str, data: list[torch.Tensor], *, sync: bool = True) -> None:
        path = self._path(name)
        tmp = path + ".tmp"
        total = 0
        try:
            with open(tmp, "wb", buffering=0) as f:
                for tensor in data:
                    if tensor.numel():
                        view = _bytes_view(tensor)
                        written = 0
                        while written < len(view):
                            written += f.write(view[written:])
                        total += written
                if sync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.remove(tmp)
            except OSError:
                pass
            what = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
            raise DiskTierError(
                f"disk tier: writing {name} ({sum(t.numel() * t.element_size() for t in data)} bytes) to "
                f"{self.directory} failed: {what}. The data is still in memory and the previous file is intact; "
                "free space there, point TierConfig(disk_dir=...) elsewhere, or give the host tier more memory."
            ) from e
        self.bytes_written += total

    # -- reads -------------------------------------------------------------------------------
    def read(self, name: str, out: Sequence[torch.Tensor]) -> None:
        """Fill ``out`` (contiguous CPU tensors, in the order written) from file ``name``; waits for it."""
        self._submit("read", name, lambda: self._read(name, out)).result()

    def read_ahead(self, name: str, out: Sequence[torch.Tensor]) -> Pending:
        """Issue the read of ``name`` into ``out`` and return at once; :meth:`Pending.wait` returns the filled tensors."""
        tensors = list(out)
        return Pending(name, tensors, self._submit("read", name, lambda: self._read(name, tensors)))

    def _read(self, name: str, out: Sequence[torch.Tensor]) -> None:
        path = self._path(name)
        try:
            with open(path, "rb", buffering=0) as f:
                for tensor in out:
                    if not tensor.numel():
                        continue
                    view = _bytes_view(tensor)
                    got = 0
                    while got < len(view):
                        n = f.readinto(view[got:])
                        if not n:
                            raise DiskTierError(f"disk tier: {path} is shorter than expected (truncated by another process?)")
                        got += n
                    self.bytes_read += got
        except OSError as e:
            raise DiskTierError(f"disk tier: reading {path} failed: {e.strerror or e}") from e

    def delete(self, name: str) -> None:
        """Remove file ``name`` once the jobs issued before have run (returns at once)."""
        self._io.submit(_remove, self._path(name))

    def close(self) -> None:
        self._cleanup()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _shut(io: ThreadPoolExecutor, directory: str) -> None:
    io.shutdown(wait=True)
    shutil.rmtree(directory, True)
