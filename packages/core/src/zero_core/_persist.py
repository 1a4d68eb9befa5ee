"""The public checkpoint verbs: sharded checkpoints and full state dict files of a sharded model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from zero_core._module import ZeroModule
from zero_core.base.errors import CheckpointError, ConfigError
from zero_core.checkpoint._async_save import AsyncSave, finish_pending_save, save_async
from zero_core.checkpoint._checkpoint import read_sharded, write_sharded
from zero_core.checkpoint._dcp import is_dcp_checkpoint, read_dcp
from zero_core.checkpoint._full_state import write_full_state, write_hf_folder
from zero_core.checkpoint._hf_folder import (
    DEFAULT_MAX_SHARD_SIZE,
    FILE_SUFFIXES,
    model_config_texts,
    parse_dtype,
    parse_shard_size,
    with_dtype,
)

# one optimizer, or the tuple or list of them that zero_core.shard was given
Optimizers = torch.optim.Optimizer | tuple[torch.optim.Optimizer, ...] | list[torch.optim.Optimizer]

__all__ = ["load_checkpoint", "save_checkpoint", "save_full_state_dict"]


def _engine(model: Any, optimizer: Any, verb: str) -> Any:
    if not isinstance(model, ZeroModule):
        raise CheckpointError(f"{verb} takes the model returned by zero_core.shard, got {type(model).__name__}")
    engine = model.engine
    if optimizer is None:
        return engine
    given = tuple(optimizer) if isinstance(optimizer, (tuple, list)) else (optimizer,)
    if len(given) != len(engine.optimizers) or any(a is not b for a, b in zip(given, engine.optimizers)):
        if len(engine.optimizers) > 1:
            raise CheckpointError(
                f"{verb} got {_described(given)}, but this model was sharded with {len(engine.optimizers)} optimizers "
                f"({_described(engine.optimizers)}); pass all of them, in the tuple zero_core.shard returned, or None "
                "for the parameters only")
        raise CheckpointError(f"{verb} got an optimizer that is not the one zero_core.shard returned with this model")
    return engine


def _described(optimizers: Any) -> str:
    return ", ".join(type(o).__name__ for o in optimizers)


def save_checkpoint(model: ZeroModule, optimizer: Optimizers | None, directory: str | os.PathLike[str],
                    *, extra: Any = None, async_: bool = False) -> AsyncSave | None:
    """Save a sharded checkpoint into ``directory``. Collective: call on every rank.

    Each rank writes its own shards of the master parameters and optimizer states, with
    no gather; rank 0 adds the buffers and, last, the metadata that makes the checkpoint
    complete. The loss scaler, the engine's step count and each rank's random state are
    saved too, and ``extra`` (any picklable object: scheduler state, data position), by
    rank 0. Saving again into the same directory replaces the checkpoint atomically: until
    the new one is complete, the previous one stays loadable. ``optimizer=None`` saves the
    parameters only. A model sharded with several optimizers takes them all, as ``shard()``
    returned them (``save_checkpoint(model, (muon, adamw), path)``); a checkpoint of one
    optimizer is written as it always was.

    With ``async_=True`` it blocks only while this rank's values are copied into a reused host
    staging buffer, and returns an :class:`~zero_core.AsyncSave`: the files, their checksums and
    the commit are written in the background, byte for byte as a synchronous save writes them.
    The next save, :func:`load_checkpoint` and ``model.close()`` wait for it, and a failure in
    the background is raised there (or by ``handle.wait()``) as a
    :class:`~zero_core.CheckpointError`; an incomplete save never looks complete. See
    [Note: asynchronous checkpoints].
    """
    if not isinstance(async_, bool):
        raise ConfigError(f"save_checkpoint(async_=...) must be True or False, got {async_!r}")
    engine = _engine(model, optimizer, "save_checkpoint")
    if async_:
        return save_async(engine, directory, extra=extra, with_optimizer=optimizer is not None)
    finish_pending_save(engine)  # a save still being written completes (or fails) first
    write_sharded(engine, directory, extra=extra, with_optimizer=optimizer is not None)
    return None


def load_checkpoint(model: ZeroModule, optimizer: Optimizers | None, directory: str | os.PathLike[str],
                    *, strict: bool = True, load_rng: bool = True) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint`, at any world size, strategy or chunk size. Collective.

    Every rank validates first (metadata, keys and shapes, each file's size and checksum);
    any problem on any rank raises :class:`~zero_core.CheckpointError` on every rank with
    nothing changed. ``optimizer=None`` loads the parameters only; several optimizers are passed
    as ``shard()`` returned them, the same ones in the same order as at the save. ``load_rng`` restores
    each rank's random state (when the rank existed in the saved run). Returns the saved
    ``extra`` object, or ``None``.

    A directory written by ``torch.distributed.checkpoint`` (``.metadata`` and ``*.distcp`` files: FSDP2's
    ``get_state_dict`` + ``dcp.save``, torchtitan) loads too, model and optimizer, at any world size; it
    holds no checksums, random states or step, so those stay as they are and it returns ``None``. See
    [Note: DCP both ways].
    """
    engine = _engine(model, optimizer, "load_checkpoint")
    finish_pending_save(engine)  # a save of this model still being written completes (or fails) first
    if is_dcp_checkpoint(directory):
        read_dcp(model, engine, None if optimizer is None else engine.optimizers, directory, strict=strict)
        return None
    return read_sharded(engine, directory, load_optimizer=optimizer is not None, strict=strict, load_rng=load_rng)


