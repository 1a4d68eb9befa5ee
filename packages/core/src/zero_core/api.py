"""Deprecated path: ``zero_core.api`` moved to ``zero_core.config.api``; this path goes in the next release.

Import the names from ``zero_core`` (or ``zero_core.plugin``), or from
``zero_core.config.api``.
"""
# restructure.py: shim (an alias: the module object is zero_core.config.api's)

import sys
import warnings

import zero_core.config.api  # noqa: F401 - loads it

warnings.warn(
    "zero_core.api moved to zero_core.config.api; import from zero_core, zero_core.plugin "
    "or zero_core.config.api. The old path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = sys.modules["zero_core.config.api"]
