"""The optimizer step of chunks whose states are on disk, with the disk's reads and writes behind the step.

[Note: the disk tier's pipeline]
Chunks whose optimizer states live on the disk tier step one at a time, in host memory.
Done one after another, each chunk would wait for its files to be read, step, then wait
for them to be written: the disk and the CPU would take turns. Instead, for chunks
``c[0], c[1], ...``:

1. ``c[n]``'s files (its optimizer states, and its master shard when that lives on disk
   too) were read ahead while ``c[n-1]`` stepped; the training thread waits for those
   reads only (they are usually done) and puts the values in place;
2. the reads of ``c[n+1]``'s files are issued, then ``c[n]`` steps;
3. ``c[n]``'s states and shard are written back *behind* (:meth:`DiskStore.behind`):
   the training thread goes on to ``c[n+1]`` while the I/O thread writes.

The I/O thread runs its jobs in issue order (see [Note: the disk tier's I/O thread]), so
``c[n]``'s writes run while ``c[n+1]`` steps, before ``c[n+2]``'s reads, and by the
time the training thread has waited for ``c[n+1]``'s reads, ``c[n-1]``'s writes are done:
at most one chunk's write-behind holds memory at any time. The host tier's accounting
is exact for what is placed: a read-ahead charges the host tier for its buffers when it
is issued, and is made only if the host tier has room for them beside the write-behind in
flight (else ``c[n+1]`` is read when it steps, as before). The step ends when every
write is in its file (:meth:`DiskStore.flush`), so the files are current when the
optimizer step returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from zero_core.plugin import Chunk, MemoryTier, rewrap
from zero_offload._disk import DiskStore, Pending
from zero_offload._tiers import DISK, HOST, Part, Tiers

__all__ = ["step_from_disk"]


@dataclass
class _Ahead:
    """The reads issued for one chunk before its turn, and the host bytes they are charged."""

    chunk: Chunk
    charged: int = 0
    params: Pending | None = None
    optim: Pending | None = None
    states: list[tuple[dict, str, torch.Tensor]] = field(default_factory=list)  # (state dict, key, stand-in)


def _file_bytes(tiers: Tiers, chunk: Chunk) -> int:
    """Host bytes reading ``chunk``'s files for its step takes (and writing them back holds until written)."""
    nbytes = tiers.nbytes(chunk, Part.OPTIM)
    if tiers.tier(chunk, Part.PARAMS) is DISK and chunk.index not in tiers.staged:
        nbytes += chunk.shard_bytes
    return nbytes


def _read_ahead(tiers: Tiers, chunk: Chunk, in_flight: int) -> _Ahead | None:
    """Issue the reads of ``chunk``'s files if the host tier has room for them beside ``in_flight`` bytes of writes."""
    disk = tiers.disk
    assert disk is not None
    nbytes = _file_bytes(tiers, chunk)
    if not tiers.fits(HOST, nbytes + in_flight):
        return None
    ahead = _Ahead(chunk)
    tiers._charge(HOST, nbytes, what=f"chunk {chunk.index}'s files read ahead")
    ahead.charged = nbytes
    if tiers.tier(chunk, Part.PARAMS) is DISK and chunk.index not in tiers.staged:
        ahead.params = disk.read_ahead(f"params-{chunk.index}", [tiers._host_buffer(chunk)])
    states = [(state, key, value) for _, state, key, value in tiers.states(chunk)]
    if states:  # a chunk that never stepped has no states yet: nothing on disk
        ahead.states = states
        ahead.optim = disk.read_ahead(f"optim-{chunk.index}", [torch.empty(v.shape, dtype=v.dtype) for *_, v in states])
    return ahead


def _land(tiers: Tiers, ahead: _Ahead) -> None:
    """Wait for a read-ahead and put its values where the step reads them: the shard staged in host memory, the
    states in the optimizer, on the host tier (the same end state as ``stage_in`` and ``move(OPTIM, HOST)``)."""
    disk = tiers.disk
    assert disk is not None
    chunk, i = ahead.chunk, ahead.chunk.index
    tiers._discharge(HOST, ahead.charged)  # from here on the tiers' own accounting holds these bytes
    if ahead.params is not None:
        (host,) = ahead.params.wait()
        tiers._charge(HOST, chunk.shard_bytes, check=False)
        chunk.replace_shard(host)
        tiers.staged.add(i)
    if ahead.optim is not None:
        values = ahead.optim.wait()
        for (state, key, _), value in zip(ahead.states, values):
            state[key] = rewrap(state[key], value)
        nbytes = tiers.nbytes(chunk, Part.OPTIM)
        tiers.relabel(chunk, Part.OPTIM, HOST)
        tiers.moves[Part.OPTIM] += 1
        tiers.bytes_moved[Part.OPTIM] += nbytes
        disk.delete(f"optim-{i}")  # out of date from now on, as after any move from disk


def step_from_disk(tiers: Tiers, chunks: Sequence[Chunk], *, shard_to_host: Callable[[Chunk], None],
                   step: Callable[[list[Chunk]], None], stepped: Callable[[Chunk], None],
                   home: Mapping[int, MemoryTier]) -> None:
    """Step ``chunks`` (optimizer states on disk) one at a time with their files read ahead and written behind.

    The caller passes in how it brings a chunk's shard to the host for its step (``shard_to_host``), the
    optimizer step of some chunks (``step``), what follows a chunk's step (``stepped``: a shard whose home is
    the disk goes back there), and each moved shard's home tier (``home``). See [Note: the disk tier's pipeline].
    """
    disk: DiskStore | None = tiers.disk
    assert disk is not None
    ahead: _Ahead | None = None
    in_flight = 0  # host bytes the last chunk's write-behind holds
    try:
        with disk.behind():
            for n, chunk in enumerate(chunks):
                if ahead is not None:
                    current, ahead = ahead, None
                    _land(tiers, current)
                shard_to_host(chunk)
                tiers.move(chunk, Part.OPTIM, HOST)  # nothing to do when it was read ahead
                if n + 1 < len(chunks):
                    ahead = _read_ahead(tiers, chunks[n + 1], in_flight)
                disk.note("step start", f"chunk-{chunk.index}")
                step([chunk])
                disk.note("step done", f"chunk-{chunk.index}")
                shard_home = home.get(chunk.index)
                stepped(chunk)  # a shard whose home is the disk is written back (behind) here
                tiers.move(chunk, Part.OPTIM, DISK)
                in_flight = tiers.nbytes(chunk, Part.OPTIM) + (chunk.shard_bytes if shard_home is DISK else 0)
    finally:
        if ahead is not None:  # a step raised: what was read ahead is put in place, the state stays consistent
            _land(tiers, ahead)
        disk.flush()
