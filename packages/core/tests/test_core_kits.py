"""zero-core's own parts pass the conformance kits it ships."""

from zero_core.plugin import DevicePlacementPolicy
from zero_core.testing import ChunkConformance, PlacementPolicyConformance


class TestChunk(ChunkConformance):
    pass


class TestDevicePlacement(PlacementPolicyConformance):
    policy_class = DevicePlacementPolicy
