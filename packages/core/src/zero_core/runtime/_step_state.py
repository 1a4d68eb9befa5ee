"""What every rank's ``optimizer.step()`` must agree on: which gradients it steps, and where they came from.

[Note: what a step round agrees on]
Each rank steps its own shard of every parameter, with the gradient its sharded parameter
holds. After a backward those gradients agree on every rank: the reduction gave each rank
its piece of the same mean, and a parameter gets a gradient on every rank when it got one
on any (unused parameters get none anywhere). A rank that changes its gradients alone
before the step breaks that, and no collective would notice: ``optimizer.zero_grad()`` on
one rank between ``backward()`` and ``step()`` drops that rank's shard of the update (the
parameters come out 7e-2 off at 4 ranks), ``p.grad = ...`` on one rank steps that rank's
shard with another gradient, and a rank that clears before its backward while its peers
accumulate steps a different sum.

So the step's lockstep round (see [Note: lockstep rounds] in ``zero_core.comm._lockstep``)
hashes this rank's *gradient state* into its tag: for every segment of the trainable
chunks, in plan order, whether its ``.grad`` is missing, the tensor the engine left there
(handed over by a backward, or as the last step left it), or another tensor; and how many
backwards were handed over into the gradients since ``zero_grad()`` last cleared some. The
round costs nothing more: the same two words carry a tag that now also differs when the
states do, and only on a mismatch do the ranks gather their states to name the parameters
and the likely cause. Ranks that do the same thing agree, whatever it is: every rank
clearing, every rank clipping in place, every rank replacing ``.grad``. What stays
invisible is a rank changing its gradients' values in place alone (``p.grad.mul_(2)``);
that needs their values, which no round carries.

Legitimate differences are already agreed: a parameter without a gradient has none on
every rank, an fp16 overflow drops every rank's gradients after the round (its check is an
all-reduce), and a placement policy steps chunks early (``step_chunks``) after the round
too. With ``ZeroConfig(static_graph=True)`` there are no rounds, and no check: that
setting promises every rank the same path.
"""

from __future__ import annotations

import struct
import weakref
from typing import Any

__all__ = ["GradientState"]

_NONE, _ENGINE, _OTHER = 0, 1, 2
_WHAT = {_NONE: "no gradient", _ENGINE: "the reduced gradient", _OTHER: "a tensor assigned to .grad"}


class GradientState:
    """This rank's gradient state, as the step round compares it. See [Note: what a step round agrees on]."""

    def __init__(self, chunks: Any, *, active: bool = True) -> None:
        self._chunks = chunks  # a callable: the trainable chunks, in plan order (the reducer's order)
        # Whether step rounds run at all (not at one rank, nor with static_graph=True): without them nothing reads
        # this state, and keeping it would cost a pass over every parameter twice a step.
        self.active = active
        # The last segment list, and the order list it was made from (the reducer replaces it when parameters are
        # frozen or unfrozen): made again only then, not on every read.
        self._made_from: Any = None
        self._made: list[tuple[str, Any]] = []
        # each segment's gradient as the engine left it, by the sharded parameter's id; weak, so a gradient the
        # user drops is freed and a new tensor can never pass for it
        self._left: dict[int, weakref.ref[Any]] = {}
        self.backwards = 0  # backwards handed over since zero_grad() last cleared a gradient

    def _segments(self) -> list[tuple[str, Any]]:
        order = self._chunks()
        if order is not self._made_from:
            self._made = [(chunk.slots[seg.slot].name, seg.param) for chunk in order for seg in chunk.segments]
            self._made_from = order
        return self._made

    def mark(self, *, handed_over: bool = False) -> None:
        """The engine left the gradients as they are now (a backward handed them over, or a step ended)."""
        if not self.active:
            return
        if handed_over:
            self.backwards += 1
        self._left = {id(p): weakref.ref(p.grad) for _, p in self._segments() if p.grad is not None}

    def cleared(self) -> None:
        """``zero_grad()`` runs: it clears something only where a gradient is set."""
        if self.active and any(p.grad is not None for _, p in self._segments()):
            self.backwards = 0

    def state(self) -> bytes:
        """What the ranks' step rounds compare."""
        codes = bytearray()
        for _, param in self._segments():
            grad = param.grad
            if grad is None:
                codes.append(_NONE)
            else:
                left = self._left.get(id(param))
                codes.append(_ENGINE if left is not None and left() is grad else _OTHER)
        return struct.pack("<I", min(self.backwards, 0xFFFFFFFF)) + bytes(codes)

    def explain(self, states: list[bytes]) -> str:
        """Every rank's :meth:`state` (rank order) as a sentence naming what differs and the fix."""
        names = [name for name, _ in self._segments()]
        counts = [struct.unpack("<I", s[:4])[0] for s in states]
        parts = []
        if len(set(counts)) > 1:
            listed = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
            parts.append(f"the backwards accumulated into the gradients since zero_grad() last cleared them differ "
                         f"({listed}): a rank cleared its gradients alone, or ran an extra backward")
        differing = [i for i in range(len(names)) if len({s[4 + i] for s in states if len(s) > 4 + i}) > 1]
        if differing:
            shown = []
            for i in differing[:3]:
                by_rank = ", ".join(f"rank {r}: {_WHAT.get(s[4 + i], '?')}" for r, s in enumerate(states))
                shown.append(f"{names[i]} ({by_rank})")
            more = f" and {len(differing) - 3} more" if len(differing) > 3 else ""
            parts.append(f"parameter(s) {'; '.join(shown)}{more} hold different gradients")
        if not parts:
            parts.append("the ranks' gradient states differ")
        return (
            "; ".join(parts) + ". Each rank would step its own shard with different gradients, and the model would "
            "drift silently. A rank called optimizer.zero_grad() (or model.zero_grad()) alone between backward() and "
            "step(), or set .grad on some ranks only: clear and set gradients the same way on every rank (the "
            "reduced gradients always agree), and agree on any condition around them with an all_reduce."
        )
