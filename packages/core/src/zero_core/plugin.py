"""The plugin-facing namespace of zero-core: everything a strategy, comm backend or placement policy may use.

Other distributions (zero-comm, zero-strategy-*, zero-offload, third-party plugins) import
from ``zero_core`` and from this module only, never from ``zero_core._*``: what is here is
the supported surface for plugin authors and changes only with a changelog entry.
"""

from __future__ import annotations

from zero_core._accounting import in_engine_work
from zero_core._ownership import in_policy_call, policy_call
from zero_core._plugins import ENTRY_POINT_GROUP, hookimpl
from zero_core._registry import Registry
from zero_core._state import ChunkState, MemoryTier, TrainingState
from zero_core.api import ZeroConfig
from zero_core.chunk import BufferPool, Chunk, ChunkSpec, ParamInfo, ParamSlot, Segment, rewrap, to_local
from zero_core.comm import CollectiveCount, CollectiveKind, CommBackend, CommStats, Pending, ring_bytes_sent
from zero_core.errors import CollectiveTimeoutError, ConfigError, ZeroError
from zero_core.hookspecs import hookspec
from zero_core.mesh import MeshSpec, Topology
from zero_core.placement import ChunkParts, PartTiers, PlacementContext, PlacementPolicy
from zero_core.strategy import ChunkPlan, Reduction, ShardPlan, ShardStrategy, reshard_for_mesh, round_up

__all__ = [
    "ENTRY_POINT_GROUP",
    "BufferPool",
    "Chunk",
    "ChunkParts",
    "ChunkPlan",
    "ChunkSpec",
    "ChunkState",
    "CollectiveCount",
    "CollectiveKind",
    "CollectiveTimeoutError",
    "CommBackend",
    "CommStats",
    "ConfigError",
    "MemoryTier",
    "MeshSpec",
    "ParamInfo",
    "ParamSlot",
    "PartTiers",
    "Pending",
    "PlacementContext",
    "PlacementPolicy",
    "Reduction",
    "Registry",
    "Segment",
    "ShardPlan",
    "ShardStrategy",
    "Topology",
    "TrainingState",
    "ZeroConfig",
    "ZeroError",
    "hookimpl",
    "hookspec",
    "in_engine_work",
    "in_policy_call",
    "policy_call",
    "reshard_for_mesh",
    "rewrap",
    "ring_bytes_sent",
    "round_up",
    "to_local",
]
