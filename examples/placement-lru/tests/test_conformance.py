"""The zero conformance kit run against the ``lru`` policy, plus its option validation."""

from __future__ import annotations

import pytest

from zero_core import ConfigError, ZeroConfig
from zero_core.plugin import ZeroPlugins
from zero_core.testing import PlacementPolicyConformance
from zero_placement_lru import LruConfig, LruPolicy


class TestLru(PlacementPolicyConformance):
    policy_class = LruPolicy
    options = {"device_chunks": 2}


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_device_chunks_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"device_chunks must be a positive int.*write placement_options"):
        LruConfig(device_chunks=bad)  # type: ignore[arg-type]
    config = ZeroConfig(placement="lru", placement_options={"device_chunks": bad})
    with pytest.raises(ConfigError, match="device_chunks"):
        LruPolicy.from_config(config)
    assert LruPolicy.from_config(ZeroConfig(placement="lru", placement_options={"device_chunks": 3})).options.device_chunks == 3


def test_entry_point_registers_the_policy() -> None:
    """The installed distribution's ``zero`` entry point makes ``placement="lru"`` resolve to LruPolicy."""
    assert ZeroPlugins.load().placement_policies.get("lru") is LruPolicy
