"""The tensor-wise plan: one padded chunk per parameter, one gather group per module."""

import pytest
import torch
from torch import nn

from zero_core import ZeroConfig, shard
from zero_core.plugin import ParamInfo, ShardPlan
from zero_core.testing import ShardStrategyConformance
from zero_strategy_tensor import TensorStrategy, module_groups


class TestTensorStrategy(ShardStrategyConformance):
    strategy_class = TensorStrategy


def infos(model):
    return [ParamInfo(n, p, 0) for n, p in model.named_parameters()]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        self.scale = nn.Parameter(torch.ones(3))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_parameter_is_its_own_padded_chunk(world):
    params = infos(Block())
    plan = TensorStrategy().plan(params, world_size=world, config=ZeroConfig(strategy="tensor"))
    plan.validate(params, world)
    assert [spec.params[0].name for spec in plan.chunks] == [p.name for p in params]
    assert [spec.size for spec in plan.chunks] == [-(-p.numel // world) * world for p in params]


def test_one_gather_group_per_module_in_registration_order():
    params = infos(Block())
    assert [p.name for p in params] == ["scale", "attn.weight", "attn.bias", "norm.weight", "norm.bias"]
    assert module_groups(params) == ((0,), (1, 2), (3, 4))


def test_a_module_with_two_dtypes_gets_two_groups():
    layer = nn.Linear(4, 4)
    layer.bias = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    assert module_groups(infos(layer)) == ((0,), (1,))


def test_plan_validation_rejects_groups_that_break_the_rules():
    params = infos(Block())
    plan = TensorStrategy().plan(params, world_size=2, config=ZeroConfig(strategy="tensor"))
    broken = {
        "must be non-empty runs of consecutive chunk indices": ((0,), (2, 1), (3, 4)),
        "cover chunks 0..2 but the plan has 5 chunks": ((0,), (1, 2)),
    }
    for message, groups in broken.items():
        with pytest.raises(ValueError, match=message):
            ShardPlan(plan.chunks, gather_groups=groups).validate(params, 2)
    layer = nn.Linear(4, 4)
    layer.bias = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    mixed = infos(layer)
    plan = TensorStrategy().plan(mixed, world_size=2, config=ZeroConfig(strategy="tensor"))
    with pytest.raises(ValueError, match="mixes parameter dtypes"):
        ShardPlan(plan.chunks, gather_groups=((0, 1),)).validate(mixed, 2)


@pytest.mark.parametrize(("comm", "expected"), [(None, "bucketed"), ("torch", "torch")])
def test_the_strategy_selects_the_bucketed_backend_unless_the_config_names_one(comm, expected):
    model = Block()
    model, _ = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=ZeroConfig(strategy="tensor", comm_backend=comm))
    assert (model.engine.comm.name, model.engine.reduce_comm.name) == (expected, expected)
    assert [[c.index for c in g.chunks] for g in model.engine.groups] == [[0], [1, 2], [3, 4]]
