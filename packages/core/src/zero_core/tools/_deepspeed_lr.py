"""A DeepSpeed config's ``scheduler`` section as a torch learning-rate scheduler: :func:`deepspeed_lr_scheduler`.

[Note: DeepSpeed's schedules]
DeepSpeed builds its scheduler (``deepspeed/runtime/lr_schedules.py``) on the optimizer when the engine starts, with
``last_batch_iteration = -1``, and steps it after every optimizer step (not on a skipped fp16 step). So optimizer step
``s`` (from 0) runs at ``f(s - 1)``, where ``f(i)`` is the schedule's formula at ``last_batch_iteration = i`` and
``f(-1)`` is what the constructor writes into the optimizer. :class:`DeepSpeedLRScheduler` is a torch
``LRScheduler``, whose ``last_epoch`` is 0 after construction and ``s`` at step ``s``: it returns ``f(last_epoch - 1)``,
so every step runs at DeepSpeed's learning rate, and its ``state_dict()`` resumes the schedule where it was.

The formulas are those of DeepSpeed's master (commit 22779f2c): ``WarmupCosineLR`` holds ``cos_min_ratio`` once
``total_num_steps`` is past, and ``OneCycle``'s ``cycle_*_stair_count`` hold the rate on stairs; DeepSpeed 0.18 and
older ignore the stair counts and let the cosine rise again past ``total_num_steps`` (identical before that).
``OneCycle`` with ``cycle_momentum`` (its default) cycles ``betas[0]`` of an optimizer that has ``betas`` (Adam, AdamW)
and sets ``betas[1]`` to 0.99, as DeepSpeed does; an optimizer without ``betas`` keeps its momentum (DeepSpeed warns
and does the same).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from zero_core.base.errors import ConfigError

__all__ = ["DeepSpeedLRScheduler", "deepspeed_lr_scheduler"]

_REQUIRED = object()
# Each DeepSpeed scheduler type and its constructor's parameters with DeepSpeed's defaults (_REQUIRED: no default).
_PARAMS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {"total_num_steps": _REQUIRED, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupCosineLR": {"total_num_steps": _REQUIRED, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log"},
    "OneCycle": {"cycle_min_lr": _REQUIRED, "cycle_max_lr": _REQUIRED, "decay_lr_rate": 0.0,
                 "cycle_first_step_size": 2000, "cycle_second_step_size": None, "cycle_first_stair_count": 0,
                 "cycle_second_stair_count": None, "decay_step_size": 0, "cycle_momentum": True,
                 "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.0},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
                    "lr_range_test_staircase": False},
}
SCHEDULER_TYPES = tuple(_PARAMS)
# The values the HF Trainer's DeepSpeed integration fills for "auto" (transformers' HfTrainerDeepSpeedConfig).
_AUTO_FILLED = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")


def scheduler_section(ds_config: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The scheduler type and its params, from a whole DeepSpeed config or its ``scheduler`` section; checked."""
    section = ds_config.get("scheduler", ds_config) if isinstance(ds_config, Mapping) else ds_config
    if isinstance(section, Mapping) and "type" not in section and "zero_optimization" in section:
        raise ConfigError("the DeepSpeed config has no scheduler section: build a torch.optim.lr_scheduler instead")
    if not isinstance(section, Mapping) or "type" not in section:
        raise ConfigError('a DeepSpeed scheduler section is an object such as {"type": "WarmupLR", "params": {...}}, '
                          f"got {section!r}")
    kind, params = section["type"], section.get("params") or {}
    if kind not in _PARAMS:
        raise ConfigError(f"DeepSpeed key scheduler.type is {kind!r}, which is not a DeepSpeed scheduler; "
                          f"DeepSpeed has {', '.join(SCHEDULER_TYPES)}")
    if not isinstance(params, Mapping):
        raise ConfigError(f"DeepSpeed key scheduler.params must be an object, got {params!r}")
    unknown = [name for name in params if name not in _PARAMS[kind]]
    if unknown:
        raise ConfigError(f"DeepSpeed key(s) {', '.join(f'scheduler.params.{n}' for n in unknown)}: {kind} has no such "
                          f"parameter (DeepSpeed would fail with a TypeError); it takes {', '.join(_PARAMS[kind])}")
    for name in set(section) - {"type", "params"}:
        raise ConfigError(f"DeepSpeed key scheduler.{name}: a scheduler section has only type and params")
    return kind, dict(params)


