"""The loss scaler for fp16 training: its scale, and how overflows move it.

[Note: one overflow check per step]
Gradients are unscaled where they are averaged (the reduction divides by
``world_size * scale``), so clipping and the optimizer always see true gradients. An
inf or NaN survives that division, so the check runs once, just before the optimizer
step, over this rank's gradient shards; one all-reduce (max) of a single flag makes
every rank reach the same verdict. On overflow every segment's gradient is dropped,
so the optimizer skips every parameter exactly as it skips unused ones: no parameter,
moment or step counter changes, on any rank. With several optimizers (see [Note: several
optimizers] in ``zero_core._shard``) the check runs at the first step after a backward and the
others that step the same gradients take its verdict: the scale moves once per iteration, and
an overflow skips every optimizer's step.
"""

from __future__ import annotations

from typing import Any

from zero_core.config.api import LossScale

__all__ = ["LossScaler"]


class LossScaler:
    """The running state of a :class:`~zero_core.LossScale`.

    It travels with the optimizer: ``optimizer.state_dict()`` holds it under
    ``"zero_loss_scaler"`` and ``optimizer.load_state_dict()`` restores it.
    """

    STATE_KEY = "zero_loss_scaler"

    def __init__(self, config: LossScale) -> None:
        self.config = config
        self.scale = config.init_scale
        self.clean_steps = 0  # steps without overflow since the scale last changed
        self.hysteresis_left = config.hysteresis
        self.overflows = 0  # skipped steps, over the whole run
        self.last_step_skipped = False

    def update(self, found_inf: bool) -> None:
        """Record one step's verdict (identical on every rank) and move the scale."""
        self.last_step_skipped = found_inf
        if not self.config.dynamic:
            self.overflows += found_inf
            return
        if found_inf:
            self.overflows += 1
            self.clean_steps = 0
            # DeepSpeed's and Megatron's rule: the last tolerated overflow is spent, so every further overflow
            # backs off until the hysteresis is refilled (by a clean step, or only by growth: see LossScale)
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            else:
                self.scale = max(self.scale * self.config.backoff_factor, self.config.min_scale)
            return
        if self.config.consecutive_hysteresis:
            self.hysteresis_left = self.config.hysteresis
        self.clean_steps += 1
        if self.clean_steps >= self.config.growth_interval:
            self.scale *= self.config.growth_factor
            self.clean_steps = 0
            self.hysteresis_left = self.config.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "hysteresis_left": self.hysteresis_left,
                "overflows": self.overflows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.overflows = int(state["overflows"])

    def __repr__(self) -> str:
        return f"LossScaler(scale={self.scale}, clean_steps={self.clean_steps}, overflows={self.overflows})"
