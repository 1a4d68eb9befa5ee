"""The placement policy interface and the default policy.

A placement policy decides, at every moment, in which :class:`~zero_core.MemoryTier`
each chunk's shard lives. The engine calls it at fixed points: once after the chunks
are built (:meth:`PlacementPolicy.attach`), before chunks are gathered for compute
(:meth:`PlacementPolicy.before_gather`), after they are released
(:meth:`PlacementPolicy.after_release`) and at each optimizer step boundary.

Subclass :class:`zero_core.testing.PlacementPolicyConformance` to test a policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from zero_core._state import MemoryTier
from zero_core.chunk import Chunk

__all__ = ["DevicePlacementPolicy", "HostPlacementPolicy", "PlacementPolicy"]


class PlacementPolicy(ABC):
    """Where chunk shards live, and when they move.

    Attributes:
        name: The name users select it by (``ZeroConfig(placement=name)``).
        needs_memory_trace: Whether the policy wants the engine to trace a warm-up step.
    """

    name: ClassVar[str]
    needs_memory_trace: ClassVar[bool] = False

    @abstractmethod
    def attach(self, chunks: Sequence[Chunk]) -> None:
        """Place every chunk's shard for the first time (called once, after packing)."""

    def before_gather(self, chunks: Sequence[Chunk]) -> None:
        """Make sure these chunks' shards can be gathered on the device (they are about to be)."""
        for chunk in chunks:
            assert chunk.tier is MemoryTier.DEVICE, f"{self.name} left chunk {chunk.index} on {chunk.tier.value}"

    def after_release(self, chunks: Sequence[Chunk]) -> None:
        """These chunks were just released; the policy may move their shards away."""

    def before_step(self, chunks: Sequence[Chunk]) -> None:
        """The optimizer is about to update the shards."""

    def after_step(self, chunks: Sequence[Chunk]) -> None:
        """The optimizer has updated the shards."""

    @abstractmethod
    def tier_of(self, chunk: Chunk) -> MemoryTier:
        """The tier this policy wants ``chunk``'s shard in between uses."""


class DevicePlacementPolicy(PlacementPolicy):
    """Keeps every shard, gradient and optimizer state on the compute device."""

    name = "device"

    def attach(self, chunks: Sequence[Chunk]) -> None:
        for chunk in chunks:
            chunk.tier = MemoryTier.DEVICE

    def tier_of(self, chunk: Chunk) -> MemoryTier:
        return MemoryTier.DEVICE


class HostPlacementPolicy(PlacementPolicy):
    """Keeps every master shard, its gradient and its optimizer state in host memory.

    The compute device holds only what a step needs at once: gathered parameters and
    the gradient buffers of the running backward. Gathers copy shards up (from pinned
    memory on CUDA), reduced gradients are moved down (not copied and kept twice), and
    the optimizer steps on the host. This is what ColossalAI's ``offload_config={"device": "cpu"}``
    did for tensor-wise ZeRO-3, for every strategy. On a machine without CUDA the host
    is the compute device, so the shards just live apart from the gathered buffers.
    """

    name = "host"

    def attach(self, chunks: Sequence[Chunk]) -> None:
        host = torch.device("cpu")
        for chunk in chunks:
            chunk.move_shard(host)
            chunk.tier = MemoryTier.HOST

    def before_gather(self, chunks: Sequence[Chunk]) -> None:
        """Nothing to move: a gather reads the host shard directly."""

    def tier_of(self, chunk: Chunk) -> MemoryTier:
        return MemoryTier.HOST
