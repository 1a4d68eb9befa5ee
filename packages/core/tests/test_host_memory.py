"""``shard()`` lets freed host buffers go back to the system. See [Note: host memory that is freed is returned].

glibc raises its mmap threshold to the size of every mapped block that is freed, so after a 16 MiB buffer
is freed an 8 MiB one comes from the heap, which keeps it when it is freed. After ``shard()`` the threshold
is fixed at 4 MiB: the 8 MiB buffer is mapped on its own (glibc's ``hblkhd`` grows by it) and unmapped when
freed. ``release_host_memory=False`` leaves malloc as it is. Each case runs in a fresh interpreter, since the
setting is process-wide and cannot be undone.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest
import torch

from zero_core import ConfigError, ZeroConfig

SCRIPT = r"""
import ctypes, json, sys
import torch
from torch import nn
from zero_core import ZeroConfig, shard

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
model = nn.Linear(4, 4)
model, opt = shard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   config=ZeroConfig(release_host_memory=sys.argv[1] == "on"))
big = torch.ones(4 << 20)  # 16 MiB, mapped; freeing it raises a dynamic threshold to 16 MiB
del big
before = libc.mallinfo2().hblkhd
mid = torch.ones(2 << 20)  # 8 MiB
mapped = libc.mallinfo2().hblkhd - before
del mid
print(json.dumps({"mapped": mapped, "after_free": libc.mallinfo2().hblkhd - before}))
"""


def _glibc() -> bool:
    try:
        ctypes.CDLL("libc.so.6").gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return False
    return True


def _run(setting: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, setting], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _glibc(), reason="the setting is glibc's; other C libraries are left alone")
def test_a_chunk_sized_buffer_is_mapped_on_its_own_and_returned():
    on, off = _run("on"), _run("off")
    assert on["mapped"] >= 8 << 20 and on["after_free"] == 0  # mapped, and unmapped when freed
    assert off["mapped"] == 0  # from the heap: glibc raised its threshold past 8 MiB and keeps the block


def test_the_flag_is_validated():
    with pytest.raises(ConfigError, match="release_host_memory must be True or False"):
        ZeroConfig(release_host_memory="yes")
    assert ZeroConfig().release_host_memory is True


def test_huge_pages_are_asked_for_on_the_whole_2_mib_pages_of_a_fresh_buffer(monkeypatch):
    """See [Note: huge pages for the engine's host buffers]: the advice covers the buffer's whole 2 MiB pages only,
    and is not given below 4 MiB. A fake madvise records the calls, so this runs whatever the kernel's setting."""
    from zero_core.base import _host_memory
    from zero_core.chunks import _buffers

    calls = []
    monkeypatch.setattr(_host_memory, "_madvise", lambda: lambda start, length, advice: calls.append((start, length, advice)))
    monkeypatch.setattr(_host_memory, "_mapped_alone", False)  # release_host_memory=False: malloc's pages left alone
    assert _host_memory.advise_huge_pages(torch.empty((7 << 20) // 4)) is not None and calls == []
    monkeypatch.setattr(_host_memory, "_mapped_alone", True)  # what shard() sets when it fixes the threshold
    small = torch.empty((4 << 20) // 4 - 1)  # just under 4 MiB
    assert _host_memory.advise_huge_pages(small) is small and calls == []
    big = torch.empty((7 << 20) // 4)  # 7 MiB: at least two whole 2 MiB pages inside, wherever it starts
    _host_memory.advise_huge_pages(big)
    ((start, length, advice),) = calls
    huge = 2 << 20
    assert advice == 14 and start % huge == 0 and length % huge == 0 and length >= 2 * huge
    assert big.data_ptr() <= start and start + length <= big.data_ptr() + (7 << 20)
    # the pool advises a buffer it allocates (before zeroing it), not one it hands out again
    advised = []
    monkeypatch.setattr(_buffers, "advise_huge_pages", lambda buf: advised.append(buf.numel()) or buf)
    pool = _buffers.BufferPool()
    buf = pool.take(3 << 20, torch.float32, torch.device("cpu"))
    assert advised == [3 << 20] and not buf.any()
    pool.give(buf)
    pool.take(3 << 20, torch.float32, torch.device("cpu"))
    assert advised == [3 << 20]


def test_no_advice_where_the_kernel_takes_none(monkeypatch, tmp_path):
    from zero_core.base import _host_memory

    for mode, expected in (("always [madvise] never", True), ("[always] madvise never", False),
                           ("always madvise [never]", False)):
        path = tmp_path / "enabled"
        path.write_text(mode + "\n")
        monkeypatch.setattr(_host_memory, "_THP_MODE", str(path))
        _host_memory._madvise.cache_clear()
        assert (_host_memory._madvise() is not None) is (expected and sys.platform.startswith("linux") and _glibc())
    _host_memory._madvise.cache_clear()
