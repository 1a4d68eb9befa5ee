"""The plugin manager: core's own plugin, entry-point discovery, registries, blocking, in-process plugins, plugin-owned hookspecs."""

import importlib.metadata

import pytest

from zero_core import PluginNotFoundError, ZeroConfig, shard
from zero_core.interfaces import _default_plugins
from zero_core.plugin import ENTRY_POINT_GROUP, ChunkSpec, Registry, ZeroPlugins, hookimpl, hookspec
from zero_core.testing.zoo import get_case


def test_builtins_register_through_entry_points():
    plugins = ZeroPlugins.load()
    assert "chunk" in plugins.strategies
    assert "torch" in plugins.comm_backends
    assert "device" in plugins.placement_policies


def test_each_engine_gets_a_fresh_manager():
    assert ZeroPlugins.load().manager is not ZeroPlugins.load().manager


def test_unknown_name_lists_available_and_install_hint(monkeypatch):
    monkeypatch.setenv("ZERO_BLOCKED_PLUGINS", "zero-offload")  # as if it were not installed
    plugins = ZeroPlugins.load()
    with pytest.raises(PluginNotFoundError, match=r"no placement policy named 'gemini'.*available: device.*zero-offload"):
        plugins.placement_policies.get("gemini")
    with pytest.raises(PluginNotFoundError, match="available: chunk"):
        plugins.strategies.get("nope")


def test_registry_rejects_two_different_items_under_one_name():
    registry: Registry[type] = Registry("thing")
    registry.add("a", int)
    registry.add("a", int)  # the same item twice is harmless
    with pytest.raises(ValueError, match="two plugins register a thing named 'a'"):
        registry.add("a", str)
    assert registry.names() == ["a"] and len(registry) == 1


def test_blocked_plugins_are_not_loaded(monkeypatch):
    monkeypatch.setenv("ZERO_BLOCKED_PLUGINS", "strategy-chunk")
    assert "chunk" not in ZeroPlugins.load().strategies


def test_autoload_can_be_disabled_and_plugins_passed_in(monkeypatch):
    monkeypatch.setenv("ZERO_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert len(ZeroPlugins.load().strategies) == 0
    import zero_strategy_chunk.plugin

    assert "chunk" in ZeroPlugins.load([zero_strategy_chunk.plugin]).strategies


def test_core_policies_exist_without_autoload(monkeypatch):
    monkeypatch.setenv("ZERO_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert ZeroPlugins.load().placement_policies.names() == ["device", "host"]


def test_core_policies_exist_without_entry_point_metadata(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [])  # what pluggy reads entry points from
    plugins = ZeroPlugins.load()
    assert plugins.placement_policies.names() == ["device", "host"] and len(plugins.strategies) == 0


def test_core_entry_point_is_skipped_once_registered_directly():
    assert "zero-core" in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP).names
    manager = ZeroPlugins.load().manager  # would raise "already registered" had pluggy loaded the entry point too
    assert manager.get_plugin("zero-core") is _default_plugins
    assert [name for name, plugin in manager.list_name_plugin() if plugin is _default_plugins] == ["zero-core"]


@pytest.mark.parametrize("autoload", [True, False])
def test_blocking_zero_core_blocks_its_direct_registration(monkeypatch, autoload):
    monkeypatch.setenv("ZERO_BLOCKED_PLUGINS", "zero-core")
    if not autoload:
        monkeypatch.setenv("ZERO_DISABLE_PLUGIN_AUTOLOAD", "1")
    plugins = ZeroPlugins.load()
    assert "device" not in plugins.placement_policies and plugins.manager.get_plugin("zero-core") is None


class OwnHookspecs:
    """A plugin that specifies a hook of its own, the way zero-strategy-chunk adds ``zero_plan_chunks``."""

    @staticmethod
    @hookspec(firstresult=True)
    def my_plugin_pick(options):
        """Return one of ``options``."""

    @hookimpl
    def zero_add_hookspecs(self, plugin_manager):
        plugin_manager.add_hookspecs(OwnHookspecs)


class PicksLast:
    @hookimpl
    def my_plugin_pick(self, options):
        return options[-1]


def test_a_plugin_adds_its_own_hookspecs_for_other_plugins(monkeypatch):
    monkeypatch.setenv("ZERO_DISABLE_PLUGIN_AUTOLOAD", "1")
    hook = ZeroPlugins.load([PicksLast(), OwnHookspecs()]).manager.hook  # implemented before it is specified
    assert hook.my_plugin_pick(options=[1, 2, 3]) == 3


class OneChunkPerParameter:
    """A user plugin that overrides the chunk packing: every parameter alone."""

    calls = 0

    @hookimpl
    def zero_plan_chunks(self, params, world_size, config):
        OneChunkPerParameter.calls += 1
        return [ChunkSpec((p,), -(-p.numel // world_size) * world_size) for p in params]


def test_a_plugin_can_override_chunk_packing():
    case = get_case("odd_sizes")
    model = case.build()
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sharded, _ = shard(model, opt, config=ZeroConfig(), plugins=[OneChunkPerParameter()])
    assert OneChunkPerParameter.calls == 1
    assert len(sharded.engine.chunks) == len(list(model.parameters()))
