"""Full (consolidated) state dicts: the plain model's keys and shapes, fp32 masters, one chunk gathered at a time."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zero_core.base._atomic import atomic_write
from zero_core.base._trace import STATE_DICT_GATHER, STATE_DICT_LOAD, STATE_DICT_SAVE, traced
from zero_core.base.errors import CheckpointError
from zero_core.checkpoint._hf_folder import cast_dtype, write_directory
from zero_core.checkpoint._safetensors_stream import SafetensorsWriter
from zero_core.checkpoint._sources import open_source
from zero_core.checkpoint._state_keys import ModelKeys, check_names, fill_from_source
from zero_core.comm._agreement import raise_if_any_failed
from zero_core.interfaces._inspection import iter_full_chunks

if TYPE_CHECKING:
    from zero_core.chunks.chunk import Chunk
    from zero_core.runtime._engine import Engine

__all__ = ["full_state_dict", "load_full_state_dict", "write_full_state", "write_hf_folder"]


def _full_chunks(engine: Engine) -> Iterator[tuple[Chunk, torch.Tensor]]:
    """Each chunk with its whole master values, one at a time (collective), once the engine is idle."""
    engine.settle("reading the full parameters", collective=True)
    yield from iter_full_chunks(engine.chunks, placement=engine.placement, comm=engine.comm)


def _keys_of(engine: Engine) -> ModelKeys:
    return ModelKeys.of(engine.module, engine.chunks)


def _param_values(engine: Engine, model_keys: ModelKeys, keep: bool):
    """``(key, CPU tensor)`` for every parameter key, chunk by chunk (tied parameters under each name)."""
    for chunk, full in _full_chunks(engine):
        for slot in chunk.slots:
            value = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
            value = value.to("cpu", copy=True) if keep else value
            for key in model_keys.names.get(id(slot.param), []):
                yield key, value
            del value
        del full  # before the next chunk is gathered: one at a time


@traced(STATE_DICT_GATHER)
def full_state_dict(engine: Engine, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The plain model's state dict, whole, on the CPU. Collective: call on every rank.

    Keys and shapes are those of the unwrapped model's ``state_dict()`` (tied parameters
    under each of their names, the same tensor), parameters in master precision. Device
    memory holds one gathered chunk at a time; with ``rank0_only`` only rank 0 keeps the
    values (the others return ``{}``), so only rank 0's host memory holds the model.
    """
    model_keys = _keys_of(engine)
    keep = not rank0_only or engine.comm.rank == 0
    if not keep:
        for _ in _param_values(engine, model_keys, keep=False):  # join every gather, hold nothing
            pass
        return {}
    values = dict(_param_values(engine, model_keys, keep=True))
    for key, buf in model_keys.buffers.items():
        values[key] = buf.detach().to("cpu", copy=True)
    return {key: values[key] for key in model_keys.keys}


def _format(path: Path, format: str | None) -> str:
    if format is None:
        format = "safetensors" if path.suffix == ".safetensors" else "torch"
    if format not in ("safetensors", "torch"):
        raise CheckpointError(f"format must be 'safetensors' or 'torch', got {format!r}")
    return format


@traced(STATE_DICT_SAVE)
def write_full_state(engine: Engine, path: str | os.PathLike[str], *, format: str | None = None,
                     dtype: torch.dtype | None = None) -> None:
    """Write the full state dict to one file from rank 0. Collective: call on every rank.

    ``format="safetensors"`` (the default for a ``.safetensors`` path) streams: rank 0
    writes each chunk's parameters as they are gathered and holds no more than one chunk.
    ``format="torch"`` writes ``torch.save`` of :func:`full_state_dict`, which rank 0 holds
    whole. The file appears complete or not at all; a failure on rank 0 raises on every rank.
    ``dtype`` casts floating tensors as they are written.
    """
    path = Path(path)
    fmt = _format(path, format)
    model_keys = _keys_of(engine)
    rank0 = engine.comm.rank == 0
    error = None
    try:
        if fmt == "torch":
            state = full_state_dict(engine, rank0_only=True)
            if rank0:
                state = {k: v.to(cast_dtype(v.dtype, dtype)) for k, v in state.items()}
                atomic_write(path, lambda stream: torch.save(state, stream))  # type: ignore[arg-type]  # save() needs write/flush only
        else:
            _stream_safetensors(engine, model_keys, path, rank0, dtype)
    except Exception as exc:  # noqa: BLE001 - any failure on rank 0 must reach the other ranks
        error = f"{type(exc).__name__}: {exc}"
    raise_if_any_failed(engine.comm, error, f"saving the full state dict to {path} failed; no file was written "
                                             "(an older file at that path is intact)")


