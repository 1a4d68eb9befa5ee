"""Marks the engine's own work, so a memory tracer can tell model data from activations.

It also runs that work outside ``torch.inference_mode()`` (see :func:`engine_work`).

Everything the engine allocates (gathered buffers, gradient buffers, collective copies,
optimizer states) is model data that placement policies account exactly; everything
else a step allocates (activations, temporaries of the user's compute) is non-model
data, which a tracer measures. The engine wraps its hooks in :func:`engine_work`, and
a tracer skips allocations made while :func:`in_engine_work` is true.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["engine_work", "engine_work_context", "in_engine_work"]

F = TypeVar("F", bound=Callable[..., Any])

# A plain counter, not thread-local: the engine's hooks run on the thread that runs forward and
# backward, which is the only thread a tracer's dispatch mode sees.
_depth = 0


def in_engine_work() -> bool:
    return _depth > 0


def engine_work(method: F) -> F:
    """Decorate an engine method whose allocations are model data."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global _depth
        _depth += 1
        try:
            if torch.is_inference_mode_enabled():
                # Buffers made inside inference_mode are inference tensors, which training may never update in
                # place: a gathered buffer or a shard moved during an evaluation must be an ordinary tensor.
                with torch.inference_mode(False), torch.no_grad():
                    return method(*args, **kwargs)
            return method(*args, **kwargs)
        finally:
            _depth -= 1

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def engine_work_context() -> Iterator[None]:
    """The same as :func:`engine_work`, for a block (inside generators, which a decorator cannot cover)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
