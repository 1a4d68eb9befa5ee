"""Ranks that take different code paths are told so, instead of pairing unrelated collectives.

[Note: lockstep rounds]
Collectives on a process group pair by order alone. A rank that skips a backward (a
``continue`` on one rank), steps alone, or calls a collective verb alone (``if rank ==
0: save_checkpoint(...)``) would pair its next collective with whatever its peers do
next: an all-gather with a reduce-scatter, metadata with parameters. The result is
garbage, then a timeout far from the cause.

So every phase of the engine that communicates (a forward that gathers, a backward, an
optimizer step, a collective verb) begins with one *lockstep round* on the
data-parallel group: a flag all-reduce (MAX) of a fixed-size tag, ``t`` and ``255 - t``
byte by byte, where ``t`` encodes what the rank is about to do, the optimizer step it
is in and how many rounds it has run. MAX of ``t`` and of ``255 - t`` are the largest
and (inverted) smallest tag over ranks, so every rank sees at once whether all tags are
equal. One more byte carries a flag every rank contributes and every rank gets the OR of
(whether any rank wrote parameters outside the optimizer, see [Note: writes outside the
optimizer] in ``zero_core._residency``). Every round has the same size, so rounds of ranks on different paths still pair
with each other: the first collective a diverging rank issues is a round, and it meets
its peers' round. On a mismatch, every rank gathers the others' descriptions and raises
:class:`~zero_core.errors.RanksOutOfStepError` naming them. A rank whose peers never
arrive times out (``collective_timeout_s``) with the phase named.

Within a phase ranks may legitimately differ (unused parameters, experts chosen per
sample): [Note: agreeing on all-gathers] handles that. ``ZeroConfig(static_graph=True)``
promises identical paths and skips the rounds.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import torch

from zero_core._agreement import any_rank, gather_objects
from zero_core.errors import CollectiveTimeoutError, RanksOutOfStepError

__all__ = ["Lockstep"]

_MASK = 0xFFFFFFFF


class Lockstep:
    """Runs the lockstep rounds of one engine. See [Note: lockstep rounds]."""

    def __init__(self, comm: Any, *, enabled: bool) -> None:
        self.comm = comm
        self.enabled = enabled and comm.world_size > 1
        self.rounds = 0

    def begin(self, what: str, step: int, *, flag: bool = False) -> bool:
        """Check that every rank is about to do ``what`` in optimizer step ``step``; raise on every rank if not.

        Returns whether ``flag`` is set on any rank (this rank's own ``flag`` when rounds are off: a static
        graph promises every rank the same path)."""
        if not self.enabled:
            return flag
        self.rounds += 1
        tag = torch.frombuffer(bytearray(struct.pack("<III", zlib.crc32(what.encode()), step & _MASK,
                                                     self.rounds & _MASK)), dtype=torch.uint8)
        try:
            agreed = any_rank(self.comm, torch.cat([tag, 255 - tag, torch.tensor([int(flag)], dtype=torch.uint8)]))
        except CollectiveTimeoutError as err:
            raise CollectiveTimeoutError(
                f"rank {self.comm.rank} waited for the other ranks to start {what} (step {step}) and they did not "
                f"within the collective timeout: a rank raised an error, died, or runs code the others do not "
                f"(a rank-only branch around the model, optimizer.step() or a checkpoint call). ({err})"
            ) from err
        n = tag.numel()
        if torch.equal(agreed[:n], tag) and torch.equal(agreed[n : 2 * n], 255 - tag):
            return bool(agreed[2 * n].item())
        everyone = gather_objects(self.comm, (what, step, self.rounds))
        lines = "; ".join(f"rank {r}: {w} (step {s}, round {k})" for r, (w, s, k) in enumerate(everyone))
        raise RanksOutOfStepError(
            f"the ranks are out of step, so their collectives would pair wrongly: {lines}. Every rank must run "
            "the same forwards (at stage 3), backwards, optimizer steps and collective verbs (save_checkpoint, "
            "load_checkpoint, full_state_dict, gathered_parameters, load_state_dict) in the same order: a "
            "`continue` that skips the backward on one rank only, or `if rank == 0: save_checkpoint(...)`, does "
            "this. Skip the step on every rank together (agree on the condition with an all_reduce), and call "
            "collective verbs on every rank."
        )
