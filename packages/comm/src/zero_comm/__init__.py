"""zero-comm: comm backends for zero (collectives with per-step counters and timeouts)."""

from zero_comm._torch_backend import TorchCommBackend
from zero_comm._version import __version__

__all__ = ["TorchCommBackend", "__version__"]