def save_full_state_dict(model: ZeroModule, path: str | os.PathLike[str], *, format: str | None = None,
                         max_shard_size: int | str | None = None, dtype: torch.dtype | str | None = None) -> None:
    """Write the plain model's weights from rank 0: one file, or a Hugging Face directory. Collective: call on
    every rank.

    A ``path`` ending in ``.safetensors``, ``.pt``, ``.pth`` or ``.bin`` is one file: a
    ``.safetensors`` path (or ``format="safetensors"``) is streamed chunk by chunk, so no rank
    holds more than one gathered chunk; any other file is written with ``torch.save`` (rank 0
    holds the whole state dict for it). Keys, shapes and tied parameters (under each name) are
    those of the unwrapped model.

    Any other ``path``, or an existing directory, gets the Hugging Face format that
    ``from_pretrained`` and ``shard(..., load_from=path)`` read: ``model.safetensors``, or
    ``model-0000i-of-0000N.safetensors`` files of at most ``max_shard_size`` (bytes, or a size
    like ``"5GB"``; default ``"5GB"`` as transformers) and ``model.safetensors.index.json``; a
    tied parameter stored once, under its first name; and ``config.json`` (plus
    ``generation_config.json``) when the model has an HF-style ``config``. Streamed too: no rank
    holds more than one gathered chunk and rank 0 one tensor's cast copy. Other files in the
    directory are left alone.

    ``dtype`` (``torch.bfloat16``, ``torch.float16``, ``torch.float32`` or ``"bf16"``...) casts the
    floating tensors as they are written (the config records it); by default they keep the master
    precision. Every write is atomic: a reader sees the previous weights or the new ones complete.
    """
    engine = _engine(model, None, "save_full_state_dict")
    cast = parse_dtype(dtype)
    target = Path(path)
    if target.is_dir() or target.suffix not in FILE_SUFFIXES:
        if format is not None:
            raise CheckpointError(f"format={format!r} is for one file, but {target} is a directory target (no .safetensors"
                                  "/.pt/.pth/.bin suffix); leave format out for the Hugging Face format, or name a file")
        limit = parse_shard_size(DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
        masters = {chunk.master_dtype for chunk in engine.chunks}
        stored = cast if cast is not None else (masters.pop() if len(masters) == 1 else None)
        # called by rank 0 only (the writer), inside its error agreement: a failing config fails every rank
        write_hf_folder(engine, target, max_shard_size=limit, dtype=cast,
                        configs=lambda: with_dtype(model_config_texts(model), stored))
        return
    if max_shard_size is not None:
        raise CheckpointError(f"max_shard_size splits a directory into files, but {target} is one file; give a "
                              "directory (a path without a file suffix) to get shards and an index")
    write_full_state(engine, path, format=format, dtype=cast)
