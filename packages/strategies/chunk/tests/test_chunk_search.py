"""Chunk-size search and packing."""

import pytest
import torch
from torch import nn

from zero_core import ChunkPolicy, ZeroConfig
from zero_core.plugin import ParamInfo
from zero_core.testing import ShardStrategyConformance
from zero_strategy_chunk import ChunkStrategy, pack_chunks, search_chunk_size


class TestChunkStrategy(ShardStrategyConformance):
    strategy_class = ChunkStrategy


class TestChunkStrategySearched(ShardStrategyConformance):
    strategy_class = ChunkStrategy
    config = ZeroConfig(chunk=ChunkPolicy(min_chunk_size=64, search_interval=8, search_range=512))


def brute_force(sizes, world, candidates):
    def waste(cap):
        used, total = 0, 0
        for s in sizes:
            if used + s > cap:
                total += cap - used
                used = 0
            used += s
        return total + (-used) % world

    return min(candidates, key=lambda c: (waste(c), c))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_search_finds_the_least_waste(world):
    sizes = [100, 37, 250, 64, 64, 129, 33, 250, 90, 17, 200]
    result = search_chunk_size(sizes, world_size=world, min_chunk_size=200, interval=10, search_range=300)
    candidates = [-(-c // world) * world for c in range(250, 551, 10)]
    assert result.chunk_size == brute_force(sizes, world, candidates)
    assert result.chunk_size % world == 0
    assert result.candidates == len(candidates)


def test_small_model_becomes_one_chunk():
    result = search_chunk_size([10, 20, 7], world_size=4, min_chunk_size=1000, interval=8, search_range=64)
    assert result.chunk_size == 40 and result.waste == 3


def test_outliers_get_their_own_chunk():
    sizes = [10] * 30 + [10_000]
    infos = [ParamInfo(f"p{i}", nn.Parameter(torch.zeros(s)), 0) for i, s in enumerate(sizes)]
    specs = pack_chunks(infos, world_size=2, config=ZeroConfig(chunk=ChunkPolicy(min_chunk_size=40, search_interval=10, search_range=100)))
    big = [s for s in specs if any(p.numel == 10_000 for p in s.params)]
    assert len(big) == 1 and len(big[0].params) == 1 and big[0].size == 10_000


def test_packing_keeps_keys_apart_and_trims_the_last_chunk():
    params = [nn.Parameter(torch.zeros(30)), nn.Parameter(torch.zeros(30), requires_grad=False),
              nn.Parameter(torch.zeros(30)), nn.Parameter(torch.zeros(30)), nn.Parameter(torch.zeros(7))]
    infos = [ParamInfo(f"p{i}", p, 0 if p.requires_grad else None) for i, p in enumerate(params)]
    specs = pack_chunks(infos, world_size=4, config=ZeroConfig(chunk=ChunkPolicy(chunk_size=64)))
    assert [[p.name for p in s.params] for s in specs] == [["p0", "p2"], ["p1"], ["p3", "p4"]]
    assert [s.size for s in specs] == [64, 32, 40]  # full size, then trimmed to content rounded to 4
