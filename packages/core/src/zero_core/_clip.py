"""Gradient clipping by the global norm over every rank's gradient shards."""

from __future__ import annotations

import math
from typing import Any

import torch

from zero_core._module import ZeroModule
from zero_core.base._devices import by_device
from zero_core.base._state import TrainingState
from zero_core.base.errors import ConfigError, ZeroError
from zero_core.chunks._collectives import sum_over_ranks
from zero_core.chunks.chunk import to_local

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(model: ZeroModule, max_norm: float, norm_type: float = 2.0) -> float:
    """Scale the sharded gradients so their global norm is at most ``max_norm``; return that norm.

    The same contract as :func:`torch.nn.utils.clip_grad_norm_` over the whole model,
    computed from the shards: each element belongs to exactly one rank's segments, so
    one all-reduce (sum, or max for ``norm_type=inf``) yields the true global norm. The
    returned float is identical on every rank. Collective: call it on every rank, after
    ``loss.backward()`` and before ``optimizer.step()``.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ConfigError(f"clip_grad_norm_ needs a positive max_norm, got {max_norm!r}")
    norm_type = float(norm_type)
    if not (norm_type > 0 or math.isinf(norm_type)):
        raise ConfigError(f"clip_grad_norm_ needs a positive norm_type or inf, got {norm_type!r}")
    if not isinstance(model, ZeroModule):
        raise ZeroError(f"clip_grad_norm_ takes the model zero_core.shard returned, got {type(model).__name__}")
    engine = model.engine
    if engine.state is TrainingState.BACKWARD and torch._C._current_graph_task_id() != -1:
        raise ZeroError("clip_grad_norm_ was called during backward; call it after loss.backward() returns")
    engine.settle()  # a backward that raised earlier is undone first: it contributes nothing
    # its sum pairs by order on the engine's group: a rank that skipped the clip must meet a round, not the sum
    # (see [Note: lockstep rounds] in zero_core.comm._lockstep)
    engine.collective_round("zero_core.clip_grad_norm_")
    # each element of a Shard(0) gradient belongs to exactly one rank of its shard group, and counts in the first
    # replica only (HSDP's other replicas hold the same shard, unless the shards are cut over the replicas too);
    # a replicated (0-dim) one counts on rank 0 only
    def counts(chunk: Any, slot: int) -> bool:
        first_replica = chunk.comms is None or chunk.comms.replicate_rank == 0 or chunk.outer > 1
        return first_replica and (not chunk.slots[slot].replicated or chunk.rank == 0)

    grads = [to_local(seg.param.grad) for chunk in engine.chunks for seg in chunk.segments
             if seg.param.grad is not None and counts(chunk, seg.slot)]
    replicated = [to_local(seg.param.grad) for chunk in engine.chunks for seg in chunk.segments
                  if seg.param.grad is not None and not counts(chunk, seg.slot)]
    device = engine.device
    # Shards may live on different devices (offloaded to the host, or partly): each device reduces its
    # own gradients, and only one float64 scalar per device travels to the compute device.
    groups = by_device(grads)
    total = torch.zeros(1, dtype=torch.float64, device=device)
    if math.isinf(norm_type):
        for group in groups.values():
            local = torch.stack([g.abs().max() for g in group]).max().to(device=device, dtype=torch.float64)
            total = torch.maximum(total, local.reshape(1))
        sum_over_ranks(total, engine.comm, op="max")
        norm = float(total.item())
    else:
        for group in groups.values():
            local = sum((g.double().abs().pow(norm_type).sum() for g in group), torch.zeros((), dtype=torch.float64,
                                                                                         device=group[0].device))
            total += local.to(device)
        sum_over_ranks(total, engine.comm)
        norm = float(total.item() ** (1.0 / norm_type))
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for g in grads + replicated:
            g.mul_(coef)
    return norm