def fill_scheduler_auto(params: dict[str, Any], *, learning_rate: float | None = None, total_num_steps: int | None = None,
                        warmup_num_steps: int | None = None, sources: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``params`` with the ``"auto"`` values HF fills (see :func:`deepspeed_lr_scheduler`); others left as they are."""
    given = {"warmup_min_lr": 0.0, "warmup_max_lr": learning_rate, "total_num_steps": total_num_steps,
             "warmup_num_steps": None if warmup_num_steps is None else max(1, int(warmup_num_steps))}
    out = dict(params)
    for name, value in params.items():
        if _is_auto(value) and given.get(name) is not None:
            out[name] = given[name]
    return out


def _is_auto(value: object) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


class DeepSpeedLRScheduler(torch.optim.lr_scheduler.LRScheduler):
    """One of DeepSpeed's schedules (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``,
    ``LRRangeTest``) as a torch ``LRScheduler``: the same learning rate (and, for ``OneCycle``, momentum) at every
    optimizer step as DeepSpeed's own, when ``step()`` is called after each ``optimizer.step()``.

    Build it with :func:`deepspeed_lr_scheduler`. ``state_dict()`` / ``load_state_dict()`` resume the schedule at
    the step it was saved at.

    Attributes:
        kind: The DeepSpeed type name.
        params: Every parameter of the type, DeepSpeed's defaults filled in.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, params: Mapping[str, Any],
                 last_epoch: int = -1, skip_step: Callable[[], bool] | None = None) -> None:
        self.skip_step = skip_step
        self.kind = kind
        self.params = dict(params)
        self.cycle_momentum = bool(kind == "OneCycle" and self.params["cycle_momentum"]
                                   and "betas" in getattr(optimizer, "defaults", {}))
        super().__init__(optimizer, last_epoch)

    # -- DeepSpeed's formulas, at last_batch_iteration = i (see [Note: DeepSpeed's schedules]) ---------------------

    def _warmup_gamma(self, i: int) -> float:
        steps = max(2, int(self.params["warmup_num_steps"]))
        if self.params["warmup_type"] == "linear":
            return i / steps
        return math.log(i + 1) / math.log(steps)  # "log", and DeepSpeed's fallback for any other value

    def _lr(self, i: int, base_lr: float | torch.Tensor, group: int) -> float | torch.Tensor:
        # a tensor where the optimizer's lr is one: base_lr, and self.base_lrs[0] (WarmupLR without warmup_max_lr)
        p, kind = self.params, self.kind
        if kind in ("WarmupLR", "WarmupDecayLR"):
            low = _per_group(p["warmup_min_lr"], group)
            # no warmup_max_lr: DeepSpeed takes the first group's learning rate for every group
            high = self.base_lrs[0] if p["warmup_max_lr"] is None else _per_group(p["warmup_max_lr"], group)
            if i < 0:
                return low
            steps = max(2, int(p["warmup_num_steps"]))
            if i < steps:
                gamma = self._warmup_gamma(i)
            elif kind == "WarmupLR":
                gamma = 1.0
            else:
                total = p["total_num_steps"]
                gamma = max(0.0, float(total - i) / float(max(1.0, total - steps)))
            return low + (high - low) * gamma
        if kind == "WarmupCosineLR":
            return base_lr * self._cosine_ratio(i)
        if kind == "LRRangeTest":
            interval = (i + 1) / p["lr_range_test_step_size"]
            if p["lr_range_test_staircase"]:
                interval = math.floor(float(i + 1) / p["lr_range_test_step_size"])
            return _per_group(p["lr_range_test_min_lr"], group) * (1 + p["lr_range_test_step_rate"] * interval)
        # OneCycle
        low, high = p["cycle_min_lr"], p["cycle_max_lr"]
        if i < 0:
            return low
        total = self._cycle_total()
        if i < total:
            return low + (high - low) * self._scale_factor(i)
        if math.isclose(p["decay_step_size"], 0) or math.isclose(p["decay_lr_rate"], 0):
            return low
        return low / (1 + p["decay_lr_rate"] * (i - total + 1) / p["decay_step_size"])

    def _cosine_ratio(self, i: int) -> float:
        p = self.params
        if i < 0:
            return 0.0
        steps = max(2, int(p["warmup_num_steps"]))
        if i < steps:
            return p["warmup_min_ratio"] + self._warmup_gamma(i) * (1.0 - p["warmup_min_ratio"])
        progress = min(1.0, (i - steps + 1) / max(1, p["total_num_steps"] - steps))
        return max(0.0, p["cos_min_ratio"] + (1.0 - p["cos_min_ratio"]) * (1 + math.cos(math.pi * progress)) / 2)

    def _cycle_total(self) -> float:
        first = float(self.params["cycle_first_step_size"])
        second = self.params["cycle_second_step_size"]
        return first + (first if second is None else float(second))

    def _scale_factor(self, i: int) -> float:
        p = self.params
        first = float(p["cycle_first_step_size"])
        total = self._cycle_total()
        ratio = first / total
        batch = i + 1
        x = 1.0 + batch / total - math.floor(1 + batch / total)
        if x <= ratio:
            scale, stairs = x / ratio, p["cycle_first_stair_count"]
        else:
            scale = (x - 1) / (ratio - 1)
            second_stairs = p["cycle_second_stair_count"]
            stairs = p["cycle_first_stair_count"] if second_stairs is None else second_stairs
        if stairs > 0:
            within = batch % total
            position = within * stairs / first if within <= first else (total - within) * stairs / (total - first)
            scale = math.floor(position) / stairs
        return scale

    def _momentum(self, i: int) -> float:
        p = self.params
        if i < 0:
            return p["cycle_min_mom"]
        if i < self._cycle_total():
            return p["cycle_max_mom"] - (p["cycle_max_mom"] - p["cycle_min_mom"]) * self._scale_factor(i)
        if math.isclose(p["decay_step_size"], 0) or math.isclose(p["decay_mom_rate"], 0):
            return p["cycle_max_mom"]
        return p["cycle_max_mom"] * (1 + p["decay_mom_rate"] * (i - self._cycle_total() + 1) / p["decay_step_size"])

    # -- torch's LRScheduler ------------------------------------------------------------------------------------

    def get_lr(self) -> list[float | torch.Tensor]:
        return [self._lr(self.last_epoch - 1, base, index) for index, base in enumerate(self.base_lrs)]

    def step(self, epoch: int | None = None) -> None:
        if self.skip_step is not None and self.last_epoch >= 0 and self.skip_step():
            return  # DeepSpeed does not step its scheduler after a step an fp16 overflow skipped
        super().step(epoch)
        self._set_momentum()

    def state_dict(self) -> dict[str, Any]:
        return {key: value for key, value in super().state_dict().items() if key != "skip_step"}

    def _set_momentum(self) -> None:
        if self.cycle_momentum:
            beta1 = self._momentum(self.last_epoch - 1)
            for group in self.optimizer.param_groups:
                group["betas"] = (beta1, 0.99)  # DeepSpeed's OneCycle sets the second beta to 0.99

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # the learning rate (and momentum) of the next step, as DeepSpeed's scheduler computes it after a resume
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        self._set_momentum()


