"""What gradients through one autograd function per gather group would cost the host: the floor of issue 47's
remaining design change, measured on the host-overhead section's ``mlp-48`` model at one rank, without zero.

Zero learns that a parameter's gradient arrived from a post-accumulate-grad hook per parameter (195 Python calls a
backward here), then copies each chunk's first gradient into its buffer and makes a view per parameter. FSDP2 and
SimpleFSDP hear once per unit instead. This module trains two models side by side, steps interleaved:

- ``plain``: ``ThinMLP`` as PyTorch trains it;
- ``per-group``: the same model whose parameters, per gather group (the embedding, each block, the head, as the
  chunk search groups them), are views of one flat leaf, made in the group's forward pre-hook by an autograd
  function (where zero would all-gather; the identity at one rank) followed by one ``torch.split``. Autograd then
  sums each group's gradients into one flat gradient (the split's backward is one ``cat``), and the function's
  backward is the one Python call per group and backward where zero would reduce-scatter and hand the gradient
  over. The optimizer steps the flat leaves.

    python -m zero_bench.grad_groups [STEPS]

Prints the median process CPU time per step of each and the ratio, and whether the losses agree (to 1e-5: the
flat optimizer's foreach sums in another order). It is a measurement of the mechanism, not a trainer: no sharding,
no DTensors, no zero.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zero_bench.mlp import ThinMLP

VOCAB, WIDTH, LAYERS, BATCH, SEQ = 64, 32, 48, 4, 16


class _Gathered(torch.autograd.Function):
    """The group's full flat parameters from its flat leaf; its backward is the group's one gradient signal."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, group: _Group) -> torch.Tensor:
        ctx.group = group
        return flat.view_as(flat)  # zero: the all-gathered buffer

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.group.signals += 1  # zero: reduce-scatter this group's gradient and hand it over, once per backward
        return grad, None


class _Group:
    """One gather group's parameters as views of one flat leaf, registered in its modules before each forward."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.entries = [(m, name, p.shape) for m in modules for name, p in m._parameters.items() if p is not None]
        self.sizes = [m._parameters[name].numel() for m, name, _ in self.entries]
        with torch.no_grad():
            self.flat = nn.Parameter(torch.cat([m._parameters[name].reshape(-1) for m, name, _ in self.entries]))
        self.signals = 0

    def before_forward(self, module: nn.Module, args: Any) -> None:
        full = _Gathered.apply(self.flat, self)
        for (m, name, shape), piece in zip(self.entries, torch.split(full, self.sizes)):
            m._parameters[name] = piece.view(shape)


def build(kind: str) -> tuple[nn.Module, torch.optim.Optimizer, list[_Group]]:
    """``plain`` or ``per-group``: the model, its AdamW, and its groups (none for plain)."""
    torch.manual_seed(0)
    model = ThinMLP(vocab=VOCAB, width=WIDTH, layers=LAYERS)
    if kind == "plain":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), []
    owners: list[nn.Module] = [model.embed, *model.blocks, model.head]
    groups = [_Group(list(owner.modules())) for owner in owners]
    for group, owner in zip(groups, owners):
        owner.register_forward_pre_hook(group.before_forward)
    return model, torch.optim.AdamW([g.flat for g in groups], lr=1e-3), groups


def step(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    opt.zero_grad()
    loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    return loss.item()


def run(steps: int, warmup: int = 10) -> dict[str, Any]:
    """Both rows trained ``steps`` steps, interleaved; their median CPU seconds per step after ``warmup``."""
    torch.set_num_threads(1)
    rows = {kind: build(kind) for kind in ("plain", "per-group")}
    generator = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {kind: [] for kind in rows}
    losses: dict[str, list[float]] = {kind: [] for kind in rows}
    for i in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        for kind, (model, opt, _) in rows.items():
            begin = time.process_time()
            losses[kind].append(step(model, opt, tokens))
            if i >= warmup:
                times[kind].append(time.process_time() - begin)
    groups = rows["per-group"][2]
    return {"seconds": {kind: statistics.median(t) if t else 0.0 for kind, t in times.items()},
            "losses": losses, "groups": len(groups), "signals": sum(g.signals for g in groups)}


def main() -> None:
    numbers = [a for a in sys.argv[1:] if a.isdigit()]
    steps = int(numbers[0]) if numbers else 60
    result = run(steps)
    plain = result["seconds"]["plain"]
    for kind, seconds in result["seconds"].items():
        print(f"{kind:10s} cpu/step {seconds * 1e3:7.2f} ms  {seconds / plain:.2f}x plain")
    agree = all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for a, b in zip(*result["losses"].values()))
    print(f"per-group  {result['groups']} groups, {result['signals'] / steps:.0f} gradient signals per backward; "
          f"losses agree with plain to 1e-5: {agree}")


if __name__ == "__main__":
    main()
