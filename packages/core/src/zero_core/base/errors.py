"""Exceptions raised by zero. Each message says what is wrong and what to change."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CollectiveTimeoutError",
    "CommError",
    "ConfigError",
    "DeepSpeedConfigWarning",
    "GradientLostError",
    "OwnershipError",
    "PlanError",
    "PluginContractError",
    "PluginNotFoundError",
    "RanksDisagreeError",
    "RanksOutOfStepError",
    "ZeroError",
    "ZeroSetupError",
]


class ZeroError(RuntimeError):
    """Base class of every error zero raises on purpose."""


class ConfigError(ZeroError, ValueError):
    """A configuration value is invalid."""


class DeepSpeedConfigWarning(UserWarning):
    """:func:`config_from_deepspeed` could not map some keys; the message lists each with what to do instead."""


class PluginNotFoundError(ZeroError, KeyError):
    """A strategy, comm backend or placement policy name is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class PluginContractError(ZeroError):
    """A plugin (placement policy, shard strategy or comm backend) did not do what zero's interface requires of it.

    The message names the plugin, the method to implement or fix, and what that method must do."""


class ZeroSetupError(ZeroError, ValueError):
    """The model, optimizer or process group cannot be sharded as given."""


class RanksDisagreeError(ZeroError):
    """Ranks hold different models or configurations."""


class RanksOutOfStepError(ZeroError):
    """Ranks reached different collective phases (one skipped a backward, stepped or saved alone).

    Raised on every rank, naming what each was doing. See [Note: lockstep rounds]."""


class CollectiveTimeoutError(ZeroError, TimeoutError):
    """A collective did not complete in time: a peer failed or took another code path."""


class GradientLostError(ZeroError):
    """A gradient arrived after its chunk had already been reduced for this backward."""


class PlanError(ZeroError, ValueError):
    """A shard plan or a chunk layout is inconsistent (a strategy plugin's plan, a chunk built by hand)."""


class CommError(ZeroError, ValueError):
    """A collective was called with tensors or options it cannot take (sizes, an unknown op)."""


class OwnershipError(ZeroError):
    """A chunk was moved by code that does not own that move. See [Note: who moves a chunk]."""


class CheckpointError(ZeroError):
    """A checkpoint or state dict cannot be saved or loaded as asked; nothing was changed."""