def _per_group(value: Any, group: int) -> float:
    return value[group] if isinstance(value, (list, tuple)) else value


def deepspeed_lr_scheduler(optimizer: torch.optim.Optimizer, ds_config: Mapping[str, Any], *,
                           total_num_steps: int | None = None, warmup_num_steps: int | None = None,
                           learning_rate: float | None = None,
                           skip_step: Callable[[], bool] | None = None) -> DeepSpeedLRScheduler:
    """The learning-rate scheduler a DeepSpeed config's ``scheduler`` section asks for, built on ``optimizer``.

    Use it on the optimizer :func:`zero_core.shard` returns and call ``scheduler.step()`` after every
    ``optimizer.step()``: each step then runs at the learning rate (and, for ``OneCycle``, the momentum) DeepSpeed's
    own scheduler gives it (see [Note: DeepSpeed's schedules] in the source for the conventions).

    Args:
        optimizer: The optimizer whose parameter groups it sets.
        ds_config: The whole DeepSpeed config (a dict) or just its ``scheduler`` section.
        total_num_steps: Fills a ``"total_num_steps": "auto"``, as HF's Trainer does (its number of training steps).
        warmup_num_steps: Fills a ``"warmup_num_steps": "auto"`` (HF uses ``max(1, args.get_warmup_steps(n))``).
        learning_rate: Fills a ``"warmup_max_lr": "auto"``; ``"warmup_min_lr": "auto"`` is 0, as HF fills it.
        skip_step: Called by each ``step()``; when it returns True the schedule does not advance, as DeepSpeed's
            does not after a step its fp16 loss scaler skipped. For fp16 with a loss scale pass
            ``lambda: model.loss_scaler.last_step_skipped``.

    Returns:
        A torch ``LRScheduler`` whose ``state_dict()`` resumes the schedule.

    Raises:
        ConfigError: An unknown type or parameter, a required parameter missing, or an ``"auto"`` value left that
            none of the keyword arguments fills.
    """
    if isinstance(ds_config, (str, bytes)) or not isinstance(ds_config, Mapping):
        raise ConfigError(f"deepspeed_lr_scheduler takes the DeepSpeed config as a dict, got {type(ds_config).__name__}")
    kind, given = scheduler_section(ds_config)
    given = fill_scheduler_auto(given, learning_rate=learning_rate, total_num_steps=total_num_steps,
                                warmup_num_steps=warmup_num_steps)
    left = [name for name, value in given.items() if _is_auto(value)]
    if left:
        hint = {"total_num_steps": "total_num_steps=", "warmup_num_steps": "warmup_num_steps=",
                "warmup_max_lr": "learning_rate="}
        fixes = [f"scheduler.params.{n}" + (f" (pass {hint[n]})" if n in hint else " (write a number)") for n in left]
        raise ConfigError(f"DeepSpeed scheduler {kind}: 'auto' is filled only in {', '.join(_AUTO_FILLED)}, as HF's "
                          f"Trainer fills them; fill {', '.join(fixes)}")
    params = {name: given.get(name, default) for name, default in _PARAMS[kind].items()}
    missing = [name for name, value in params.items() if value is _REQUIRED]
    if missing:
        raise ConfigError(f"DeepSpeed scheduler {kind} needs scheduler.params.{', scheduler.params.'.join(missing)}")
    for name in ("warmup_num_steps",):
        if name in params and (isinstance(params[name], bool) or not isinstance(params[name], int) or params[name] <= 0):
            raise ConfigError(f"DeepSpeed key scheduler.params.{name} must be a positive whole number, "
                              f"got {params[name]!r}")
    for name, value in params.items():
        if name in ("warmup_type", "cycle_momentum", "lr_range_test_staircase") or value is None:
            continue
        values = value if isinstance(value, (list, tuple)) and name in ("warmup_min_lr", "warmup_max_lr",
                                                                          "lr_range_test_min_lr") else [value]
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
            raise ConfigError(f"DeepSpeed key scheduler.params.{name} must be a number, got {value!r}")
        if len(values) > 1 and len(values) != len(optimizer.param_groups):
            raise ConfigError(f"DeepSpeed key scheduler.params.{name} has {len(values)} values for "
                              f"{len(optimizer.param_groups)} parameter groups")
    for name in ("lr_range_test_step_size", "cycle_first_step_size"):
        if name in params and not params[name] > 0:
            raise ConfigError(f"DeepSpeed key scheduler.params.{name} must be positive, got {params[name]!r}")
    return DeepSpeedLRScheduler(optimizer, kind, params, skip_step=skip_step)
