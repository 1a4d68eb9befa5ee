"""Who may move a chunk: the engine between states, the placement policy between tiers.

[Note: who moves a chunk]
A chunk has two state axes (``zero_core.base._state``) and each has one owner:

* its ``ChunkState`` (SHARDED, GATHERING, GATHERED) changes only by the engine: the gather
  scheduler gathers, the engine's hooks release. A placement policy never gathers or
  releases, because whether a chunk is gathered is part of the collective order every rank
  must follow (see [Note: agreeing on all-gathers]);
* its ``MemoryTier`` (where its shard, gradient and optimizer states live) changes only
  inside a call the engine makes to the placement policy (``attach``, ``before_compute``,
  ``before_gather``, ``after_release``, ``before_load``/``after_load``, ``after_backward``,
  ``before_step``/``after_step``, ``on_transition``): the engine knows at those points that
  nothing reads the shard, and nowhere else.

Chunks owned by an engine (``Chunk.owned``, set by ``shard()``) assert both rules; a chunk
built on its own (conformance kits, micro-benchmarks) is free to be driven directly.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["in_policy_call", "policy_call"]

F = TypeVar("F", bound=Callable[..., Any])

_local = threading.local()


def in_policy_call() -> bool:
    """Whether the engine is inside a call to a placement policy's hook on this thread."""
    return getattr(_local, "depth", 0) > 0


def policy_call(method: F) -> F:
    """Mark a placement-policy hook: tier moves are allowed while it runs, state moves are not."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            return method(*args, **kwargs)
        finally:
            _local.depth -= 1

    call.__zero_policy_call__ = True  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]
