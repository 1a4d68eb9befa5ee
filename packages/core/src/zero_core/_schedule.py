"""Keeping every rank's all-gathers in one order when ranks run different modules.

[Note: agreeing on all-gathers]
Collectives on a process group match by order, so every rank must all-gather the same
chunks in the same sequence. A model whose control flow depends on the data (experts
chosen per sample, branches skipped on some ranks, outputs that reach the loss on
some ranks only) needs different chunks on different ranks. The scheduler merges the
ranks' needs: each pass (a forward, or a backward) walks the chunks in plan order
(reverse order in backward); a rank that needs chunk ``k`` proposes the next position
of ``k`` on that walk, and one scalar MIN all-reduce picks the earliest proposal of
any rank. Every rank then joins the all-gather of that chunk; ranks that did not ask
for it gather into a scratch buffer and drop it. When a rank's pass ends, it keeps
answering with "nothing" until every rank is done. Needing a chunk again later in the
same pass (a tied weight, a module called twice) starts a new lap of the walk.

With ``ZeroConfig(static_graph=True)`` the user promises that every rank runs the
same modules in the same order, and the agreement rounds are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

from zero_core.chunk import Chunk
from zero_core.comm import CommBackend
from zero_core.placement import PlacementPolicy

__all__ = ["GatherScheduler"]

_NOTHING = 1 << 62


class GatherScheduler:
    """Gathers chunks so that every rank issues the same all-gathers in the same order."""

    def __init__(self, chunks: Sequence[Chunk], comm: CommBackend, placement: PlacementPolicy, *, agree: bool) -> None:
        self.chunks = chunks
        self.comm = comm
        self.placement = placement
        self.agree = agree and comm.world_size > 1
        # Position of the last agreed all-gather in this pass (laps * len(chunks) + position), identical on all ranks.
        self._cursor = -1
        self._reverse = False

    def begin_pass(self, *, reverse: bool) -> None:
        self._cursor = -1
        self._reverse = reverse

    def _position(self, index: int) -> int:
        return len(self.chunks) - 1 - index if self._reverse else index

    def _proposal(self, chunk: Chunk) -> int:
        n = len(self.chunks)
        lap, last = divmod(self._cursor, n) if self._cursor >= 0 else (0, -1)
        position = self._position(chunk.index)
        return (lap if position > last else lap + 1) * n + position

    def _chunk_at(self, agreed: int) -> Chunk:
        return self.chunks[self._position(agreed % len(self.chunks))]

    def gather(self, chunks: Sequence[Chunk]) -> None:
        """Gather ``chunks`` (those not gathered yet), serving other ranks' needs in between."""
        todo = sorted((c for c in chunks if not c.is_gathered), key=lambda c: self._position(c.index))
        if not todo:
            return
        self.placement.before_gather(todo)
        for chunk in todo:
            if not self.agree:
                chunk.gather(self.comm)
                continue
            proposal = self._proposal(chunk)
            while True:
                agreed = self.comm.agree_min(proposal)
                self._cursor = agreed
                if agreed == proposal:
                    chunk.gather(self.comm)
                    break
                self._serve(self._chunk_at(agreed))

    def drain(self) -> None:
        """This rank's pass is over: keep serving other ranks until none needs anything."""
        if not self.agree:
            return
        while (agreed := self.comm.agree_min(_NOTHING)) != _NOTHING:
            self._cursor = agreed
            self._serve(self._chunk_at(agreed))

    def _serve(self, chunk: Chunk) -> None:
        self.placement.before_gather([chunk])
        chunk.gather_for_peers(self.comm)
