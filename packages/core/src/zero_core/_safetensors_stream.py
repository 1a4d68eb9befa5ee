"""Write a safetensors file one tensor at a time, so a writer never holds more than the tensor it writes.

The safetensors library writes from a complete dict only. The format is simple enough to
stream: an 8-byte little-endian header size, a JSON header naming each tensor's dtype,
shape and byte range, padded with spaces to a multiple of 8, then the raw bytes in
order. Every shape and dtype is known before the first value is, so the header goes
first and each tensor follows as it becomes available. Files are read back with the
safetensors library itself.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["SafetensorsWriter"]

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
                raise TypeError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store")
            if name in header:
                raise ValueError(f"tensor {name!r} appears twice")
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
            raise ValueError(f"expected tensor {expected!r} of {nbytes} bytes next, got {name!r} of "
                             f"{data.numel() * data.element_size()} bytes")
        if nbytes:
            self._stream.write(memoryview(data.view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._expected):
            raise ValueError(f"{len(self._expected) - self._next} tensor(s) were never written, from "
                             f"{self._expected[self._next][0]!r}")
