"""zero-comm's plugin: registers the ``torch`` comm backend through the ``zero`` entry points."""

from __future__ import annotations

from zero_comm._torch_backend import TorchCommBackend
from zero_core import CommBackend, Registry, hookimpl


@hookimpl
def zero_register_comm_backends(registry: Registry[type[CommBackend]]) -> None:
    registry.add(TorchCommBackend.name, TorchCommBackend)
