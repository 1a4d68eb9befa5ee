"""What hearing of gradients costs the host: zero's way (a hook per parameter) and two ways of hearing once per
gather group, measured on the host-overhead section's ``mlp-48`` model at one rank, without zero.

Zero learns that a parameter's gradient arrived from a post-accumulate-grad hook per parameter (195 Python calls a
backward here), then copies each chunk's first gradient into its buffer and makes a view per parameter. FSDP2 and
SimpleFSDP hear once per unit instead. This module trains five models side by side, steps interleaved:

- ``plain``: ``ThinMLP`` as PyTorch trains it;
- ``hooks``: zero's signal alone. Each parameter has a post-accumulate-grad hook that counts its group's gradients
  (a dict lookup and a counter); the group's last gradient is its one signal per backward, where zero launches the
  group's reduction.
- ``buffers``: ``hooks`` plus zero's gradient buffers: a group's first gradient takes a zeroed flat buffer, copies
  itself into its view of it and points every other parameter's ``.grad`` at its view (autograd then accumulates
  in place); the views are the gradients the optimizer reads, as at one rank in zero. What zero adds on top of this
  row is its own bookkeeping (states, checks, the reduction's plumbing, the hand-over).
- ``views``: SimpleFSDP's way. Each gather group's parameters (the embedding, each block, the head, as the chunk
  search groups them) are views of one flat leaf, made in the group's forward pre-hook by an autograd function
  (where zero would all-gather; the identity at one rank) and one ``torch.split``. Autograd sums the group's
  gradients into one flat gradient (the split's backward is one ``cat``), and the function's backward is the one
  Python call per group and backward, where zero would reduce-scatter and hand the gradient over. The optimizer
  steps the flat leaves.
- ``inputs``: FSDP2's way. The parameters stay the model's own leaves (their gradients accumulate as in plain
  PyTorch); the group's forward pre-hook passes its inputs through an autograd function whose backward, which
  autograd runs after the group's parameters' gradients are accumulated, is the one Python call per group. A group
  whose inputs need no gradient (the embedding reads token ids) gets none: FSDP2 reaches it from the callback at
  the end of backward.

    python -m zero_bench.grad_groups [STEPS]

Prints the median process CPU time of each row's zero_grad, forward and backward per step (what the mechanism
changes; the optimizer step is left out, since ``views`` steps 50 flat tensors where the others, and zero, step
195), the ratio to plain's, each row's gradient signals per backward, and whether its losses agree with plain's
(to 1e-5: the flat optimizer sums in another order). A measurement of the mechanisms, not a trainer: no sharding,
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

__all__ = ["KINDS", "build", "run"]

VOCAB, WIDTH, LAYERS, BATCH, SEQ = 64, 32, 48, 4, 16
KINDS = ("plain", "hooks", "buffers", "views", "inputs")


class _Gathered(torch.autograd.Function):
    """``views``: the group's full flat parameters from its flat leaf; its backward is the group's one signal."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, group: _ViewGroup) -> torch.Tensor:
        ctx.group = group
        return flat.view_as(flat)  # zero: the all-gathered buffer

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.group.signals += 1  # zero: reduce-scatter this group's gradient and hand it over, once per backward
        return grad, None


class _ViewGroup:
    """``views``: one gather group's parameters as views of one flat leaf, registered before each forward."""

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


class _AfterBackward(torch.autograd.Function):
    """``inputs``: the identity on a group's inputs; its backward runs once the group's gradients are accumulated."""

    @staticmethod
    def forward(ctx: Any, group: _InputGroup, *inputs: torch.Tensor) -> Any:
        ctx.group = group
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.group.signals += 1  # zero: the group's gradients are all in: reduce-scatter and hand them over
        return (None, *grads)


class _InputGroup:
    """``inputs``: one gather group whose inputs carry its after-backward signal."""

    def __init__(self) -> None:
        self.signals = 0

    def before_forward(self, module: nn.Module, args: tuple[Any, ...]) -> Any:
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return None  # token ids: no signal here (FSDP2: the end-of-backward callback)
        out = _AfterBackward.apply(self, *args)
        return out if isinstance(out, tuple) else (out,)


