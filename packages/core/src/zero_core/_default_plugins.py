"""The registered path ``zero_core._default_plugins`` (an entry point in packages/core/pyproject.toml).

It is the module ``zero_core.interfaces._default_plugins`` itself, so installed metadata keeps working without a
reinstall.
"""
# restructure.py: shim (an alias: the module object is zero_core.interfaces._default_plugins's)

import sys

import zero_core.interfaces._default_plugins  # noqa: F401 - loads it

sys.modules[__name__] = sys.modules["zero_core.interfaces._default_plugins"]
