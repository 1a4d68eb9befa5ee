"""zero-strategy-tensor: tensor-wise ZeRO-3 for zero, one evenly sharded buffer per parameter."""

from zero_strategy_tensor._strategy import TensorStrategy, module_groups
from zero_strategy_tensor._version import __version__

__all__ = ["TensorStrategy", "__version__", "module_groups"]
