"""Install hints that work from where the user stands.

zero's distributions are not on a package index yet, so ``pip install zero-offload`` finds
nothing. A hint therefore names the command that works here: an editable install from the
zero checkout the current directory is in, the wheels ``nox -s build`` left in a ``dist/``
folder, or, when neither is found, all three forms.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["install_command"]

# Where each distribution lives in a zero checkout.
_SOURCES = {
    "zero-core": "packages/core",
    "zero-comm": "packages/comm",
    "zero-comm-quantized": "packages/comm-quantized",
    "zero-strategy-chunk": "packages/strategies/chunk",
    "zero-strategy-tensor": "packages/strategies/tensor",
    "zero-offload": "packages/offload",
    "zero-integrations": "packages/integrations",
    "zero-bench": "benchmarks",
}


def install_command(distribution: str, *, extra: str = "", cwd: str | os.PathLike[str] | None = None) -> str:
    """A ``pip install`` command for ``distribution`` (with ``extra``, such as ``"[hf]"``) that works from ``cwd``."""
    where = Path(cwd if cwd is not None else os.getcwd()).resolve()
    source = _SOURCES.get(distribution)
    wheel = distribution.replace("-", "_")
    for directory in (where, *where.parents):
        if source is not None and (directory / source / "pyproject.toml").is_file():
            return f"pip install -e '{directory / source}{extra}'"
        if any((directory / "dist").glob(f"{wheel}-*.whl")):
            return f"pip install --find-links {directory / 'dist'} '{distribution}{extra}'"
    return (f"pip install --find-links DIST '{distribution}{extra}' with the wheels `nox -s build` writes to DIST, or "
            f"pip install -e '{source or distribution}{extra}' from a zero checkout (zero is not on a package index yet)")
