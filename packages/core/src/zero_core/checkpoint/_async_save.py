"""Asynchronous sharded checkpoints: stage this rank's shards into host memory, write and commit in the background.

[Note: asynchronous checkpoints]
``save_checkpoint(..., async_=True)`` blocks only while it copies this rank's file's values
(master shards, optimizer states, buffers, random states) into a host *staging buffer* and reads
what the metadata says of the engine (step, loss scaler). It returns an :class:`AsyncSave`; a
background thread then does what a synchronous save does after that, in the same order, with
the same bytes: this rank's file written to a temporary name, fsynced and renamed; the
descriptions gathered; rank 0 writes the metadata last and removes the previous save's files.

- **Its own process group.** The background thread's collectives run on a gloo group made for
  checkpoints at the first asynchronous save (every rank of the model's group makes it there,
  in the same order), so they never interleave with the training's collectives on the
  model's group. Every wait has the configured collective timeout.
- **One save in flight per model.** The next ``save_checkpoint``, ``load_checkpoint`` and
  ``model.close()`` first wait for the previous save. A failure in the background (a full disk,
  a rank that died) is raised there as :class:`~zero_core.CheckpointError`, or by
  :meth:`AsyncSave.wait`. A checkpoint whose files did not all complete never gets its
  metadata, so the directory still loads the previous one (see [Note: sharded checkpoint
  format]).
- **Staging memory is bounded and reused.** One buffer per model, as large as the largest
  file's values so far (pinned when the model is on CUDA): the bytes this rank's file holds,
  each entry aligned to 64 bytes.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from zero_core.base._atomic import atomic_write
from zero_core.base._trace import CHECKPOINT_SAVE, traced
from zero_core.base.errors import CheckpointError
from zero_core.checkpoint._checkpoint import RankFilePlan, begin_save, commit_save, engine_metadata, plan_rank_file
from zero_core.comm._agreement import raise_if_any_failed

if TYPE_CHECKING:
    from zero_core.comm.backend import CommBackend
    from zero_core.runtime._engine import Engine

__all__ = ["AsyncSave", "finish_pending_save", "save_async"]

_ALIGN = 64
_PENDING: weakref.WeakKeyDictionary[Engine, AsyncSave] = weakref.WeakKeyDictionary()
_STAGING: weakref.WeakKeyDictionary[Engine, torch.Tensor] = weakref.WeakKeyDictionary()
_COMMS: weakref.WeakKeyDictionary[Engine, CommBackend] = weakref.WeakKeyDictionary()


class AsyncSave:
    """A checkpoint being written in the background; see [Note: asynchronous checkpoints].

    Attributes:
        directory: Where it is written.
        blocked_s: Seconds ``save_checkpoint`` blocked for (staging included).
        staged_bytes: Bytes this rank staged.
    """

    def __init__(self, directory: os.PathLike[str], blocked_s: float, staged_bytes: int) -> None:
        self.directory = directory
        self.blocked_s = blocked_s
        self.staged_bytes = staged_bytes
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._reported = False

    def done(self) -> bool:
        """Whether the background work has finished (successfully or not)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the checkpoint is complete on every rank; raise :class:`~zero_core.CheckpointError` if it
        failed (then the directory still holds the previous checkpoint)."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None and not self._reported:
            self._reported = True
            if isinstance(self._error, CheckpointError):
                raise self._error
            raise CheckpointError(f"the asynchronous save to {self.directory} failed in the background "
                                  f"({type(self._error).__name__}: {self._error}); the previous checkpoint there is "
                                  "intact") from self._error

    def _start(self, work: Any) -> None:
        def run() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - kept for wait(), which raises it in the caller's thread
                self._error = exc

        self._thread = threading.Thread(target=run, name="zero-checkpoint-writer", daemon=False)
        self._thread.start()


def finish_pending_save(engine: Engine) -> None:
    """Wait for the model's asynchronous save in flight, if any; raise its failure."""
    pending = _PENDING.pop(engine, None)
    if pending is not None:
        pending.wait()


