"""zero-core: interfaces, plugin system and runtime of the zero sharded data-parallel trainer.

The one verb is :func:`shard`; everything else configures, extends or inspects it.
"""

from zero_core._clip import clip_grad_norm_
from zero_core._deepspeed import DeepSpeedConversion, config_from_deepspeed, convert_deepspeed_config
from zero_core._engine import Engine
from zero_core._estimate import Estimate, estimate
from zero_core._lazy import lazy_init
from zero_core._module import ZeroModule
from zero_core._persist import load_checkpoint, save_checkpoint, save_full_state_dict
from zero_core._plugins import ENTRY_POINT_GROUP, ZeroPlugins, hookimpl
from zero_core._registry import Registry
from zero_core._scaler import LossScaler
from zero_core._shard import Sharded, shard
from zero_core._state import ChunkState, MemoryTier, TrainingState
from zero_core._version import __version__
from zero_core.api import ChunkPolicy, LossScale, Precision, ZeroConfig
from zero_core.chunk import Chunk, ChunkSpec, ParamInfo, ParamSlot
from zero_core.comm import CollectiveCount, CollectiveKind, CommBackend, CommStats, ring_bytes_sent
from zero_core.errors import (
    CheckpointError,
    CollectiveTimeoutError,
    ConfigError,
    DeepSpeedConfigWarning,
    GradientLostError,
    PluginNotFoundError,
    RanksDisagreeError,
    RanksOutOfStepError,
    ZeroError,
    ZeroSetupError,
)
from zero_core.placement import ChunkParts, DevicePlacementPolicy, HostPlacementPolicy, PlacementContext, PlacementPolicy
from zero_core.mesh import MeshSpec, Topology
from zero_core.strategy import ChunkPlan, Reduction, ShardPlan, ShardStrategy, round_up

__all__ = [
    "ENTRY_POINT_GROUP",
    "CheckpointError",
    "Chunk",
    "ChunkParts",
    "ChunkPlan",
    "ChunkPolicy",
    "ChunkSpec",
    "ChunkState",
    "CollectiveCount",
    "CollectiveKind",
    "CollectiveTimeoutError",
    "CommBackend",
    "CommStats",
    "ConfigError",
    "DeepSpeedConfigWarning",
    "DeepSpeedConversion",
    "DevicePlacementPolicy",
    "Engine",
    "Estimate",
    "GradientLostError",
    "HostPlacementPolicy",
    "LossScale",
    "LossScaler",
    "MemoryTier",
    "MeshSpec",
    "ParamInfo",
    "ParamSlot",
    "PlacementContext",
    "PlacementPolicy",
    "PluginNotFoundError",
    "Precision",
    "RanksDisagreeError",
    "RanksOutOfStepError",
    "Reduction",
    "Registry",
    "ShardPlan",
    "ShardStrategy",
    "Sharded",
    "Topology",
    "TrainingState",
    "ZeroConfig",
    "ZeroError",
    "ZeroModule",
    "ZeroPlugins",
    "ZeroSetupError",
    "__version__",
    "clip_grad_norm_",
    "config_from_deepspeed",
    "convert_deepspeed_config",
    "estimate",
    "hookimpl",
    "lazy_init",
    "load_checkpoint",
    "ring_bytes_sent",
    "round_up",
    "save_checkpoint",
    "save_full_state_dict",
    "shard",
]
