"""ZeroConfig and ChunkPolicy reject bad values at construction, naming the field and the fix."""

import pytest

from zero_core import ChunkPolicy, ConfigError, ZeroConfig


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"strategy": ""}, "ZeroConfig.strategy"),
        ({"comm": 3}, "ZeroConfig.comm"),
        ({"placement": None}, "ZeroConfig.placement"),
        ({"device": "tpu"}, "ZeroConfig.device"),
        ({"collective_timeout_s": 0}, "collective_timeout_s"),
        ({"collective_timeout_s": True}, "collective_timeout_s"),
        ({"sync_module_states": "yes"}, "sync_module_states"),
        ({"static_graph": 1}, "static_graph"),
        ({"chunk": {"chunk_size": 5}}, "ChunkPolicy"),
    ],
)
def test_zero_config_rejects(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ZeroConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": -4}, "chunk_size"),
        ({"chunk_size": 2.5}, "chunk_size"),
        ({"min_chunk_size": 0}, "min_chunk_size"),
        ({"search_interval": False}, "search_interval"),
        ({"search_range": -1}, "search_range"),
        ({"param_order": "random"}, "param_order"),
    ],
)
def test_chunk_policy_rejects(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ChunkPolicy(**kwargs)


def test_configs_are_frozen_and_keyword_only():
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=64))
    with pytest.raises(AttributeError):
        config.strategy = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        ZeroConfig("chunk")  # type: ignore[misc]
    assert config.replace(static_graph=True).static_graph is True
    with pytest.raises(ConfigError):
        config.replace(collective_timeout_s=-1)
