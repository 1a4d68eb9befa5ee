"""The comm backend interface (``backend``: what every backend implements, re-exported here as
``zero_core.comm``), its per-step counters, and the control plane: what ranks agree on (``_agreement``) and
keeping them in lockstep (``_lockstep``).

It may import its own modules and the rooms below it (base, config); never a room above it
(tests/test_import_graph.py, LAYERS).
"""

# ``zero_core.comm`` is a public path: it hands on the interface in ``backend`` on first use
# (PEP 562, as zero_core itself), so importing a module of this room imports nothing else.
from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    value = getattr(importlib.import_module("zero_core.comm.backend"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(importlib.import_module("zero_core.comm.backend"))))
