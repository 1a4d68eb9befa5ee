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
    """

    chunks: tuple[ChunkSpec, ...]

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


class ShardStrategy(ABC):
    """Decides how parameters are laid out in evenly sharded chunks.

    Attributes:
        name: The name users select it by (``ZeroConfig(strategy=name)``).
    """

    name: ClassVar[str]

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
