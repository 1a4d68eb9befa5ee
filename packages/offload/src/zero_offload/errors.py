"""Errors of the tiered placement policies; each says which tier and what to change."""

from __future__ import annotations

from typing import Any

from zero_core import ConfigError, ZeroError

__all__ = ["DeviceBudgetError", "DiskTierError", "TierBudgetError"]


class TierBudgetError(ZeroError):
    """A tier's budget cannot hold what the policy must place there."""


class DeviceBudgetError(TierBudgetError, ConfigError):
    """The device budget is below what one step needs at its peak (one gather plus the measured non-model data).

    Attributes:
        needed: Bytes of device budget asked for: from the plan (``measured``), the smallest budget the plan
            accepts, which trains every step; at setup, before anything is measured, a lower bound
            (one gather group's buffers and gradient buffers, activations not included).
        measured: Whether ``needed`` comes from a measured step (exact) or is the setup's lower bound.
    """

    def __init__(self, message: str, needed: int | None = None, measured: bool = False) -> None:
        super().__init__(message)
        self.needed = needed
        self.measured = measured

    def __reduce__(self) -> tuple[Any, ...]:
        # raised on a rank and re-raised by the launcher: keep the figures, not just the message
        return type(self), (str(self), self.needed, self.measured)


class DiskTierError(ZeroError):
    """The disk tier's directory is unusable, or a read or write failed (full disk, I/O error)."""
