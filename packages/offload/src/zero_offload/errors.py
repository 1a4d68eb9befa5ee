"""Errors of the tiered placement policies; each says which tier and what to change."""

from __future__ import annotations

from zero_core import ConfigError, ZeroError

__all__ = ["DeviceBudgetError", "DiskTierError", "TierBudgetError"]


class TierBudgetError(ZeroError):
    """A tier's budget cannot hold what the policy must place there."""


class DeviceBudgetError(TierBudgetError, ConfigError):
    """The device budget is below what one step needs at its peak (one gather plus the measured non-model data)."""


class DiskTierError(ZeroError):
    """The disk tier's directory is unusable, or a read or write failed (full disk, I/O error)."""