class _HookGroup:
    """``hooks`` and ``buffers``: one gather group whose parameters each tell it when their gradient is accumulated."""

    def __init__(self, params: list[nn.Parameter], *, buffers: bool) -> None:
        self.params = params
        self.signals = 0
        self._arrived = 0
        # buffers: each parameter's (shape, strides, offset) in the group's flat buffer, and the running backward's
        self._geometry = []
        offset = 0
        for p in params:
            self._geometry.append((tuple(p.shape), p.stride(), offset))
            offset += p.numel()
        self._size = offset
        self._flat: torch.Tensor | None = None
        self._buffers = buffers

    def accumulated(self, index: int) -> None:
        if self._buffers and self._flat is None:
            self._take_in(index)
        self._arrived += 1
        if self._arrived == len(self.params):
            self._arrived = 0
            self._flat = None  # zero: reduce the buffer; at one rank its views stay the gradients
            self.signals += 1

    def _take_in(self, index: int) -> None:
        flat = self._flat = torch.zeros(self._size)
        for i, (p, (shape, stride, offset)) in enumerate(zip(self.params, self._geometry)):
            view = flat.as_strided(shape, stride, offset)
            if i == index:
                view.copy_(p.grad)
            p.grad = view


def build(kind: str) -> tuple[nn.Module, torch.optim.Optimizer, list[Any]]:
    """One of :data:`KINDS`: the model, its AdamW, and its groups (none for plain)."""
    torch.manual_seed(0)
    model = ThinMLP(vocab=VOCAB, width=WIDTH, layers=LAYERS)
    owners: list[nn.Module] = [model.embed, *model.blocks, model.head]
    if kind == "plain":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), []
    if kind in ("hooks", "buffers"):
        hooked = [_HookGroup([p for m in owner.modules() for p in m._parameters.values() if p is not None],
                             buffers=kind == "buffers") for owner in owners]
        for group in hooked:
            for i, p in enumerate(group.params):
                p.register_post_accumulate_grad_hook(lambda _, group=group, i=i: group.accumulated(i))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), hooked
    if kind == "views":
        views = [_ViewGroup(list(owner.modules())) for owner in owners]
        for group, owner in zip(views, owners):
            owner.register_forward_pre_hook(group.before_forward)
        return model, torch.optim.AdamW([g.flat for g in views], lr=1e-3), views
    inputs = [_InputGroup() for _ in owners]
    for group, owner in zip(inputs, owners):
        owner.register_forward_pre_hook(group.before_forward)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), inputs


def step(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> tuple[float, float]:
    """One training step: its loss, and the CPU seconds of its zero_grad, forward and backward."""
    begin = time.process_time()
    opt.zero_grad()
    loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    passes = time.process_time() - begin
    opt.step()
    return loss.item(), passes


def run(steps: int, warmup: int = 10) -> dict[str, Any]:
    """Every row trained ``steps`` steps, interleaved: the median CPU seconds of its zero_grad, forward and backward
    per step after ``warmup``, its losses, and its groups' gradient signals in all."""
    torch.set_num_threads(1)
    rows = {kind: build(kind) for kind in KINDS}
    generator = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {kind: [] for kind in rows}
    losses: dict[str, list[float]] = {kind: [] for kind in rows}
    for i in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        for kind, (model, opt, _) in rows.items():
            loss, passes = step(model, opt, tokens)
            losses[kind].append(loss)
            if i >= warmup:
                times[kind].append(passes)
    return {"seconds": {kind: statistics.median(t) if t else 0.0 for kind, t in times.items()},
            "losses": losses, "groups": {kind: len(groups) for kind, (_, _, groups) in rows.items()},
            "signals": {kind: sum(g.signals for g in groups) for kind, (_, _, groups) in rows.items()}}


def main() -> None:
    numbers = [a for a in sys.argv[1:] if a.isdigit()]
    steps = int(numbers[0]) if numbers else 60
    result = run(steps)
    plain = result["seconds"]["plain"]
    for kind, seconds in result["seconds"].items():
        agree = all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for a, b in zip(result["losses"]["plain"],
                                                                           result["losses"][kind]))
        print(f"{kind:7s} zero_grad+forward+backward cpu/step {seconds * 1e3:7.2f} ms  {seconds / plain:.2f}x plain  "
              f"signals/backward {result['signals'][kind] / steps:.0f}  losses agree with plain: {agree}")


if __name__ == "__main__":
    main()
