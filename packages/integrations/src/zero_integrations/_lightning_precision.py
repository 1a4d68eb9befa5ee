"""The precision plugin :class:`~zero_integrations.lightning.ZeroStrategy` installs in place of Lightning's own.

zero does the mixed precision itself (the model runs in the compute dtype, the master
shards stay fp32, fp16 has zero's loss scaler), so this plugin has no autocast and no
``GradScaler``. What it does do:

* run the closure (forward and backward) *before* ``optimizer.step()``: zero's
  step pre-hook checks the gradients are reduced and, for fp16, looks for overflows, so
  the backward must have happened when the step starts (Lightning's base plugin passes the
  closure into ``optimizer.step(closure=...)``, which would run it after the pre-hook);
* route backward through ``ZeroModule.backward`` (it scales the loss for fp16);
* clip by norm with :func:`zero_core.clip_grad_norm_`, the global norm over all shards.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision as LightningPrecision

import zero_core
from zero_core.base.errors import ConfigError

__all__ = ["ZeroPrecision", "zero_precision_for"]

# Lightning's precision flags zero can serve, and the zero_core.Precision each maps to.
_SUPPORTED = {
    "32-true": lambda: zero_core.Precision(),
    "bf16-mixed": lambda: zero_core.Precision(compute=torch.bfloat16),
    "16-mixed": lambda: zero_core.Precision(compute=torch.float16, loss_scale=zero_core.LossScale()),
}
# Older spellings Lightning still accepts for the same modes.
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed"}


def zero_precision_for(flag: Any) -> zero_core.Precision:
    """The ``zero_core.Precision`` for a Lightning precision flag; ``ConfigError`` for one zero cannot serve."""
    name = _ALIASES.get(flag, flag)
    if name not in _SUPPORTED:
        raise ConfigError(
            f"ZeroStrategy does not support Trainer(precision={flag!r}): zero keeps fp32 master shards and runs the "
            f"model in a compute dtype of its own; use one of {sorted(_SUPPORTED)} "
            "('bf16-mixed' and '16-mixed' map to zero_core.Precision(compute=bf16 / fp16 with a loss scale))"
        )
    return _SUPPORTED[name]()


class ZeroPrecision(LightningPrecision):
    """Lightning's precision hooks for a model sharded by zero. Built by ZeroStrategy; not for direct use."""

    def __init__(self, precision: str) -> None:
        super().__init__()
        zero_precision_for(precision)  # validates
        self.precision = _ALIASES.get(precision, precision)
        self._model: Any = None

    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple[Any, list[Any], list[Any]]:
        self._model = model  # clipping needs the sharded model, which Lightning's clip hooks do not pass
        return model, optimizers, lr_schedulers

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise ConfigError("ZeroStrategy's backward takes keyword arguments only (those of Tensor.backward)")
        if isinstance(model, zero_core.ZeroModule):
            # ZeroModule.backward, not LightningModule.backward (a subclass's override would skip the fp16 loss scale)
            zero_core.ZeroModule.backward(model, tensor, **kwargs)
        else:
            tensor.backward(**kwargs)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        # The closure runs first: see the module docstring. The same order as Lightning's AMP plugin.
        closure_result = partial(self._wrap_closure, model, optimizer, closure)()
        if closure_result is None and getattr(model, "automatic_optimization", False):
            # training_step returned None: Lightning skipped the backward, so there is nothing to step
            return None
        return optimizer.step(**kwargs)

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        if not isinstance(self._model, zero_core.ZeroModule):
            super().clip_grad_by_norm(optimizer, clip_val)
            return
        zero_core.clip_grad_norm_(self._model, float(clip_val))

    def state_dict(self) -> dict[str, Any]:
        return {}  # zero's checkpoint carries the loss scaler
