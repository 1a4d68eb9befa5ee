"""The public checkpoint verbs: sharded checkpoints and full state dict files of a sharded model."""

from __future__ import annotations

import os
from typing import Any

import torch

from zero_core._checkpoint import load_checkpoint as _load
from zero_core._checkpoint import save_checkpoint as _save
from zero_core._full_state import save_full_state_dict as _save_full
from zero_core._module import ZeroModule
from zero_core.errors import CheckpointError

__all__ = ["load_checkpoint", "save_checkpoint", "save_full_state_dict"]


def _engine(model: Any, optimizer: Any, verb: str) -> Any:
    if not isinstance(model, ZeroModule):
        raise CheckpointError(f"{verb} takes the model returned by zero_core.shard, got {type(model).__name__}")
    engine = model.engine
    if optimizer is not None and optimizer is not engine.optimizer:
        raise CheckpointError(f"{verb} got an optimizer that is not the one zero_core.shard returned with this model")
    return engine


def save_checkpoint(model: ZeroModule, optimizer: torch.optim.Optimizer | None, directory: str | os.PathLike[str],
                    *, extra: Any = None) -> None:
    """Save a sharded checkpoint into ``directory``. Collective: call on every rank.

    Each rank writes its own shards of the master parameters and optimizer states, with
    no gather; rank 0 adds the buffers and, last, the metadata that makes the checkpoint
    complete. The loss scaler, the engine's step count and each rank's random state are
    saved too, and ``extra`` (any picklable object: scheduler state, data position), by
    rank 0. Saving again into the same directory replaces the checkpoint atomically: until
    the new one is complete, the previous one stays loadable. ``optimizer=None`` saves the
    parameters only.
    """
    engine = _engine(model, optimizer, "save_checkpoint")
    _save(engine, directory, extra=extra, with_optimizer=optimizer is not None)


def load_checkpoint(model: ZeroModule, optimizer: torch.optim.Optimizer | None, directory: str | os.PathLike[str],
                    *, strict: bool = True, load_rng: bool = True) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint`, at any world size, strategy or chunk size. Collective.

    Every rank validates first (metadata, keys and shapes, each file's size and checksum);
    any problem on any rank raises :class:`~zero_core.CheckpointError` on every rank with
    nothing changed. ``optimizer=None`` loads the parameters only. ``load_rng`` restores
    each rank's random state (when the rank existed in the saved run). Returns the saved
    ``extra`` object, or ``None``.
    """
    engine = _engine(model, optimizer, "load_checkpoint")
    return _load(engine, directory, load_optimizer=optimizer is not None, strict=strict, load_rng=load_rng)


def save_full_state_dict(model: ZeroModule, path: str | os.PathLike[str], *, format: str | None = None) -> None:
    """Write the plain model's state dict to one file from rank 0. Collective: call on every rank.

    Keys, shapes and tied parameters are those of the unwrapped model, values in master
    precision. A ``.safetensors`` path (or ``format="safetensors"``) is streamed chunk by
    chunk, so no rank holds more than one gathered chunk; any other path is written with
    ``torch.save`` (rank 0 holds the whole state dict for it). The write is atomic.
    """
    engine = _engine(model, None, "save_full_state_dict")
    _save_full(engine, path, format=format)
