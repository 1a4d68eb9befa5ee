"""Where full (unsharded) parameter values are read from: a mapping, a torch file, a safetensors file or index.

Each source reads a flat element range of one tensor, so a rank reads only the part of
each parameter that falls into its shard: a torch file is memory-mapped (only the pages
read are loaded), a safetensors file is sliced by rows.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from zero_core.base.errors import CheckpointError

__all__ = ["StateDictSource", "open_source"]

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class StateDictSource:
    """A read-only view of a state dict: names, shapes, dtypes and flat element ranges."""

    def __init__(self, tensors: Mapping[str, Any], description: str) -> None:
        self._tensors = tensors
        self.description = description

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._tensors[name].dtype

    def read(self, name: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of tensor ``name`` flattened (all of them by default)."""
        flat = self._tensors[name].reshape(-1)
        return flat[lo : flat.numel() if hi is None else hi]

    def read_block(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Entries ``[start, start + length)`` of dimension ``dim`` of tensor ``name``, all of the others (a rank's
        piece of a parameter cut along ``dim``: see [Note: shard dimension] in ``zero_core.chunks._slots``)."""
        return self._tensors[name].narrow(dim, start, length)

    def close(self) -> None:
        self._tensors = {}


class _SafetensorsSource(StateDictSource):
    def __init__(self, files: dict[str, Path], description: str) -> None:
        try:
            from safetensors import safe_open
        except ImportError as exc:  # pragma: no cover - safetensors is a dependency of the checkpoint extra
            raise CheckpointError(
                f"{description} is a safetensors file but the safetensors package is not installed; "
                "pip install safetensors (a dependency of zero-core)"
            ) from exc
        self.description = description
        self._handles: dict[Path, Any] = {}
        self._file_of: dict[str, Path] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name, path in files.items():
            handle = self._handles.get(path)
            if handle is None:
                try:
                    handle = self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
                except Exception as exc:  # noqa: BLE001 - the library raises its own error types
                    raise CheckpointError(f"cannot read {path} as a safetensors file ({exc}); is it complete?") from exc
            self._file_of[name] = path
        for name, path in self._file_of.items():
            piece = self._handles[path].get_slice(name)
            self._meta[name] = (tuple(piece.get_shape()), _SAFETENSORS_DTYPES[piece.get_dtype()])

    def keys(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name][1]

    def read(self, name: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        shape = self._meta[name][0]
        handle = self._handles[self._file_of[name]]
        numel = math.prod(shape)
        hi = numel if hi is None else hi
        if not shape or (lo == 0 and hi == numel):
            return handle.get_tensor(name).reshape(-1)[lo:hi]
        row = math.prod(shape[1:])  # read whole rows, then trim: at most two partial rows more than asked
        first, last = lo // row, -(-hi // row)
        rows = handle.get_slice(name)[first:last].reshape(-1)
        return rows[lo - first * row : hi - first * row]

    def read_block(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        # sliced in the file: only this block's bytes are read, not the whole rows of dim 0 it crosses
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._handles[self._file_of[name]].get_slice(name)[index]

    def close(self) -> None:
        self._handles = {}


def _is_safetensors(path: Path) -> bool:
    return path.suffix == ".safetensors"


def open_source(source: Any) -> StateDictSource:
    """A :class:`StateDictSource` over ``source``: a mapping of tensors, or a path to a torch file
    (``.pt``, ``.pth``, ``.bin``), a ``.safetensors`` file, a ``*.index.json`` of sharded files, or a
    directory holding one of those."""
    if isinstance(source, Mapping):
        bad = [k for k, v in source.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise CheckpointError(f"the state dict holds non-tensor values under {bad[:5]}; pass name -> tensor only")
        return StateDictSource(source, "the state dict passed in")
    if not isinstance(source, (str, os.PathLike)):
        raise CheckpointError(
            f"load from a mapping of tensors or a path to a .pt/.bin/.safetensors file, got {type(source).__name__}"
        )
    path = Path(source)
    if path.is_dir():
        if (path / "zero_checkpoint.json").is_file():
            raise CheckpointError(
                f"{path} is a sharded checkpoint written by zero_core.save_checkpoint, not a state dict; load it "
                "with zero_core.load_checkpoint(model, optimizer, path)"
            )
        indexes = sorted(path.glob("*.index.json"))
        safetensors = sorted(path.glob("*.safetensors"))
        torch_files = sorted(p for ext in ("*.pt", "*.pth", "*.bin") for p in path.glob(ext))
        if indexes:
            path = indexes[0]
        elif safetensors:  # several files without an index: every tensor of every file
            return _SafetensorsSource({name: file for file in safetensors for name in _safetensors_names(file)},
                                      str(path))
        elif torch_files:
            merged: dict[str, torch.Tensor] = {}
            for file in torch_files:
                merged.update(_torch_load(file))
            return StateDictSource(merged, str(path))
        else:
            raise CheckpointError(
                f"{path} is a directory without a state dict file (*.safetensors, *.index.json, *.pt, *.pth, *.bin); "
                "for a sharded checkpoint saved by zero_core.save_checkpoint use zero_core.load_checkpoint"
            )
    if not path.is_file():
        raise CheckpointError(f"no state dict file at {path}")
    if path.name.endswith(".index.json"):
        try:
            weight_map = json.loads(path.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"cannot read {path} as a sharded state dict index ({exc})") from exc
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{path} has no 'weight_map'; it is not a sharded state dict index")
        files = {name: path.parent / file for name, file in weight_map.items()}
        if all(_is_safetensors(f) for f in files.values()):
            return _SafetensorsSource(files, str(path))
        merged = {}
        for file in sorted(set(files.values())):
            merged.update(_torch_load(file))
        return StateDictSource(merged, str(path))
    if _is_safetensors(path):
        return _SafetensorsSource({name: path for name in _safetensors_names(path)}, str(path))
    return StateDictSource(_torch_load(path), str(path))


def _safetensors_names(path: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            return list(handle.keys())
    except Exception as exc:  # noqa: BLE001 - the library raises its own error types
        raise CheckpointError(f"cannot read {path} as a safetensors file ({exc}); is it complete?") from exc


def _torch_load(path: Path) -> Mapping[str, torch.Tensor]:
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise CheckpointError(f"cannot read {path} as a torch state dict file ({type(exc).__name__}: {exc})") from exc
    if isinstance(loaded, Mapping) and "state_dict" in loaded and isinstance(loaded["state_dict"], Mapping):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, Mapping):
        raise CheckpointError(f"{path} holds a {type(loaded).__name__}, not a state dict (a mapping of name -> tensor)")
    return loaded
