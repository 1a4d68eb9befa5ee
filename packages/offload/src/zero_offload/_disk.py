"""The disk tier: one file per chunk part, written and read in one block each, replaced atomically."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence

import torch

from zero_offload.errors import DiskTierError

__all__ = ["DiskStore"]


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    return tensor.view(torch.uint8).numpy().data


class DiskStore:
    """Files under a private directory of ``root``, removed when the store is collected or the process exits.

    A write goes to ``name.tmp`` and is renamed over ``name`` only once complete, so a failed
    write (a full disk) leaves the previous file, and the caller's tensors, as they were.
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
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True)
        self.bytes_written = 0
        self.bytes_read = 0

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def write(self, name: str, tensors: Sequence[torch.Tensor]) -> None:
        """Write the tensors' bytes, back to back, as file ``name`` (CPU tensors; others are copied down)."""
        path = self._path(name)
        tmp = path + ".tmp"
        total = 0
        try:
            with open(tmp, "wb", buffering=0) as f:
                for tensor in tensors:
                    data = tensor.detach().to("cpu").contiguous()
                    if data.numel():
                        view = _bytes_view(data)
                        written = 0
                        while written < len(view):
                            written += f.write(view[written:])
                        total += written
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.remove(tmp)
            except OSError:
                pass
            what = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
            raise DiskTierError(
                f"disk tier: writing {name} ({sum(t.numel() * t.element_size() for t in tensors)} bytes) to "
                f"{self.directory} failed: {what}. The data is still in memory and the previous file is intact; "
                "free space there, point TierConfig(disk_dir=...) elsewhere, or give the host tier more memory."
            ) from e
        self.bytes_written += total

    def read(self, name: str, out: Sequence[torch.Tensor]) -> None:
        """Fill ``out`` (contiguous CPU tensors, in the order written) from file ``name``."""
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
        try:
            os.remove(self._path(name))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._cleanup()
