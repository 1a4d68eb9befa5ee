"""Which optimizers may step each rank's pieces (``ZeroConfig.optimizer_updates``), checked at ``shard()``.

Stepping each rank's pieces is exact for an optimizer whose update of an element reads only that
element's gradient and state, and silently wrong for one that reads whole matrices (Muon's
orthogonalisation changes the loss by 2e-2 after 5 steps on pieces). So ``shard()`` steps torch's
element-wise optimizers on pieces, the whole-matrix ones whole (``tests/test_whole_optimizers.py``),
refuses LBFGS, and asks for a declaration for any other class.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _small_loop import full_params, train_step
from torch import nn

from zero_core import ConfigError, ZeroConfig, shard
from zero_core.testing import RunResult, assert_parity, run_distributed


class Lion(torch.optim.Optimizer):
    """A third-party element-wise optimizer (Chen et al., 2023): the sign of an interpolated momentum."""

    def __init__(self, params, lr: float = 1e-2, betas: tuple[float, float] = (0.9, 0.99)) -> None:
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, bias=False), nn.Tanh(), nn.Linear(8, 3, bias=False))


@pytest.mark.parametrize(("make", "says"), [
    (lambda ps: torch.optim.Muon(ps, lr=0.02), "orthogonalises"),
    (lambda ps: torch.optim.Adafactor(ps, lr=0.01), "row and column"),
])
def test_whole_matrix_optimizers_cannot_be_declared_elementwise(make, says):
    model = _model()
    with pytest.raises(ConfigError, match=says):
        shard(model, make(model.parameters()), config=ZeroConfig(optimizer_updates="elementwise"))


@pytest.mark.parametrize("declared", ["auto", "elementwise", "whole"])
def test_an_optimizer_over_all_parameters_at_once_is_refused(declared):
    model = _model()
    with pytest.raises(ConfigError, match="whole parameter vector"):
        shard(model, torch.optim.LBFGS(model.parameters()), config=ZeroConfig(optimizer_updates=declared))


def test_an_unknown_optimizer_must_be_declared():
    model = _model()
    with pytest.raises(ConfigError, match="optimizer_updates='elementwise'.*optimizer_updates='whole'") as info:
        shard(model, Lion(model.parameters()), config=ZeroConfig())
    assert "Lion" in str(info.value)
    with pytest.raises(ConfigError, match="optimizer_updates must be one of"):
        ZeroConfig(optimizer_updates="matrix")


def _train_lion(sharded: bool, steps: int = 4) -> RunResult:
    world, rank = (dist.get_world_size(), dist.get_rank()) if sharded else (1, 0)
    model = _model()
    opt = Lion(model.parameters())
    if sharded:
        model, opt = shard(model, opt, config=ZeroConfig(stage=3, optimizer_updates="elementwise"))
    losses = [train_step(model, opt, step, features=6, world=world, rank=rank) for step in range(steps)]
    return RunResult(losses, full_params(model))


def test_a_declared_elementwise_optimizer_trains_as_in_one_process():
    reference = _train_lion(False)
    for rank, result in enumerate(run_distributed(_train_lion, 2, True, timeout=120)):
        assert_parity(reference, result, label=f"rank {rank}:")


def test_a_whole_matrix_optimizer_from_elsewhere_is_known_by_its_name():
    class LAMB(Lion):  # a third-party LAMB (trust ratios of whole-tensor norms), whatever its module
        pass

    model = _model()
    with pytest.raises(ConfigError, match="trust ratio"):
        shard(model, LAMB(model.parameters()), config=ZeroConfig(optimizer_updates="elementwise"))
