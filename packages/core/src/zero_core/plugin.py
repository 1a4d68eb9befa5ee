"""The plugin-facing namespace of zero-core: everything a strategy, comm backend or placement policy may use.

Other distributions (zero-comm, zero-strategy-*, zero-offload, third-party plugins) import
from ``zero_core`` and from this module only, never from ``zero_core._*``: what is here is
the supported surface for plugin authors and changes only with a changelog entry.
"""

from __future__ import annotations

from zero_core.base._accounting import engine_work_context, in_engine_work
from zero_core.base._live_bytes import LiveBytes
from zero_core.base._log import get_logger
from zero_core.base._state import ChunkState, MemoryTier, TrainingState
from zero_core.base.errors import (
    CollectiveTimeoutError,
    CommError,
    ConfigError,
    OwnershipError,
    PlanError,
    PluginContractError,
    ZeroError,
)
from zero_core.chunks._chunk_grads import ChunkGradients
from zero_core.chunks._chunk_layout import ChunkLayout
from zero_core.chunks._ownership import in_policy_call, policy_call
from zero_core.chunks.chunk import BufferPool, Chunk, ChunkSpec, ParamInfo, ParamSlot, Segment, rewrap, to_local
from zero_core.comm.backend import CollectiveCount, CollectiveKind, CommBackend, CommStats, Pending, ring_bytes_sent
from zero_core.config.api import ZeroConfig
from zero_core.interfaces._plugins import ENTRY_POINT_GROUP, ZeroPlugins, hookimpl
from zero_core.interfaces._registry import Registry
from zero_core.interfaces._view import EngineView
from zero_core.interfaces.hookspecs import hookspec
from zero_core.interfaces.mesh import MeshSpec, Topology
from zero_core.interfaces.placement import (
    ChunkParts,
    DevicePlacementPolicy,
    HostPlacementPolicy,
    PartTiers,
    PlacementContext,
    PlacementPolicy,
    absent_shard,
    copy_shard,
    move_shard,
)
from zero_core.interfaces.strategy import ChunkPlan, Reduction, ShardPlan, ShardStrategy, reshard_for_mesh, round_up
from zero_core.runtime._scaler import LossScaler

__all__ = [
    "ENTRY_POINT_GROUP",
    "BufferPool",
    "Chunk",
    "ChunkGradients",
    "ChunkLayout",
    "ChunkParts",
    "ChunkPlan",
    "ChunkSpec",
    "ChunkState",
    "CollectiveCount",
    "CollectiveKind",
    "CollectiveTimeoutError",
    "CommBackend",
    "CommError",
    "CommStats",
    "ConfigError",
    "DevicePlacementPolicy",
    "EngineView",
    "HostPlacementPolicy",
    "LiveBytes",
    "LossScaler",
    "MemoryTier",
    "MeshSpec",
    "OwnershipError",
    "ParamInfo",
    "ParamSlot",
    "PartTiers",
    "Pending",
    "PlacementContext",
    "PlacementPolicy",
    "PlanError",
    "PluginContractError",
    "Reduction",
    "Registry",
    "Segment",
    "ShardPlan",
    "ShardStrategy",
    "Topology",
    "TrainingState",
    "ZeroConfig",
    "ZeroError",
    "ZeroPlugins",
    "absent_shard",
    "copy_shard",
    "hookimpl",
    "get_logger",
    "hookspec",
    "engine_work_context",
    "in_engine_work",
    "in_policy_call",
    "move_shard",
    "policy_call",
    "reshard_for_mesh",
    "rewrap",
    "ring_bytes_sent",
    "round_up",
    "to_local",
]
