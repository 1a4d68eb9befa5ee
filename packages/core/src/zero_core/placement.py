"""Deprecated path: ``zero_core.placement`` moved to ``zero_core.interfaces.placement``; this path goes in the next release.

Import the names from ``zero_core`` (or ``zero_core.plugin``), or from
``zero_core.interfaces.placement``.
"""
# restructure.py: shim (an alias: the module object is zero_core.interfaces.placement's)

import sys
import warnings

import zero_core.interfaces.placement  # noqa: F401 - loads it

warnings.warn(
    "zero_core.placement moved to zero_core.interfaces.placement; import from zero_core, zero_core.plugin "
    "or zero_core.interfaces.placement. The old path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = sys.modules["zero_core.interfaces.placement"]
