"""Let a LightningModule's step methods run as one zero forward.

``ZeroStrategy`` brackets the whole ``training_step`` (and the validation, test and
predict steps) as the sharded model's root forward, the way Lightning's DDP strategy
routes steps through the DDP wrapper. That serves both ``self(x)`` and ``self.net(x)``
inside a step. But ``self(x)`` inside the step would re-enter ``ZeroModule.__call__``,
which refuses a nested root forward; so the sharded module's class gets one more subclass
whose ``__call__`` passes nested calls straight to ``nn.Module.__call__``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["allow_nested_calls"]

_CLASSES: dict[type, type] = {}
_ROOT_CALL: dict[type, Any] = {}  # the subclass -> its base's __call__ (ZeroModule's)
_DEPTH = "_zero_lightning_depth"


def _cast(dtype: torch.dtype, value: Any) -> Any:
    # what ZeroModule.__call__ does to the root call's inputs, for nested calls too
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def _call(self: Any, *args: Any, **kwargs: Any) -> Any:
    if self.__dict__.get(_DEPTH, 0):
        # already inside the root forward the strategy opened: the engine is in FORWARD, gathering as modules run
        compute = self.engine.config.precision.compute
        if compute is not None:
            args, kwargs = tree_map(functools.partial(_cast, compute), (args, kwargs))
        return nn.Module.__call__(self, *args, **kwargs)
    self.__dict__[_DEPTH] = 1
    try:
        return _ROOT_CALL[type(self)](self, *args, **kwargs)  # ZeroModule.__call__
    finally:
        self.__dict__[_DEPTH] = 0


def allow_nested_calls(model: nn.Module) -> None:
    """Swap ``model``'s class (already a ZeroModule) for a subclass whose nested calls skip the root bracket."""
    cls = type(model)
    if cls in _CLASSES.values():
        return
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__doc__": cls.__doc__,
                                                     "__call__": _call})
        _ROOT_CALL[_CLASSES[cls]] = cls.__call__
    model.__class__ = _CLASSES[cls]
