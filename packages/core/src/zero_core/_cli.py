"""The registered path ``zero_core._cli`` (an entry point in packages/core/pyproject.toml).

It is the module ``zero_core.cli._cli`` itself, so installed metadata keeps working without a
reinstall.
"""
# restructure.py: shim (an alias: the module object is zero_core.cli._cli's)

import sys

import zero_core.cli._cli  # noqa: F401 - loads it

sys.modules[__name__] = sys.modules["zero_core.cli._cli"]
