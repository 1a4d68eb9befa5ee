"""zero-strategy-chunk owns the ``zero_plan_chunks`` hook: its plugin adds the spec, its strategy calls it."""

import torch
from torch import nn

import zero_strategy_chunk.hookspecs
import zero_strategy_chunk.plugin
from zero_core import ChunkPolicy, ZeroConfig
from zero_core.plugin import ChunkSpec, ParamInfo, ZeroPlugins, hookimpl
from zero_strategy_chunk import ChunkStrategy, pack_chunks

CONFIG = ZeroConfig(chunk=ChunkPolicy(chunk_size=64))


def _params():
    return [ParamInfo(f"p{i}", nn.Parameter(torch.zeros(n)), 0) for i, n in enumerate([30, 30, 7])]


class OneChunkPerParameter:
    @hookimpl
    def zero_plan_chunks(self, params, world_size, config):
        return [ChunkSpec((p,), -(-p.numel // world_size) * world_size) for p in params]


def test_the_spec_comes_from_this_distribution():
    spec = ZeroPlugins.load().manager.hook.zero_plan_chunks.spec
    assert spec.namespace is zero_strategy_chunk.hookspecs and spec.opts["firstresult"]


def test_a_plugin_passed_in_overrides_the_packing(monkeypatch):
    monkeypatch.setenv("ZERO_DISABLE_PLUGIN_AUTOLOAD", "1")
    hook = ZeroPlugins.load([zero_strategy_chunk.plugin, OneChunkPerParameter()]).manager.hook
    plan = ChunkStrategy().plan(_params(), world_size=2, config=CONFIG, hook=hook)
    assert [len(spec.params) for spec in plan.chunks] == [1, 1, 1]


def test_without_the_plugin_the_strategy_packs_itself(monkeypatch):
    monkeypatch.setenv("ZERO_BLOCKED_PLUGINS", "strategy-chunk")
    hook = ZeroPlugins.load().manager.hook
    assert not hasattr(hook, "zero_plan_chunks")  # core does not specify it
    params = _params()
    plan = ChunkStrategy().plan(params, world_size=2, config=CONFIG, hook=hook)
    assert list(plan.chunks) == pack_chunks(params, world_size=2, config=CONFIG)
