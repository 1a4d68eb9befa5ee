"""Ranks that take different code paths are told so, instead of pairing unrelated collectives.

[Note: lockstep rounds]
Collectives on a process group pair by order alone. A rank that skips a backward (a
``continue`` on one rank), steps alone, or calls a collective verb alone (``if rank ==
0: save_checkpoint(...)``) would pair its next collective with whatever its peers do
next: an all-gather with a reduce-scatter, metadata with parameters. The result is
garbage, then a timeout far from the cause.

So every phase of the engine that communicates (a forward that gathers, a backward, an
optimizer step, a collective verb) begins with one *lockstep round* on the
data-parallel group, and every agreement inside a phase (which group to all-gather
next, see [Note: agreeing on all-gathers]) is a message of the same form: one MAX
all-reduce of two int64 words. The tag ``t`` is a 31-bit hash of what the rank is about
to do, the optimizer step it is in and how many rounds it has run. The first word holds
``t`` in its high half and a 32-bit payload in its low half; the second holds ``2**31 -
1 - t`` in its high half. MAX of the first word's high half is the largest tag over
ranks, of the second the (complemented) smallest, so every rank sees at once whether
all tags are equal; when they are, the low half is the largest payload. A round's
payload is a flag every rank contributes and every rank gets the OR of (whether any
rank wrote parameters outside the optimizer, see [Note: writes outside the optimizer]
in ``zero_core.runtime._residency``); an agreement's is the complemented proposal, whose MAX is
the smallest proposal. Two words, not more: gloo's all-reduce costs about 0.3 ms for one
element, 0.4 ms for two and 0.8 ms from four on, on this project's CPUs, and a stage-3
pass that cannot replay issues one agreement per all-gather.

Every message has the same size, dtype and operation, so messages of ranks on different
paths still pair with each other, in any phase: a rank whose forward raised and who
went on to its next batch meets, with its next round, a peer's agreement in the middle
of the old forward, and both see the tags differ. On a mismatch, every rank gathers the
others' descriptions and raises :class:`~zero_core.base.errors.RanksOutOfStepError` naming
them. Two different descriptions hash to one tag with probability 2**-31. A rank whose
peers never arrive times out (``collective_timeout_s``) with the phase named.

Data-plane collectives carry no tag. A rank that leaves a forward while its peers replay a
repeated gather sequence (all-gathers with no agreement, see [Note: replaying a repeated
gather sequence]) first finishes that sequence, as a pass that ended would (see [Note: a
forward that raises finishes its gathers] in ``zero_core.runtime._engine``); a rank whose backward
raised halfway while its peers reduce-scatter issues, when it next calls zero, the rest of
that backward's all-gathers, reductions and agreement (see [Note: a backward that raises
finishes its collectives]). Either way its next round meets its peers' next round. A rank
that never calls zero again is caught by the collective timeout.

Within a phase ranks may legitimately differ (unused parameters, experts chosen per
sample): [Note: agreeing on all-gathers] handles that. ``ZeroConfig(static_graph=True)``
promises identical paths and skips the rounds.

A round can also compare what its phase starts from, at no extra collective: ``begin(...,
state=...)`` hashes a rank's state into the tag, and only a mismatch gathers the states to
say what differs. The ``optimizer.step()`` round does so with the gradients each rank is
about to step (see [Note: what a step round agrees on] in ``zero_core.runtime._step_state``): a rank
that cleared or assigned gradients alone reaches the same phase as its peers, and would
otherwise step its shard with other gradients, silently. Collectives zero issues for the
user outside the engine's phases begin with a round too: ``zero_core.clip_grad_norm_`` and
torch's clip over the sharded parameters (see [Note: a round before torch's clip] in
``zero_core.base._dtensor_ops``), so a rank that skips a clip meets its peers' clip with its
step's round.

With ``static_graph=True`` none of this holds: a rank that clears its gradients alone drops
its shard's update silently, one that skips a clip waits out ``collective_timeout_s`` (inside
torch's all-reduce, on the parameters' own group: see [Note: torch's collectives on a group
of their own] in ``zero_core._shard``), and one that runs an extra backward pairs its
reduce-scatters with its peers' next ones. Use it only where every rank runs the same code.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

from zero_core.base.errors import CollectiveTimeoutError, RanksOutOfStepError
from zero_core.comm._agreement import gather_objects, max_over_ranks

__all__ = ["Lockstep"]

_LOW = 0xFFFFFFFF
_TAG = (1 << 31) - 1


class Lockstep:
    """Runs the lockstep rounds and tagged agreements of one engine. See [Note: lockstep rounds]."""

    def __init__(self, comm: Any, *, enabled: bool) -> None:
        self.comm = comm
        self.enabled = enabled and comm.world_size > 1
        self.rounds = 0
        self._step = 0  # the optimizer step of the last round: agreements inside its phase carry it

    def begin(self, what: str, step: int, *, flag: bool = False, state: Callable[[], bytes] | None = None,
              explain: Callable[[list[bytes]], str] | None = None) -> bool:
        """Check that every rank is about to do ``what`` in optimizer step ``step``; raise on every rank if not.

        ``state``: what every rank's copy of the phase's inputs must agree on (see [Note: what a step round
        agrees on] in ``zero_core.runtime._step_state``), hashed into the tag, so it costs no collective; on a mismatch
        of ``state`` alone, ``explain(every rank's state)`` says what differs. Returns whether ``flag`` is set
        on any rank (this rank's own ``flag`` when rounds are off: a static graph promises every rank the same
        path)."""
        if not self.enabled:
            return flag
        self.rounds += 1
        self._step = step
        try:
            payload = self._message(what, int(flag), state=state() if state is not None else None, explain=explain)
        except CollectiveTimeoutError as err:
            raise CollectiveTimeoutError(
                f"rank {self.comm.rank} waited for the other ranks to start {what} (step {step}) and they did not "
                f"within the collective timeout: a rank raised an error, died, or runs code the others do not "
                f"(a rank-only branch around the model, optimizer.step() or a checkpoint call, or a torch "
                f"collective over the sharded parameters on some ranks only: torch.nn.utils.clip_grad_norm_, "
                f"DTensor.full_tensor()). ({err})"
            ) from err
        return bool(payload)

    def min(self, what: str, value: int) -> int:
        """The smallest ``value`` (0 to 2**32 - 1) over the ranks, in a message tagged like a round."""
        if not 0 <= value <= _LOW:
            raise ValueError(f"an agreement carries 0 to 2**32 - 1, got {value}")
        return _LOW - self._message(what, _LOW - value)

    def _message(self, what: str, payload: int, *, state: bytes | None = None,
                 explain: Callable[[list[bytes]], str] | None = None) -> int:
        """Every rank's ``payload`` maximised, if every rank sent the same ``what`` (and ``state``) in the same round."""
        key = f"{what}|{self._step}|{self.rounds}"
        if state is not None:
            key += f"|{zlib.crc32(state):08x}"
        tag = zlib.crc32(key.encode()) & _TAG
        first, second = max_over_ranks(self.comm, [(tag << 32) | payload, (_TAG - tag) << 32])
        if first >> 32 == tag and _TAG - (second >> 32) == tag:
            return first & _LOW
        everyone = gather_objects(self.comm, (what, self._step, self.rounds, state))
        if explain is not None and len({(w, s, k) for w, s, k, _ in everyone}) == 1:
            raise RanksOutOfStepError(f"the ranks are out of step at {what} (step {self._step}): "
                                      + explain([st for *_, st in everyone]))
        lines = "; ".join(f"rank {r}: {w} (step {s}, round {k})" for r, (w, s, k, _) in enumerate(everyone))
        raise RanksOutOfStepError(
            f"the ranks are out of step, so their collectives would pair wrongly: {lines}. Every rank must run "
            "the same forwards (at stage 3), backwards, clips, optimizer steps and collective verbs (save_checkpoint, "
            "load_checkpoint, full_state_dict, gathered_parameters, load_state_dict) in the same order: a "
            "`continue` that skips the backward on one rank only, a batch skipped on one rank after its forward "
            "raised, an extra micro-batch or a skipped clip on one rank, or `if rank == 0: save_checkpoint(...)`, "
            "does this. Skip a step or a clip on every rank together (agree on the condition with an all_reduce), "
            "and call collective verbs on every rank."
        )
