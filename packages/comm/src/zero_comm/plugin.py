"""zero-comm's plugin: registers the ``torch`` and ``bucketed`` comm backends through the ``zero`` entry points."""

from __future__ import annotations

from zero_comm._bucketed_backend import BucketedCommBackend
from zero_comm._torch_backend import TorchCommBackend
from zero_core.plugin import CommBackend, Registry, hookimpl


@hookimpl
def zero_register_comm_backends(registry: Registry[type[CommBackend]]) -> None:
    registry.add(TorchCommBackend.name, TorchCommBackend)
    registry.add(BucketedCommBackend.name, BucketedCommBackend)
