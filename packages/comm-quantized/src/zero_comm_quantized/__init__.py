"""zero-comm-quantized: comm backends for zero that send parameters and gradients as int8 blocks with fp32 scales
or int4 blocks with bf16 scales."""

from __future__ import annotations

from typing import Any

from zero_comm_quantized._backend import (
    Quantization,
    QuantizedCommBackend,
    QuantizedGradsCommBackend,
    QuantizedInt4CommBackend,
    QuantizedInt4GradsCommBackend,
    QuantizedInt4ParamsCommBackend,
    QuantizedParamsCommBackend,
)
from zero_comm_quantized._version import __version__
from zero_core.plugin import CommBackend, Registry, hookimpl

__all__ = [
    "Quantization",
    "QuantizedCommBackend",
    "QuantizedGradsCommBackend",
    "QuantizedInt4CommBackend",
    "QuantizedInt4GradsCommBackend",
    "QuantizedInt4ParamsCommBackend",
    "QuantizedParamsCommBackend",
    "__version__",
    "plugin_for",
]


class _Registers:
    """A plugin object that registers backend classes (variants) under their names."""

    def __init__(self, backends: tuple[type[CommBackend], ...]) -> None:
        self.backends = backends

    @hookimpl
    def zero_register_comm_backends(self, registry: Registry[type[CommBackend]]) -> None:
        for backend in self.backends:
            registry.add(backend.name, backend)


def plugin_for(*backends: type[CommBackend]) -> Any:
    """A plugin registering ``backends`` (made with :meth:`QuantizedCommBackend.variant`), for
    ``zero_core.shard(..., plugins=[plugin_for(...)])``."""
    return _Registers(backends)
