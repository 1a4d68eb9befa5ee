"""The step loop of the small optimizer tests: each rank's slice of one seeded global batch, the mean loss over ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, *, features: int, world: int, rank: int) -> float:
    """One step on this rank's slice of step ``step``'s batch of 8 (3 classes); the batch's mean loss."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, features, generator=g), torch.randint(0, 3, (8,), generator=g)
    n = 8 // world
    return step_on(F.cross_entropy(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]), opt, world=world)


def step_on(loss: torch.Tensor, opt: torch.optim.Optimizer, *, world: int) -> float:
    """Backward, step and zero the gradients for this rank's ``loss``; the mean of the ranks' losses."""
    loss.backward()
    opt.step()
    opt.zero_grad()
    value = loss.detach().clone()
    if world > 1:
        dist.all_reduce(value)
    return value.item() / world


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a sharded one gathered), as a detached copy."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}
