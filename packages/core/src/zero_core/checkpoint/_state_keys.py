"""How a wrapped model's state dict keys map onto chunk slots and buffers, and loading values into them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zero_core.base.errors import CheckpointError
from zero_core.chunks._collectives import refresh_chunk, refresh_group_shard
from zero_core.chunks.chunk import Chunk
from zero_core.comm._agreement import agree_ok
from zero_core.comm.backend import CommBackend

__all__ = ["ModelKeys", "check_names", "fill_from_source", "refresh_kept"]

_SHOWN = 8


@dataclass
class ModelKeys:
    """The plain model's state dict keys, and where each one's values live once sharded.

    Attributes:
        keys: Every key of ``module.state_dict()`` in its order (tied parameters under each of their names).
        names: ``id(param)`` -> its keys, in state dict order (more than one when tied).
        twins: Every parameter key -> all keys of the same parameter (itself included).
        slots: ``id(param)`` -> ``(chunk, slot)``, once sharded.
        buffers: Persistent buffer keys -> the buffer tensor itself (written in place when loading).
        shapes: Every key -> its shape.
    """

    keys: list[str]
    names: dict[int, list[str]]
    twins: dict[str, list[str]]
    slots: dict[int, tuple[Chunk, int]]
    buffers: dict[str, torch.Tensor]
    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, module: nn.Module, chunks: Sequence[Chunk] = ()) -> ModelKeys:
        """The state dict keys of ``module``, sharded into ``chunks`` (or not yet: then shapes are the parameters' own)."""
        slots = {id(slot.param): (chunk, i) for chunk in chunks for i, slot in enumerate(chunk.slots)}
        # between steps the modules hold the sharded parameters: each stands for its unsharded one here
        unsharded = {id(seg.param): chunk.slots[seg.slot].param for chunk in chunks for seg in chunk.segments}
        params = {id(unsharded.get(id(p), p)): p for p in module.parameters()}
        names: dict[int, list[str]] = {}
        buffers: dict[str, torch.Tensor] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        keys = []
        for key, value in module.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor):
                continue  # extra state objects are the model's own business
            keys.append(key)
            value = unsharded.get(id(value), value)
            if id(value) in params:
                names.setdefault(id(value), []).append(key)
                slot = slots.get(id(value))
                shapes[key] = tuple(slot[0].slots[slot[1]].shape) if slot else tuple(value.shape)
            else:
                buffers[key] = value
                shapes[key] = tuple(value.shape)
        twins = {key: group for group in names.values() for key in group}
        return cls(keys, names, twins, slots, buffers, shapes)

    def source_name(self, key: str, available: Mapping[str, object] | set[str],
                    aliases: Mapping[str, str] | None = None) -> str | None:
        """The name under which ``key``'s values are found: itself or a tied twin, or a name that
        ``aliases`` (the source's own ties: twin -> stored name) maps one of them to."""
        for name in self.twins.get(key, [key]):
            if name in available:
                return name
        for name in self.twins.get(key, [key]):
            if aliases and aliases.get(name) in available:
                return aliases[name]
        return None

    def param_source(self, param: torch.Tensor, available: Mapping[str, object] | set[str],
                     aliases: Mapping[str, str] | None = None) -> str | None:
        """The stored name a parameter's values are read from, or ``None`` when the source lacks it."""
        names = self.names.get(id(param))
        return self.source_name(names[0], available, aliases) if names else None


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def check_names(model_keys: ModelKeys, shapes: Mapping[str, tuple[int, ...]], *, strict: bool, what: str,
                aliases: Mapping[str, str] | None = None, lenient: str = "pass strict=False") -> None:
    """Raise :class:`CheckpointError` naming every missing key, unexpected key and shape mismatch.

    A tied parameter is present when any of its names is. ``strict=False`` allows missing
    and unexpected keys (those parameters keep their values), never a shape mismatch.
    ``lenient`` says how the caller relaxes strictness, for the message.
    """
    missing = [k for k in model_keys.keys if model_keys.source_name(k, shapes, aliases) is None]
    unexpected = [k for k in shapes if k not in model_keys.shapes]
    mismatched = []
    for key in model_keys.keys:
        name = model_keys.source_name(key, shapes, aliases)
        if name is not None and tuple(shapes[name]) != model_keys.shapes[key]:
            mismatched.append(f"{key!r}: {tuple(shapes[name])} saved, {model_keys.shapes[key]} in the model")
    problems = []
    if mismatched:
        problems.append(f"shape mismatch for {len(mismatched)} key(s): " + "; ".join(mismatched[:_SHOWN]))
    if strict and missing:
        problems.append(f"missing {len(missing)} key(s) the model has: {_listed(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected {len(unexpected)} key(s) the model does not have: {_listed(unexpected)}")
    if problems:
        raise CheckpointError(
            f"{what} does not match this model: " + "; ".join(problems) +
            f". Nothing was loaded. Check that it was saved from the same model (or {lenient} to skip "
            "missing and unexpected keys)."
        )


@torch.no_grad()
def fill_from_source(model_keys: ModelKeys, source: object, chunks: Sequence[Chunk], *, comm: CommBackend,
                     before: object = None, after: object = None) -> None:
    """Write every parameter found in ``source`` into this rank's shards, one chunk at a time, and the buffers.

    Each rank reads only the elements of each parameter its shard holds; kept full buffers
    are then all-gathered from the shards (collective). ``before(chunks)`` and ``after(chunks)``
    bracket each chunk's writes (a placement policy's ``before_load`` and ``after_load``). A
    read that fails on any rank makes every rank raise, before the next collective.
    """
    available = set(source.keys())  # type: ignore[attr-defined]
    for chunk in chunks:
        if before is not None:
            before([chunk])  # type: ignore[operator]
        try:
            error = None
            try:
                for i, slot in enumerate(chunk.slots):
                    name = model_keys.param_source(slot.param, available)
                    if name is None or not chunk.runs(i):
                        continue
                    if slot.strided:  # a block of the parameter (see [Note: shard dimension] in zero_core.chunks._slots)
                        held = chunk.held(i)
                        block = source.read_block(name, *slot.block(chunk.rank))  # type: ignore[attr-defined]
                        held.copy_(slot.from_block(block, chunk.rank).reshape(-1).to(chunk.master_dtype))
                        continue
                    (lo, hi, _), = chunk.runs(i)
                    chunk.fill(i, source.read(name, lo, hi).to(chunk.master_dtype), lo=lo)  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it before the next collective
                error = f"reading {source.description} failed ({type(exc).__name__}: {exc})"  # type: ignore[attr-defined]
            agree_ok(comm, error, "loading stopped partway; the model is partly loaded, so load again")
            refresh_kept(chunk, comm)
        finally:
            if after is not None:
                after([chunk])  # type: ignore[operator]
    for key, buf in model_keys.buffers.items():
        name = model_keys.source_name(key, available)
        if name is not None:
            buf.copy_(source.read(name).view(buf.shape))  # type: ignore[attr-defined]


def refresh_kept(chunk: Chunk, comm: CommBackend) -> None:
    """A kept full buffer (or a group shard) takes the values just written into the shards (every rank's slice).
    Collective."""
    refresh_group_shard(chunk)
    if chunk.persistent:
        pending = refresh_chunk(chunk, comm)
        if pending is not None:
            pending.wait()
