"""Keeping every rank's all-gathers in one order when ranks run different modules.

[Note: agreeing on all-gathers]
Collectives on a process group match by order, so every rank must all-gather the same
chunks in the same sequence. (The unit gathered is a gather group, see [Note: gather
groups]; below, "chunk" stands for the group that holds it.) A model whose control flow depends on the data (experts
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

[Note: prefetch]
After every all-gather of a pass, the scheduler starts an asynchronous all-gather of the
chunk at the next position of the walk, so it travels while the current chunk computes,
unless the walk already gathered that chunk in this pass.
The decision depends only on the walk's position, which is identical on every rank, so
every rank issues the same prefetches; a rank that already holds that chunk joins into
a scratch buffer. A prefetched chunk a rank never uses is released with the rest when
the pass ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from zero_core._group import GatherGroup
from zero_core._state import ChunkState
from zero_core.chunk import Chunk
from zero_core.comm import CommBackend
from zero_core.placement import PlacementPolicy

__all__ = ["GatherScheduler"]

_NOTHING = 1 << 62


class GatherScheduler:
    """Gathers groups of chunks so that every rank issues the same all-gathers in the same order."""

    def __init__(self, groups: Sequence[GatherGroup], comm: CommBackend, placement: PlacementPolicy, *, agree: bool) -> None:
        self.groups = groups
        self.comm = comm
        self.placement = placement
        self.agree = agree and comm.world_size > 1
        self._group_of: dict[int, GatherGroup] = {c.index: g for g in groups for c in g.chunks}
        # Position of the last agreed all-gather in this pass (laps * len(groups) + position), identical on all ranks.
        self._cursor = -1
        self._reverse = False
        # Groups the agreed sequence gathered in this pass: never prefetched again in it.
        self._seen: set[int] = set()

    def begin_pass(self, *, reverse: bool) -> None:
        self._cursor = -1
        self._reverse = reverse
        self._seen = set()

    def _position(self, index: int) -> int:
        return len(self.groups) - 1 - index if self._reverse else index

    def _proposal(self, group: GatherGroup) -> int:
        n = len(self.groups)
        lap, last = divmod(self._cursor, n) if self._cursor >= 0 else (0, -1)
        position = self._position(group.index)
        return (lap if position > last else lap + 1) * n + position

    def _group_at(self, agreed: int) -> GatherGroup:
        return self.groups[self._position(agreed % len(self.groups))]

    def gather(self, chunks: Sequence[Chunk]) -> None:
        """Gather ``chunks`` (those not gathered yet), serving other ranks' needs in between."""
        needed = {self._group_of[c.index] for c in chunks if not c.is_gathered}
        todo = sorted(needed, key=lambda g: self._position(g.index))
        if todo:
            self.placement.before_gather([c for g in todo for c in g.chunks])
        for group in todo:
            if group.is_gathered:  # prefetched by an earlier round of this loop
                continue
            if not self.agree:
                group.gather(self.comm)
                self._seen.add(group.index)
                self._cursor = self._position(group.index)
                self._prefetch_next()
                continue
            while not group.is_gathered:  # serving another rank may prefetch this very group
                proposal = self._proposal(group)
                agreed = self.comm.agree_min(proposal)
                self._cursor = agreed
                if agreed == proposal:
                    group.gather(self.comm)
                    self._seen.add(group.index)
                    self._prefetch_next()
                else:
                    self._serve(self._group_at(agreed))
        for chunk in chunks:
            if chunk.state is ChunkState.GATHERING:
                chunk.wait()
                # Consuming a prefetch is rank-local, so only a static graph may chain the next one from here.
                if not self.agree and self._cursor == self._position(self._group_of[chunk.index].index):
                    self._prefetch_next()

    def drain(self) -> None:
        """This rank's pass is over: keep serving other ranks until none needs anything."""
        if not self.agree:
            return
        while (agreed := self.comm.agree_min(_NOTHING)) != _NOTHING:
            self._cursor = agreed
            self._serve(self._group_at(agreed))

    def _serve(self, group: GatherGroup) -> None:
        self.placement.before_gather(group.chunks)
        group.gather(self.comm, keep=False)
        # the shards were read for the peers only: a policy may put those of chunks not gathered here away again
        self.placement.after_release([c for c in group.chunks if not c.is_gathered])
        self._seen.add(group.index)
        self._prefetch_next()

    def _prefetch_next(self) -> None:
        """See [Note: prefetch]. Identical on every rank because the cursor is."""
        n = len(self.groups)
        if not self.placement.allow_prefetch:
            return
        if self._cursor < 0 or (self._cursor + 1) % n == 0:
            return  # the walk's lap is over: nothing follows
        group = self._group_at(self._cursor + 1)
        if group.index in self._seen:
            return  # gathered earlier in this pass (a tied weight): every rank skips it alike
        if all(c.persistent for c in group.chunks):
            return  # kept gathered on every rank (decided alike at setup): nothing to fetch
        self._cursor += 1
        self._seen.add(group.index)
        self.placement.before_gather(group.chunks)
        group.gather(self.comm, async_op=True)  # members this rank holds already only take part