def _stream_safetensors(engine: Engine, model_keys: ModelKeys, path: Path, rank0: bool,
                        dtype: torch.dtype | None) -> None:
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for chunk in engine.chunks:
        for slot in chunk.slots:
            entries += [(key, cast_dtype(chunk.master_dtype, dtype), tuple(slot.shape))
                        for key in model_keys.names.get(id(slot.param), [])]
    entries += [(key, cast_dtype(buf.dtype, dtype), tuple(buf.shape)) for key, buf in model_keys.buffers.items()]
    values = _param_values(engine, model_keys, keep=False)
    if not rank0:
        for _ in values:  # join every gather
            pass
        return

    def write(stream: Any) -> None:
        writer = SafetensorsWriter(stream, entries, {"format": "pt", "producer": "zero"})
        for key, value in values:
            writer.write(key, value.to(cast_dtype(value.dtype, dtype)))  # one tensor's cast copy at a time
            del value  # a view of the gathered chunk: it must not outlive it into the next gather
        for key, buf in model_keys.buffers.items():
            writer.write(key, buf.to(cast_dtype(buf.dtype, dtype)))
        writer.close()

    try:
        atomic_write(path, write)
    finally:
        for _ in values:  # an error midway: the other ranks still wait for the remaining gathers
            pass


@traced(STATE_DICT_SAVE)
def write_hf_folder(engine: Engine, directory: str | os.PathLike[str], *, max_shard_size: int,
                    dtype: torch.dtype | None = None, configs: Callable[[], dict[str, Any]] | None = None) -> None:
    """Write the Hugging Face format (see [Note: Hugging Face folder format]) from rank 0. Collective.

    Chunks are gathered one at a time, as for a streamed ``.safetensors`` file; rank 0 writes each
    parameter (once per tied group, under its first name) into the open shard file, cast to
    ``dtype`` one tensor at a time. A failure on rank 0 raises on every rank; the directory then
    holds what it held before.
    """
    directory = Path(directory)
    model_keys = _keys_of(engine)
    rank0 = engine.comm.rank == 0
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    first: dict[int, str] = {}  # id(param) -> the one name it is stored under
    for chunk in engine.chunks:
        for slot in chunk.slots:
            names = model_keys.names.get(id(slot.param), [])
            if names:
                first[id(slot.param)] = names[0]
                entries.append((names[0], cast_dtype(chunk.master_dtype, dtype), tuple(slot.shape)))
    entries += [(key, cast_dtype(buf.dtype, dtype), tuple(buf.shape)) for key, buf in model_keys.buffers.items()]

    def values():
        for chunk, full in _full_chunks(engine):
            for slot in chunk.slots:
                if id(slot.param) in first:
                    yield first[id(slot.param)], full[slot.offset : slot.offset + slot.numel].view(slot.shape)
            del full  # before the next chunk is gathered: one at a time
        yield from model_keys.buffers.items()

    stream = values()
    error = None
    try:
        if rank0:
            write_directory(directory, entries, stream, max_shard_size=max_shard_size,
                            configs=configs() if configs is not None else None)
    except Exception as exc:  # noqa: BLE001 - any failure on rank 0 must reach the other ranks
        error = f"{type(exc).__name__}: {exc}"
    finally:
        for _ in stream:  # the other ranks (or rank 0 after an error) join every remaining gather
            pass
    raise_if_any_failed(engine.comm, error, f"saving the full state dict to {directory} failed; the directory holds "
                                            "what it held before (files of an earlier save there are intact)")


@traced(STATE_DICT_LOAD)
def load_full_state_dict(engine: Engine, source: Any, *, strict: bool = True) -> None:
    """Load a plain state dict (mapping or file) into the shards: each rank reads only its part.

    Collective. Every rank checks the keys and shapes first; on any mismatch every rank
    raises and nothing is changed.
    """
    engine.settle("load_full_state_dict", collective=True)
    model_keys = _keys_of(engine)
    error = None
    opened = None
    try:
        opened = open_source(source)
        check_names(model_keys, {k: opened.shape(k) for k in opened.keys()}, strict=strict, what=opened.description)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or the others wait for this one
        error = f"cannot read {source!r} ({type(exc).__name__}: {exc})"
    raise_if_any_failed(engine.comm, error, "load_full_state_dict failed; nothing was changed")
    assert opened is not None
    with torch.no_grad():
        fill_from_source(model_keys, opened, engine.chunks, comm=engine.comm, before=engine.placement.before_load,
                         after=engine.placement.after_load)
    opened.close()
