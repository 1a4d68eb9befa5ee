"""The disk tier's bandwidth against plain sequential reads and writes of the same bytes on the same disk (issue 48,
item 4). Works on the CPU as well as on a GPU machine.

The disk tier (``zero_offload``'s ``DiskStore``) writes one file per chunk part, each fsynced and renamed into
place, on its I/O thread; the optimizer step issues a chunk's writes behind and the next chunk's reads ahead
([Note: the disk tier's pipeline]). Here it writes ``files`` files of ``file_bytes`` the way the step does (all
issued behind, then one flush), then reads them all back the way read-ahead does (all issued, then waited for).
The plain figure writes the same bytes to one file, ``file_bytes`` per ``write`` call, with one fsync at the end,
and reads them back sequentially. Before every read the files' pages are dropped from the page cache
(``posix_fadvise(DONTNEED)`` after an fsync), so reads come from the disk, not from memory.

    python -m zero_bench.gpu.disk --dir /var/tmp --total-mib 1024 --file-mib 64
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any

import torch


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_bandwidth(directory: str, *, total_bytes: int = 1 << 30, file_bytes: int = 64 << 20) -> dict[str, Any]:
    """GB/s of the disk tier and of plain sequential I/O, writing then reading ``total_bytes`` under ``directory``."""
    from zero_offload._disk import DiskStore

    files = max(1, total_bytes // file_bytes)
    numel = file_bytes // 4
    total = files * numel * 4
    tensors = [torch.full((numel,), float(i)) for i in range(files)]
    work = tempfile.mkdtemp(prefix="zero-disk-bw-", dir=directory)
    try:
        # the disk tier: every write issued behind, then one flush (as the optimizer step does)
        store = DiskStore(work, rank=0)
        t0 = time.perf_counter()
        with store.behind():
            for i, tensor in enumerate(tensors):
                store.write(f"optim-{i}", [tensor])
        store.flush()
        tier_write = time.perf_counter() - t0
        for i in range(files):
            _drop_cache(os.path.join(store.directory, f"optim-{i}"))
        out = [torch.empty(numel) for _ in range(files)]
        t0 = time.perf_counter()
        pending = [store.read_ahead(f"optim-{i}", [out[i]]) for i in range(files)]
        for p in pending:
            p.wait()
        tier_read = time.perf_counter() - t0
        intact = all(torch.equal(a, b) for a, b in zip(tensors, out))
        store.close()
        # plain: the same bytes, one file, sequential
        path = os.path.join(work, "plain")
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for tensor in tensors:
                f.write(tensor.view(torch.uint8).numpy().data)
            os.fsync(f.fileno())
        plain_write = time.perf_counter() - t0
        _drop_cache(path)
        back = torch.empty(files * numel)
        view = back.view(torch.uint8).numpy().data
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
        plain_read = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def rate(seconds: float) -> float:
        return round(total / seconds / 1e9, 3)

    return {"directory": directory, "bytes": total, "files": files, "file_bytes": numel * 4, "intact": intact,
            "tier_write_GBps": rate(tier_write), "tier_read_GBps": rate(tier_read),
            "plain_write_GBps": rate(plain_write), "plain_read_GBps": rate(plain_read),
            "write_share": round(plain_write / tier_write, 3), "read_share": round(plain_read / tier_read, 3)}


def render(result: dict[str, Any]) -> list[str]:
    return ["\n## Disk tier bandwidth\n",
            f"{result['bytes'] / 2**20:.0f} MiB as {result['files']} files of {result['file_bytes'] / 2**20:.0f} MiB under "
            f"`{result['directory']}`: the disk tier (`DiskStore`, writes issued behind then flushed, reads issued "
            "ahead then waited for, each file fsynced and renamed into place) against one plain file written "
            "sequentially with one fsync and read back; page cache dropped before each read "
            "(`zero_bench.gpu.disk`). Share: plain time over the tier's (1.0: as fast as plain).", "",
            "| | write GB/s | read GB/s |", "|---|---|---|",
            f"| disk tier | {result['tier_write_GBps']} | {result['tier_read_GBps']} |",
            f"| plain sequential | {result['plain_write_GBps']} | {result['plain_read_GBps']} |",
            f"| share | {result['write_share']} | {result['read_share']} |",
            "" if result["intact"] else "\n**The disk tier read back different bytes than it wrote.**"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zero_bench.gpu.disk", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir())
    p.add_argument("--total-mib", type=int, default=1024)
    p.add_argument("--file-mib", type=int, default=64)
    args = p.parse_args(argv)
    result = disk_bandwidth(args.dir, total_bytes=args.total_mib << 20, file_bytes=args.file_mib << 20)
    print("\n".join(render(result)))
    return 0 if result["intact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
