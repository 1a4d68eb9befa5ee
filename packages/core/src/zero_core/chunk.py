"""Deprecated path: ``zero_core.chunk`` moved to ``zero_core.chunks.chunk``; this path goes in the next release.

Import the names from ``zero_core`` (or ``zero_core.plugin``), or from
``zero_core.chunks.chunk``.
"""
# restructure.py: shim (an alias: the module object is zero_core.chunks.chunk's)

import sys
import warnings

import zero_core.chunks.chunk  # noqa: F401 - loads it

warnings.warn(
    "zero_core.chunk moved to zero_core.chunks.chunk; import from zero_core, zero_core.plugin "
    "or zero_core.chunks.chunk. The old path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = sys.modules["zero_core.chunks.chunk"]
