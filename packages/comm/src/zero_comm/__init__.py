"""zero-comm: comm backends for zero (collectives with per-step counters and timeouts)."""

from zero_comm._bucketed_backend import BucketedCommBackend
from zero_comm._bucketer import Bucket, BucketCallbackError, BucketError, BucketState, ReduceScatterBucketer, Ticket
from zero_comm._torch_backend import TorchCommBackend
from zero_comm._version import __version__

__all__ = [
    "Bucket",
    "BucketCallbackError",
    "BucketError",
    "BucketState",
    "BucketedCommBackend",
    "ReduceScatterBucketer",
    "Ticket",
    "TorchCommBackend",
    "__version__",
]
