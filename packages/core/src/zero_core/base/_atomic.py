"""Atomic file writes: a temporary name, fsync, rename, fsync of the directory; with a checksum on the way."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["HashingWriter", "atomic_write", "file_sha256", "fsync_dir", "TMP_MARK"]

TMP_MARK = ".tmp-"
_BLOCK = 1 << 24


class HashingWriter:
    """A write-only binary stream that passes bytes to ``file`` and hashes them (sha256) as they go."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._hash = hashlib.sha256()
        self.nbytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self._file.write(view)
        self.nbytes += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._file.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a crash after it keeps the new name)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[HashingWriter], object]) -> tuple[int, str]:
    """Write ``path`` through ``write(stream)`` so that it appears complete or not at all.

    The bytes go to a temporary name beside ``path``, are fsynced and renamed over it; a
    crash or an exception at any point leaves whatever ``path`` held before. Returns the
    size in bytes and the sha256 of what was written.
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            stream = HashingWriter(f)
            write(stream)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return stream.nbytes, stream.hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in blocks (bounded memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()
