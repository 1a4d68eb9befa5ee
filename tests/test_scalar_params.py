"""A zero-dimensional parameter (a learnable temperature, CLIP's ``logit_scale``) is replicated.

``torch.chunk`` cannot cut a scalar, so every rank holds it whole (a Replicate DTensor)
and receives the summed gradient; its Adam moments are per-element states that follow
it to the host. Trained against one process, with a gathered-parameters write between
steps, and with a forward inside that context refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from zero_core import ChunkPolicy, ZeroConfig, ZeroError, shard
from zero_core.testing import run_distributed


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 4)
        self.logit_scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.logit_scale.exp()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 5, generator=g), torch.randint(0, 4, (8,), generator=g)


def _train(model, opt, world: int, rank: int, steps: int = 3) -> list[float]:
    losses = []
    for step in range(steps):
        x, y = _data(step)
        per = 8 // world
        loss = F.cross_entropy(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _sharded(stage: int, placement: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = Scaled()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    model, opt = shard(model, opt, config=ZeroConfig(stage=stage, placement=placement, chunk=ChunkPolicy(chunk_size=16)))
    scale = model.logit_scale
    placements = scale.placements if isinstance(scale, DTensor) else None
    losses = _train(model, opt, world, rank)
    with model.gathered_parameters(writable=True):
        with torch.no_grad():
            model.logit_scale.fill_(0.25)
        try:
            model(torch.zeros(1, 5))
            refused = False
        except ZeroError:
            refused = True
    losses += _train(model, opt, world, rank)
    summed = [float(sum(t.item() for t in _gather(loss))) / world for loss in losses]
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    return {"placements": placements, "losses": summed, "params": full, "refused": refused,
            "moments": str(opt.state[scale]["exp_avg"].device)}


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _reference() -> dict:
    torch.manual_seed(0)
    model = Scaled()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = _train(model, opt, 1, 0)
    with torch.no_grad():
        model.logit_scale.fill_(0.25)
    losses += _train(model, opt, 1, 0)
    return {"losses": [float(loss) for loss in losses], "params": dict(model.named_parameters())}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage,placement", [(2, "device"), (3, "device"), (3, "host")])
def test_a_scalar_parameter_trains_like_one_process(world, stage, placement):
    reference = _reference()
    for result in run_distributed(_sharded, world, stage, placement):
        assert result["placements"] == (Replicate(),)
        assert result["refused"]
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        for name, value in reference["params"].items():
            assert torch.allclose(result["params"][name], value, atol=1e-5), name
        assert result["moments"] == "cpu"
