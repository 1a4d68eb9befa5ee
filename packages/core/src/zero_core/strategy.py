"""The shard strategy interface.

A shard strategy decides the layout: which parameters share a chunk, in what order,
and how large each chunk is. The engine in zero-core runs every layout the same way
(gather before use, release after, reduce-scatter gradients, update shards), so a
strategy is small and its correctness follows from the plan it returns.

Subclass :class:`zero_core.testing.ShardStrategyConformance` to test a strategy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from zero_core.chunk import ChunkSpec, ParamInfo

if TYPE_CHECKING:
    import pluggy

    from zero_core.api import ZeroConfig

__all__ = ["ShardPlan", "ShardStrategy", "round_up"]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """An ordered list of chunks covering every parameter exactly once.

    The order is the order chunks are expected to be first used in forward; the engine
    reduces gradients in the reverse order, the same on every rank.

    Attributes:
        chunks: The chunks, in order.
        gather_groups: Runs of consecutive chunk indices whose all-gathers travel as one
            collective (see [Note: gather groups] in ``zero_core._group``); every chunk in
            exactly one run, one parameter dtype per run. ``None``: each chunk alone.
    """

    chunks: tuple[ChunkSpec, ...]
    gather_groups: tuple[tuple[int, ...], ...] | None = None

    @property
    def numel(self) -> int:
        return sum(c.used for c in self.chunks)

    @property
    def padded_numel(self) -> int:
        return sum(c.size for c in self.chunks)

    def validate(self, params: Sequence[ParamInfo], world_size: int) -> None:
        """Check the invariants the engine relies on; raise ``ValueError`` naming the first broken one."""
        seen: dict[int, int] = {}
        for i, spec in enumerate(self.chunks):
            if not spec.params:
                raise ValueError(f"chunk {i} of the plan holds no parameter")
            if spec.size % world_size:
                raise ValueError(f"chunk {i} has size {spec.size}, not a multiple of the world size {world_size}")
            if spec.used > spec.size:
                raise ValueError(f"chunk {i} holds {spec.used} elements but its size is {spec.size}")
            keys = {p.key for p in spec.params}
            if len(keys) > 1:
                raise ValueError(f"chunk {i} mixes parameters of different dtype, requires_grad or optimizer group: {keys}")
            for p in spec.params:
                if id(p.param) in seen:
                    raise ValueError(f"parameter {p.name} is in chunks {seen[id(p.param)]} and {i}")
                seen[id(p.param)] = i
        missing = [p.name for p in params if id(p.param) not in seen]
        if missing:
            raise ValueError(f"the plan leaves out parameters {missing[:5]}{'...' if len(missing) > 5 else ''}")
        if len(seen) != len(params):
            raise ValueError("the plan holds parameters that are not the model's")
        if self.gather_groups is not None:
            self._validate_groups()

    def _validate_groups(self) -> None:
        expected = 0
        for g, members in enumerate(self.gather_groups or ()):
            if not members or list(members) != list(range(expected, expected + len(members))):
                raise ValueError(
                    f"gather group {g} is {list(members)}, but groups must be non-empty runs of consecutive chunk "
                    f"indices covering every chunk in order; the next run must start at chunk {expected}"
                )
            dtypes = {self.chunks[k].params[0].param.dtype for k in members}
            if len(dtypes) > 1:
                raise ValueError(f"gather group {g} mixes parameter dtypes {sorted(map(str, dtypes))}; one all-gather carries one dtype")
            expected += len(members)
        if expected != len(self.chunks):
            raise ValueError(f"the gather groups cover chunks 0..{expected - 1} but the plan has {len(self.chunks)} chunks")


class ShardStrategy(ABC):
    """Decides how parameters are laid out in evenly sharded chunks.

    Attributes:
        name: The name users select it by (``ZeroConfig(strategy=name)``).
        comm: The comm backend used when ``ZeroConfig.comm`` is ``None``.
    """

    name: ClassVar[str]
    comm: ClassVar[str] = "torch"

    @abstractmethod
    def plan(
        self,
        params: Sequence[ParamInfo],
        *,
        world_size: int,
        config: ZeroConfig,
        hook: pluggy.HookRelay | None = None,
    ) -> ShardPlan:
        """Lay ``params`` (in the order they should be packed) out into chunks.

        ``hook`` is the engine's plugin hook relay, for strategies that let plugins
        override part of the plan (for example ``zero_plan_chunks``).
        """
