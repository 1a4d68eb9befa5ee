"""Deprecated path: ``zero_core.strategy`` moved to ``zero_core.interfaces.strategy``; this path goes in the next release.

Import the names from ``zero_core`` (or ``zero_core.plugin``), or from
``zero_core.interfaces.strategy``.
"""
# restructure.py: shim (an alias: the module object is zero_core.interfaces.strategy's)

import sys
import warnings

import zero_core.interfaces.strategy  # noqa: F401 - loads it

warnings.warn(
    "zero_core.strategy moved to zero_core.interfaces.strategy; import from zero_core, zero_core.plugin "
    "or zero_core.interfaces.strategy. The old path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = sys.modules["zero_core.interfaces.strategy"]
