"""Write a safetensors file one tensor at a time, and read element ranges of it with plain file reads.

The safetensors library writes from a complete dict only. The format is simple enough to
stream: an 8-byte little-endian header size, a JSON header naming each tensor's dtype,
shape and byte range, padded with spaces to a multiple of 8, then the raw bytes in
order. Every shape and dtype is known before the first value is, so the header goes
first and each tensor follows as it becomes available. Any safetensors reader reads the
files; :class:`SafetensorsRangeReader` reads element ranges straight into their
destination with ``readinto`` (no memory map, whose pages would count as this process's
memory, and no intermediate copy).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from typing import Any

import torch

from zero_core.base.errors import CheckpointError

__all__ = ["SafetensorsRangeReader", "SafetensorsWriter"]

_DTYPES_BY_NAME: dict[str, torch.dtype] = {}
_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


class SafetensorsWriter:
    """Writes ``entries`` (``(name, dtype, shape)`` in file order) to ``stream``; call :meth:`write` for each, in order."""

    def __init__(self, stream: Any, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
        self._expected: list[tuple[str, int]] = []
        offset = 0
        for name, dtype, shape in entries:
            if dtype not in _DTYPE_NAMES:
                raise CheckpointError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store")
            if name in header:
                raise CheckpointError(f"tensor {name!r} appears twice")
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._expected.append((name, nbytes))
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self._stream = stream
        self._next = 0
        stream.write(struct.pack("<Q", len(encoded)))
        stream.write(encoded)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected, nbytes = self._expected[self._next]
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if name != expected or data.numel() * data.element_size() != nbytes:
            raise CheckpointError(f"expected tensor {expected!r} of {nbytes} bytes next, got {name!r} of "
                             f"{data.numel() * data.element_size()} bytes")
        if nbytes:
            self._stream.write(data.view(torch.uint8).numpy().data)
        self._next += 1

    def write_parts(self, name: str, parts: Any) -> None:
        """The next tensor's values as consecutive flat pieces (an iterable of tensors), so that no more than
        one piece need be in memory at a time."""
        expected, nbytes = self._expected[self._next]
        if name != expected:
            raise CheckpointError(f"expected tensor {expected!r} next, got {name!r}")
        written = 0
        for part in parts:
            data = part.detach().to("cpu").contiguous().reshape(-1)
            size = data.numel() * data.element_size()
            if written + size > nbytes:
                raise CheckpointError(f"tensor {name!r} got more than its {nbytes} bytes")
            if size:
                self._stream.write(data.view(torch.uint8).numpy().data)
            written += size
            del data, part
        if written != nbytes:
            raise CheckpointError(f"tensor {name!r} got {written} of its {nbytes} bytes")
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._expected):
            raise CheckpointError(f"{len(self._expected) - self._next} tensor(s) were never written, from "
                             f"{self._expected[self._next][0]!r}")


_DTYPES_BY_NAME.update({name: dtype for dtype, name in _DTYPE_NAMES.items()})


class SafetensorsRangeReader:
    """Reads element ranges of the tensors of one safetensors file; validates the header on opening."""

    def __init__(self, path: Any) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close()
        size = self._file.seek(0, 2)
        self._file.seek(0)
        head = self._file.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path} is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise CheckpointError(f"{path} has a header of {length} bytes but only {size - 8} bytes follow")
        header = json.loads(self._file.read(length))
        header.pop("__metadata__", None)
        self._start = 8 + length
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            begin, end = info["data_offsets"]
            dtype = _DTYPES_BY_NAME[info["dtype"]]
            if end > size - self._start or end - begin != math.prod(info["shape"]) * dtype.itemsize:
                raise CheckpointError(f"{path}: tensor {name!r} does not fit the file")
            self.entries[name] = (dtype, tuple(info["shape"]), begin, end)

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + out.numel())`` of ``name``, flattened, into ``out`` (contiguous, CPU)."""
        dtype, _, begin, _ = self.entries[name]
        direct = out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
        target = out if direct else torch.empty(out.numel(), dtype=dtype)
        self._file.seek(self._start + begin + start * dtype.itemsize)
        view = target.view(torch.uint8).numpy().data if target.numel() else memoryview(b"")
        if view.nbytes and self._file.readinto(view) != view.nbytes:
            raise CheckpointError(f"tensor {name!r} ends early")
        if target is not out:
            out.copy_(target)

    def tensor(self, name: str) -> torch.Tensor:
        dtype, shape, _, _ = self.entries[name]
        out = torch.empty(shape, dtype=dtype)
        self.read_into(name, 0, out.view(-1) if out.dim() else out.view(1))
        return out

    def close(self) -> None:
        self._file.close()
