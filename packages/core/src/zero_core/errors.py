"""Deprecated path: ``zero_core.errors`` moved to ``zero_core.base.errors``; this path goes in the next release.

Import the names from ``zero_core`` (or ``zero_core.plugin``), or from
``zero_core.base.errors``.
"""
# restructure.py: shim (an alias: the module object is zero_core.base.errors's)

import sys
import warnings

import zero_core.base.errors  # noqa: F401 - loads it

warnings.warn(
    "zero_core.errors moved to zero_core.base.errors; import from zero_core, zero_core.plugin "
    "or zero_core.base.errors. The old path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = sys.modules["zero_core.base.errors"]
