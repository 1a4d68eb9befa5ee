"""Train a zoo model sharded on N ranks or in one process, and compare the two runs.

:func:`train_sharded` runs on every rank (inside :func:`~zero_core.testing.run_distributed`);
each rank takes its slice of the same global batch. :func:`train_reference` trains the
same model in one process on the whole global batch. With a mean loss, the mean over
ranks of the ranks' gradients equals the whole batch's gradient, so the two runs must
agree up to floating-point reassociation: :func:`assert_parity` checks losses and
final parameters.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zero_core._clip import clip_grad_norm_
from zero_core._shard import shard
from zero_core.api import ChunkPolicy, ZeroConfig
from zero_core.testing.zoo import ZooCase, get_case

__all__ = ["RunResult", "assert_parity", "make_optimizer", "train_reference", "train_sharded"]

SEED = 1234


@dataclass
class RunResult:
    """What a training run produced (per rank for sharded runs)."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    step_stats: list[dict[str, dict[str, int]]] = field(default_factory=list)
    model_state_bytes: dict[str, int] = field(default_factory=dict)
    chunks: list[dict[str, Any]] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)


def make_optimizer(case: ZooCase, model: torch.nn.Module, name: str = "adamw", lr: float = 1e-3) -> torch.optim.Optimizer:
    groups: Any = case.param_groups(model) if case.param_groups else [p for p in model.parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}; use adamw, adam or sgd")


def _build(case: ZooCase) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return case.build()


def train_reference(case_name: str, *, steps: int = 4, batch_size: int = 8, optimizer: str = "adamw",
                    lr: float = 1e-3, clip: float | None = None, norm_type: float = 2.0) -> RunResult:
    """One process, whole global batch, plain PyTorch (``torch.nn.utils.clip_grad_norm_`` when clipping)."""
    case = get_case(case_name)
    model = _build(case)
    opt = make_optimizer(case, model, optimizer, lr)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        inputs, targets = case.batch(step, batch_size)
        loss = case.loss(model(inputs), targets)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type).item())
        opt.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return RunResult(losses, params, norms=norms)


def train_sharded(case_name: str, *, config: ZeroConfig | None = None, steps: int = 4, batch_size: int = 8,
                  optimizer: str = "adamw", lr: float = 1e-3, micro_batches: int = 1, clip: float | None = None,
                  norm_type: float = 2.0) -> RunResult:
    """Run on every rank: shard the zoo model, train on this rank's slice of each global batch.

    With ``micro_batches > 1`` the slice is split and all but the last micro-batch run
    inside ``model.no_sync()``, each loss scaled so the sum equals the slice's mean loss.
    With ``clip`` the gradients are clipped by :func:`zero_core.clip_grad_norm_`.
    """
    case = get_case(case_name)
    config = config or ZeroConfig(chunk=ChunkPolicy(chunk_size=case.chunk_size))
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if batch_size % world:
        raise ValueError(f"global batch {batch_size} must divide evenly over {world} ranks")
    local = batch_size // world
    model = _build(case)
    example = case.batch(0, batch_size)[0][:local] if config.chunk.param_order == "first_use" else None
    model, opt = shard(model, make_optimizer(case, model, optimizer, lr), config=config, example_inputs=example)
    if local % micro_batches:
        raise ValueError(f"{local} samples per rank do not split into {micro_batches} micro-batches")
    micro = local // micro_batches
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        inputs, targets = case.batch(step, batch_size)
        inputs, targets = inputs[rank * local:(rank + 1) * local], targets[rank * local:(rank + 1) * local]
        loss = torch.zeros(())
        for m in range(micro_batches):
            part = slice(m * micro, (m + 1) * micro)
            context = model.no_sync() if m < micro_batches - 1 else contextlib.nullcontext()
            with context:
                micro_loss = case.loss(model(inputs[part]), targets[part]) / micro_batches
                micro_loss.backward()
            loss += micro_loss.detach()
        if clip is not None:
            norms.append(clip_grad_norm_(model, clip, norm_type))
        opt.step()
        reported = loss.detach().clone()
        if world > 1:  # reporting only: not part of the engine's counted traffic
            dist.all_reduce(reported)
            reported /= world
        losses.append(reported.item())
    engine = model.engine
    return RunResult(
        losses=losses,
        params=model.full_parameters(),
        step_stats=[engine.comm.stats.summary(s) for s in engine.comm.stats.steps],
        model_state_bytes=engine.model_state_bytes(),
        chunks=[{"size": c.size, "used": c.used, "requires_grad": c.requires_grad, "params": len(c.slots)}
                for c in engine.chunks],
        norms=norms,
    )


def assert_parity(reference: RunResult, sharded: RunResult, *, rtol: float = 1e-5) -> None:
    """Losses and parameters agree within ``rtol``, relative to each tensor's largest magnitude.

    A tolerance relative to the tensor's scale rather than to each element: elements near
    zero (fresh biases, padding-adjacent values) would otherwise demand exact equality
    from sums computed in a different order.
    """
    assert len(reference.losses) == len(sharded.losses), (reference.losses, sharded.losses)
    for step, (a, b) in enumerate(zip(reference.losses, sharded.losses)):
        assert abs(a - b) <= rtol * max(abs(a), 1e-12), f"step {step}: loss {b!r} vs reference {a!r}"
    assert reference.params.keys() == sharded.params.keys(), (
        sorted(set(reference.params) ^ set(sharded.params)))
    for name, ref in reference.params.items():
        got = sharded.params[name]
        assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
        scale = ref.abs().max().item()
        err = (got - ref).abs().max().item()
        assert err <= rtol * max(scale, 1e-12), f"{name}: max error {err:.3g} exceeds {rtol} x {scale:.3g}"
    assert len(reference.norms) == len(sharded.norms), (reference.norms, sharded.norms)
    for step, (a, b) in enumerate(zip(reference.norms, sharded.norms)):
        assert abs(a - b) <= rtol * max(abs(a), 1e-12), f"step {step}: gradient norm {b!r} vs reference {a!r}"
