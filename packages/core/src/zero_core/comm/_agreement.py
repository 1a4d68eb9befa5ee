"""What ranks agree on: the control-plane collectives (small flags, integers and objects), as free functions.

[Note: two planes of collectives]
Parameters and gradients travel through :mod:`zero_core.chunks._collectives` (the data plane); every
other collective the runtime issues is a decision the ranks must share (are we in step, which
group to gather next, did any rank see an overflow or fail, which rank-0 value everyone uses),
and goes through the functions here. No other core module calls a comm backend's collective, so
both planes can be read, counted and changed in one file each. Every function returns at once in
one process.
"""

from __future__ import annotations

from typing import Any

import torch

from zero_core.base.errors import CheckpointError

__all__ = ["agree_ok", "any_rank", "gather_objects", "max_over_ranks", "raise_if_any_failed", "rank0_value"]


def any_rank(comm: Any, flags: torch.Tensor) -> torch.Tensor:
    """Elementwise OR of a 1-D ``uint8`` tensor over the ranks."""
    return comm.agree_any(flags) if comm.world_size > 1 else flags


def max_over_ranks(comm: Any, values: list[int]) -> list[int]:
    """Elementwise maximum over the ranks of a list of int64 values."""
    if comm.world_size == 1:
        return list(values)
    return comm.agree_max(torch.tensor(values, dtype=torch.int64)).tolist()


def gather_objects(comm: Any, obj: Any) -> list[Any]:
    """Every rank's small picklable ``obj``, in rank order."""
    return comm.all_gather_object(obj) if comm.world_size > 1 else [obj]


def rank0_value(comm: Any, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a choice made once, used everywhere: an order, an id, an RNG state)."""
    return comm.all_gather_object(obj)[0] if comm.world_size > 1 else obj


def raise_if_any_failed(comm: Any, error: str | None, what: str) -> None:
    """Gather every rank's error message (``None``: fine); if any, raise :class:`CheckpointError` on every rank.

    The message is this rank's own error, or else the first failing rank's, named. A rank that
    died makes the gather itself fail: that is reported the same way.
    """
    try:
        errors = gather_objects(comm, error)
    except RuntimeError as exc:  # a rank died or timed out: the collective itself failed
        raise CheckpointError(f"{what}: another rank failed or stopped responding ({exc})") from exc
    if error is not None:
        raise CheckpointError(f"{what}: {error}")
    failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{what} (on rank {rank}): {message}")


def agree_ok(comm: Any, error: str | None, what: str) -> None:
    """A cheap check for loops (one flag all-reduce): if any rank has an error, every rank raises.

    The messages are gathered only when something failed.
    """
    if comm.world_size > 1:
        failed = bool(any_rank(comm, torch.tensor([error is not None], dtype=torch.uint8))[0].item())
        if failed:
            raise_if_any_failed(comm, error, what)
    elif error is not None:
        raise CheckpointError(f"{what}: {error}")
