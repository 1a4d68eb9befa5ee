"""Keeping every rank's all-gathers in one order when ranks run different modules.

[Note: agreeing on all-gathers]
Collectives on a process group match by order, so every rank must all-gather the same
chunks in the same sequence. (What one all-gather gathers is a gather group, see [Note: gather
groups]; below, "chunk" stands for the group that holds it.) A model whose control flow depends on the data (experts
chosen per sample, branches skipped on some ranks, outputs that reach the loss on
some ranks only) needs different chunks on different ranks. The scheduler merges the
ranks' needs: each pass (a forward, or a backward) walks the chunks in plan order
(reverse order in backward); a rank that needs chunk ``k`` proposes the next position
of ``k`` on that walk, and one tagged agreement (the minimum, see [Note: lockstep rounds]) picks the earliest proposal of
any rank. Every rank then joins the all-gather of that chunk; ranks that did not ask
for it gather into a scratch buffer and drop it. When a rank's pass ends, it keeps
answering with "nothing" until every rank is done. Needing a chunk again later in the
same pass (a tied weight, a module called twice) starts a new lap of the walk.

With ``ZeroConfig(static_graph=True)`` the user promises that every rank runs the
same modules in the same order, and the agreement rounds are skipped.

[Note: replaying a repeated gather sequence]
Most models never need the rounds: every rank gathers the same chunks in the same
order in every pass. The scheduler finds that out itself. The sequence of all-gathers a
pass issued (the agreed ones, the served ones and the prefetches, in order) is the same
on every rank, by construction; when two passes in a row of the same direction issued
the same sequence, every rank knows it at the same moment, and the next pass of that
direction *replays* it: each rank issues the recorded all-gathers in the recorded order,
with no agreement round, one ahead of its need (a prefetch), serving the ones it did not
use last time. Its own needs only choose how far along the sequence it is; the
collectives are the recording's on every rank, so they pair. The pass then ends with
the one round of the drain that every pass has, which verifies it: a rank that needed a
chunk the rest of the recording does not hold (the model took another branch) issues
the rest of the recording, then proposes that chunk in the ordinary way, and its peers,
already in their drain, serve it. Such a pass's sequence differs from the recording, so
every rank leaves replay together and agrees again until a sequence repeats. A pass
that never reached its drain (it raised) clears the recordings. So one control round
per pass replaces one per all-gather, without the user promising a static graph.

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

from collections.abc import Callable, Sequence

from zero_core.base._state import ChunkState
from zero_core.chunks._collectives import gather_group
from zero_core.chunks._group import GatherGroup
from zero_core.chunks.chunk import Chunk
from zero_core.comm.backend import CommBackend
from zero_core.interfaces.placement import PlacementPolicy

__all__ = ["GatherScheduler"]

_NOTHING = (1 << 32) - 1  # the largest value an agreement carries: "this rank needs nothing"


class GatherScheduler:
    """Gathers groups of chunks so that every rank issues the same all-gathers in the same order."""

    def __init__(self, groups: Sequence[GatherGroup], comm: CommBackend, placement: PlacementPolicy, *,
                 agree: Callable[[int], int] | None) -> None:
        self.groups = groups
        self.comm = comm
        self.placement = placement
        # The smallest proposal over ranks, as a tagged message (see [Note: lockstep rounds]); None: no agreement.
        self._agree_min = agree if comm.world_size > 1 else None
        self.agree = self._agree_min is not None
        self._group_of: dict[int, GatherGroup] = {c.index: g for g in groups for c in g.chunks}
        # Position of the last agreed all-gather in this pass (laps * len(groups) + position), identical on all ranks.
        self._cursor = -1
        self._reverse = False
        # Groups the agreed sequence gathered in this pass: never prefetched again in it.
        self._seen: set[int] = set()
        # See [Note: replaying a repeated gather sequence]. This pass's all-gathers: (group, how, cursor after).
        self._record: list[tuple[int, str, int]] = []
        # By direction (reverse): the last completed pass's record and how many passes in a row issued its sequence.
        self._history: dict[bool, tuple[list[tuple[int, str, int]], int]] = {}
        self._replay: list[tuple[int, str, int]] | None = None
        self._next = 0  # the next entry of the replay to issue
        self._open = False  # a pass began and has not drained
        self.replayed_passes = 0  # passes that started as replays (for tests and the bench)

    @property
    def open(self) -> bool:
        """A pass began with agreements or a replay and has not drained: peers may still pair with its all-gathers."""
        return self._open and self.agree

    def begin_pass(self, *, reverse: bool) -> None:
        if self._open:  # the last pass raised before its drain: its record is partial and ranks may differ
            self._history = {}
        self._cursor = -1
        self._reverse = reverse
        self._seen = set()
        self._record = []
        self._next = 0
        self._open = True
        history = self._history.get(reverse)
        self._replay = history[0] if self.agree and history is not None and history[1] >= 2 else None
        if self._replay is not None:
            self.replayed_passes += 1

    def _issue(self, group: GatherGroup, how: str) -> None:
        """Issue one all-gather of the pass and record it: ``own`` (this rank needs it now), ``serve`` (only peers
        do: dropped after), ``prefetch`` (asynchronous, kept). An ``own`` group's shards were brought in by
        :meth:`gather` already, with everything else that call needs."""
        if how != "own":
            self.placement.before_gather(group.chunks)
        if how == "serve":
            gather_group(group, self.comm, keep=False)
            # the shards were read for the peers only: a policy may put those of chunks not gathered here away again
            self.placement.after_release([c for c in group.chunks if not c.is_gathered])
        else:
            gather_group(group, self.comm, async_op=how == "prefetch")
        self._seen.add(group.index)
        self._record.append((group.index, how, self._cursor))

    def _issue_next(self, *, serve: bool = False) -> None:
        """Issue the replay's next entry this rank does not need yet: as a prefetch (kept), or served (dropped) when
        it was served last time, prefetching is off, or ``serve``."""
        assert self._replay is not None
        index, how, cursor = self._replay[self._next]
        self._next += 1
        self._cursor = cursor
        drop = serve or how == "serve" or not self.placement.allow_prefetch
        self._issue(self.groups[index], "serve" if drop else "prefetch")

    def _replay_rest(self) -> None:
        """Issue the rest of the replay, served, and leave replay for this pass."""
        while self._replay is not None and self._next < len(self._replay):
            self._issue_next(serve=True)
        self._replay = None

    def _gather_replayed(self, todo: Sequence[GatherGroup]) -> bool:
        """Replay until every group of ``todo`` is gathered; False if one is not in the rest of the replay."""
        assert self._replay is not None
        for group in todo:
            while not group.is_gathered:
                ahead = [e[0] for e in self._replay[self._next :]]
                if group.index not in ahead:
                    return False
                if ahead[0] == group.index:
                    index, _, cursor = self._replay[self._next]
                    self._next += 1
                    self._cursor = cursor
                    self._issue(group, "own")
                else:
                    self._issue_next()
        return True

    def _prefetch_replayed(self) -> None:
        """One all-gather ahead of the need: issue the replay's next entry, unless it is one to serve."""
        if (self._replay is not None and self.placement.allow_prefetch and self._next < len(self._replay)
                and self._replay[self._next][1] != "serve"):
            self._issue_next()

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
        if self._replay is not None and not self._gather_replayed(todo):
            self._replay_rest()  # the model took another path: finish the recording, then agree as usual
        for group in todo:
            if group.is_gathered:  # prefetched by an earlier round of this loop, or replayed
                continue
            if not self.agree:
                gather_group(group, self.comm)
                self._seen.add(group.index)
                self._cursor = self._position(group.index)
                self._prefetch_next()
                continue
            while not group.is_gathered:  # serving another rank may prefetch this very group
                proposal = self._proposal(group)
                agreed = self._agreed_min(proposal)
                self._cursor = agreed
                if agreed == proposal:
                    self._issue(group, "own")
                    self._prefetch_next()
                else:
                    self._serve(self._group_at(agreed))
        # a replay keeps one all-gather in flight: chained when this call gathered or consumed one
        consumed = any(chunk.state is ChunkState.GATHERING for chunk in chunks)
        for chunk in chunks:
            if chunk.state is ChunkState.GATHERING:
                chunk.wait()
                # Consuming a prefetch is rank-local, so only a static graph may chain the next one from here.
                if not self.agree and self._cursor == self._position(self._group_of[chunk.index].index):
                    self._prefetch_next()
        if todo or consumed:
            self._prefetch_replayed()

    def _agreed_min(self, proposal: int) -> int:
        """The smallest proposal over ranks; called only where ``self.agree``."""
        assert self._agree_min is not None
        return self._agree_min(proposal)

    def drain(self) -> None:
        """This rank's pass is over: keep serving other ranks until none needs anything."""
        if not self.agree:
            return
        self._replay_rest()
        while (agreed := self._agreed_min(_NOTHING)) != _NOTHING:
            self._cursor = agreed
            self._serve(self._group_at(agreed))
        self._open = False
        # See [Note: replaying a repeated gather sequence]: the sequence is the same on every rank, so is this
        sequence = [e[0] for e in self._record]
        last = self._history.get(self._reverse)
        repeats = last[1] + 1 if last is not None and [e[0] for e in last[0]] == sequence else 1
        self._history[self._reverse] = (self._record, repeats)

    def _serve(self, group: GatherGroup) -> None:
        self._issue(group, "serve")
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
        self._issue(group, "prefetch")  # members this rank holds already only take part
