"""zero-offload: placement policies that move chunk shards, gradients and optimizer states
between device, host and disk tiers: ``static`` (fixed fractions) and ``gemini`` (driven by
a memory trace of a warm-up step). Select one with ``ZeroConfig(placement="gemini",
placement_options=GeminiConfig(...))``; subclass :class:`TieredPolicy` to write your own.
"""

from zero_offload._activations import ActivationOffload, offload_activations
from zero_offload._base import TieredPolicy
from zero_offload._disk import DiskStore
from zero_offload._gemini import GeminiPolicy
from zero_offload._static import StaticPolicy
from zero_offload._tiers import Part, Tiers
from zero_offload._tracer import MemoryTracer
from zero_offload._version import __version__
from zero_offload.config import GeminiConfig, StaticConfig, TierConfig
from zero_offload.errors import DeviceBudgetError, DiskTierError, TierBudgetError

__all__ = [
    "ActivationOffload",
    "DeviceBudgetError",
    "DiskStore",
    "DiskTierError",
    "GeminiConfig",
    "GeminiPolicy",
    "MemoryTracer",
    "Part",
    "StaticConfig",
    "StaticPolicy",
    "TierBudgetError",
    "TierConfig",
    "Tiers",
    "TieredPolicy",
    "__version__",
    "offload_activations",
]