def _checkpoint_comm(engine: Engine) -> CommBackend:
    """A backend of the model's kind over a gloo group of the model's ranks, for the background thread."""
    comm = _COMMS.get(engine)
    if comm is None:
        import torch.distributed as dist

        timeout = timedelta(seconds=engine.config.collective_timeout_s)
        ranks = dist.get_process_group_ranks(engine.comm.group or dist.group.WORLD)
        group = dist.new_group(ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)
        comm = type(engine.comm).from_config(group, timeout=timeout, config=engine.config)
        if comm.rank != engine.comm.rank:
            raise CheckpointError(f"the checkpoint group numbers this rank {comm.rank}, the model's group "
                                  f"{engine.comm.rank}; asynchronous saves need the same order")
        _COMMS[engine] = comm
    return comm


def _stage(engine: Engine, plan: RankFilePlan) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """Copy the plan's values into the model's staging buffer (grown if needed, else reused)."""
    sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in plan.entries]
    total = sum(-(-n // _ALIGN) * _ALIGN for n in sizes)
    buffer = _STAGING.get(engine)
    if buffer is None or buffer.numel() < total:
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=engine.device.type == "cuda")
        _STAGING[engine] = buffer
    staged, at = [], 0
    with torch.no_grad():
        for (key, value), size in zip(plan.tensors(), sizes, strict=True):
            view = buffer[at: at + size].view(value.dtype).view(value.shape)
            view.copy_(value, non_blocking=value.device.type == "cuda")
            staged.append((key, view))
            at += -(-size // _ALIGN) * _ALIGN
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)  # the copies down are done before the thread reads them
    return staged, total


@traced(CHECKPOINT_SAVE)
def save_async(engine: Engine, directory: str | os.PathLike[str], *, extra: Any, with_optimizer: bool) -> AsyncSave:
    """The blocking part of an asynchronous save (the preamble, staging), then the background thread. Collective.
    See [Note: asynchronous checkpoints]."""
    started = time.perf_counter()
    finish_pending_save(engine)
    directory, save_id = begin_save(engine, directory)
    comm = engine.comm
    rank, world = comm.rank, comm.world_size
    side = _checkpoint_comm(engine) if world > 1 else comm
    plan = plan_rank_file(engine, save_id, rank, world, with_optimizer)
    base = engine_metadata(engine)
    error = None
    try:
        staged, total = _stage(engine, plan)
        extra_bytes = None
        if rank == 0 and extra is not None:
            collected = _Collector()
            torch.save(extra, collected)  # type: ignore[arg-type]  # save() needs write/flush only; serialized now: the object may change while the file is written
            extra_bytes = collected.data()
    except Exception as exc:  # noqa: BLE001 - every rank must learn it before any thread starts
        error = f"{type(exc).__name__}: {exc}"
    raise_if_any_failed(comm, error, f"saving a checkpoint to {directory} failed while staging; the previous "
                                     "checkpoint there is intact")
    handle = AsyncSave(directory, time.perf_counter() - started, total)

    def commit() -> None:
        description: dict[str, Any] | None = None
        failure = None
        try:
            size, digest = atomic_write(directory / plan.name, lambda stream: plan.write(stream, staged))
            description = {**plan.description, "file": {"name": plan.name, "bytes": size, "sha256": digest}}
            if extra_bytes is not None:
                name = f"{save_id}.extra.pt"
                size, digest = atomic_write(directory / name, lambda stream: stream.write(extra_bytes))
                description["extra"] = {"name": name, "bytes": size, "sha256": digest}
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            failure = f"{type(exc).__name__}: {exc}"
        commit_save(side, directory, save_id, base, description, failure)

    handle._start(commit)
    _PENDING[engine] = handle
    return handle


class _Collector:
    """A write-only stream into memory, as the checkpoint's file writer is (torch.save writes the same bytes)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._parts.append(bytes(view))
        return view.nbytes

    def flush(self) -> None:
        pass

    def data(self) -> bytes:
        return b"".join(self._parts)
