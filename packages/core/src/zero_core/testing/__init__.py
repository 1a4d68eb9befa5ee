"""Test helpers for zero and its plugins: a distributed harness, a model zoo, parity
helpers and conformance kits that plugin authors subclass."""

from zero_core.testing.conformance import (
    ChunkConformance,
    CommBackendConformance,
    PlacementPolicyConformance,
    ShardStrategyConformance,
)
from zero_core.testing.distributed import DistributedTestError, device_under_test, rank_device, run_distributed
from zero_core.testing.parity import (
    RunResult,
    assert_parity,
    make_optimizer,
    train_reference,
    train_sharded,
    train_zoo_sharded,
)
from zero_core.testing.values import full_value
from zero_core.testing.zoo import ZOO, ZooCase, get_case

__all__ = [
    "ZOO",
    "ChunkConformance",
    "CommBackendConformance",
    "PlacementPolicyConformance",
    "ShardStrategyConformance",
    "DistributedTestError",
    "RunResult",
    "ZooCase",
    "assert_parity",
    "device_under_test",
    "full_value",
    "get_case",
    "make_optimizer",
    "rank_device",
    "run_distributed",
    "train_reference",
    "train_sharded",
    "train_zoo_sharded",
]
