"""How a wrapped model's state dict keys map onto chunk slots and buffers, and loading values into them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zero_core.chunk import Chunk
from zero_core.comm import CommBackend
from zero_core.errors import CheckpointError

__all__ = ["ModelLayout", "check_names", "fill_from_source", "publish_kept"]

_SHOWN = 8


@dataclass
class ModelLayout:
    """The plain model's state dict keys, and where each one's values live once sharded.

    Attributes:
        keys: Every key of ``module.state_dict()`` in its order (tied parameters under each of their names).
        params: Parameter keys -> ``(chunk, slot)``.
        names: ``id(param)`` -> its keys, in state dict order (more than one when tied).
        buffers: Persistent buffer keys -> the buffer tensor itself (written in place when loading).
        shapes: Every key -> its shape.
    """

    keys: list[str]
    params: dict[str, tuple[Chunk, int]]
    names: dict[int, list[str]]
    buffers: dict[str, torch.Tensor]
    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, module: nn.Module, chunks: Sequence[Chunk]) -> ModelLayout:
        where = {id(slot.param): (chunk, i) for chunk in chunks for i, slot in enumerate(chunk.slots)}
        params: dict[str, tuple[Chunk, int]] = {}
        names: dict[int, list[str]] = {}
        buffers: dict[str, torch.Tensor] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        keys = []
        for key, value in module.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor):
                continue  # extra state objects are the model's own business
            keys.append(key)
            if id(value) in where:
                chunk, i = where[id(value)]
                params[key] = (chunk, i)
                names.setdefault(id(value), []).append(key)
                shapes[key] = tuple(chunk.slots[i].shape)
            else:
                buffers[key] = value
                shapes[key] = tuple(value.shape)
        return cls(keys, params, names, buffers, shapes)

    def source_name(self, key: str, available: Mapping[str, object] | set[str]) -> str | None:
        """The name under which ``key``'s values are found: itself, or a tied twin's name."""
        if key in available:
            return key
        if key in self.params:
            chunk, i = self.params[key]
            for other in self.names[id(chunk.slots[i].param)]:
                if other in available:
                    return other
        return None


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def check_names(layout: ModelLayout, shapes: Mapping[str, tuple[int, ...]], *, strict: bool, what: str) -> None:
    """Raise :class:`CheckpointError` naming every missing key, unexpected key and shape mismatch.

    A tied parameter is present when any of its names is. ``strict=False`` allows missing
    and unexpected keys (those parameters keep their values), never a shape mismatch.
    """
    missing = [k for k in layout.keys if layout.source_name(k, shapes) is None]
    unexpected = [k for k in shapes if k not in layout.shapes]
    mismatched = []
    for key in layout.keys:
        name = layout.source_name(key, shapes)
        if name is not None and tuple(shapes[name]) != layout.shapes[key]:
            mismatched.append(f"{key!r}: {tuple(shapes[name])} saved, {layout.shapes[key]} in the model")
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
            ". Nothing was loaded. Check that it was saved from the same model (or pass strict=False to skip "
            "missing and unexpected keys)."
        )


@torch.no_grad()
def fill_from_source(layout: ModelLayout, source: object, chunks: Sequence[Chunk], *, comm: CommBackend,
                     before: object = None, after: object = None) -> None:
    """Write every parameter found in ``source`` into this rank's shards, one chunk at a time, and the buffers.

    Each rank reads only the elements of each parameter its shard holds; kept full buffers
    are then all-gathered from the shards (collective). ``before(chunks)`` and ``after(chunks)``
    bracket each chunk's writes (a placement policy's ``before_load`` and ``after_load``).
    """
    available = set(source.keys())  # type: ignore[attr-defined]
    for chunk in chunks:
        if before is not None:
            before([chunk])  # type: ignore[operator]
        for i, slot in enumerate(chunk.slots):
            name = next((layout.source_name(k, available) for k in layout.names.get(id(slot.param), [slot.name])
                         if layout.source_name(k, available) is not None), None)
            if name is None:
                continue
            lo, hi = chunk.own_range(i)
            if lo < hi:
                values = source.read(name, lo, hi)  # type: ignore[attr-defined]
                chunk.fill(i, values.to(chunk.master_dtype), lo=lo)
        publish_kept(chunk, comm)
        if after is not None:
            after([chunk])  # type: ignore[operator]
    for key, buf in layout.buffers.items():
        name = layout.source_name(key, available)
        if name is not None:
            buf.copy_(source.read(name).view(buf.shape))  # type: ignore[attr-defined]


def publish_kept(chunk: Chunk, comm: CommBackend) -> None:
    """A kept full buffer takes the values just written into the shards (every rank's slice). Collective."""
    if chunk.persistent:
        pending = chunk.publish_parameters(comm)
        if pending is not None:
            pending.wait()
