"""Every rank learns whether any rank failed, so all raise together instead of some waiting forever."""

from __future__ import annotations

from typing import Any

import torch

from zero_core.errors import CheckpointError

__all__ = ["agree_ok", "raise_if_any_failed"]


def raise_if_any_failed(comm: Any, error: str | None, what: str) -> None:
    """Gather every rank's error message (``None``: fine); if any, raise :class:`CheckpointError` on every rank.

    The message is this rank's own error, or else the first failing rank's, named. A rank that
    died makes the gather itself fail: that is reported the same way.
    """
    try:
        errors = comm.all_gather_object(error) if comm.world_size > 1 else [error]
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
        failed = bool(comm.agree_any(torch.tensor([error is not None], dtype=torch.uint8))[0].item())
        if failed:
            raise_if_any_failed(comm, error, what)
    elif error is not None:
        raise CheckpointError(f"{what}: {error}")
