"""zero-comm-quantized's plugin: registers ``quantized``, ``quantized-params``, ``quantized-grads`` and their int4
forms ``quantized-int4``, ``quantized-int4-params``, ``quantized-int4-grads`` through the
``zero`` entry points."""

from __future__ import annotations

from zero_comm_quantized._backend import BUILT_IN
from zero_core.plugin import CommBackend, Registry, hookimpl


@hookimpl
def zero_register_comm_backends(registry: Registry[type[CommBackend]]) -> None:
    for backend in BUILT_IN:
        registry.add(backend.name, backend)
