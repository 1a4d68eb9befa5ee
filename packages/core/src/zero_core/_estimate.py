"""Predict model-state bytes per rank and tier, and bytes communicated per step, without running.

:func:`estimate` lays a model out the way :func:`~zero_core.shard` would (the same strategy
plugin, the same plan, the same gather groups) and counts what every rank would hold and
send, exactly, padding included. Given only a parameter count it uses the closed ZeRO formulas
(Rajbhandari et al., 2020) with the count rounded up to the world size, as one chunk (so a
placement's fractions take it whole or not at all). The model may live
on the meta device, so a 70B-parameter model can be estimated for 1024 ranks on a laptop.

What it counts, per rank, between steps (the same definitions as
:meth:`ZeroModule.model_state_bytes` and :class:`~zero_core.CommStats`):

* ``params``: master shards, plus the full compute-dtype buffer stages 1 and 2 keep (the
  shard is a view of it when both have one dtype);
* ``grads``: the masters' gradient shards, plus stage 1's full gradient buffer;
* ``optimizer_states``: per-element optimizer state of the shard's real elements (Adam:
  two fp32 moments, 8 bytes per fp32 master element; padding holds none);
* bytes sent per step by the data collectives (all-gathers of parameters, reduce-scatters
  of gradients), counted the ring way (``ring_bytes_sent``); the scalar agreement rounds a
  dynamic graph needs are not predicted (they are a few bytes per gather).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zero_core._plugins import ZeroPlugins
from zero_core._setup import resolve_device
from zero_core._state import MemoryTier
from zero_core.api import ZeroConfig
from zero_core.chunk import ParamInfo, layout_slots, padded_shard_size
from zero_core.comm import CollectiveKind, ring_bytes_sent
from zero_core.errors import ConfigError
from zero_core.placement import ChunkParts
from zero_core.strategy import round_up

__all__ = ["Estimate", "estimate"]

_KINDS = ("params", "grads", "optimizer_states")


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """What one configuration holds and sends, per rank.

    Attributes:
        params: Unique parameter elements (``Psi``).
        padded_params: Elements in all chunks (``Psi`` plus padding); ``Psi`` rounded up to
            the world size when estimated from a count.
        world_size: Ranks.
        stage: ZeRO stage.
        per_rank: Model-state bytes by kind (``params``, ``grads``, ``optimizer_states``),
            one mapping per rank; padding sits on the last ranks, so they may hold fewer
            optimizer-state bytes.
        tiers: Model-state bytes by tier (``device``, ``host``, ``disk``) per rank, or
            ``None`` when the placement policy decides at run time (Gemini measures first).
        bytes_sent: Bytes one rank sends per step, by collective (``all_gather``,
            ``reduce_scatter``); every rank sends the same.
        calls: Collective calls per step, by collective; ``None`` when estimated from a
            count (the number of chunks and buckets depends on the model's layout).
        formula: The closed formulas on ``Psi`` with no padding (``model_state_bytes`` per
            rank and ``bytes_sent`` per step), the theory each measurement is compared with.
    """

    params: int
    padded_params: int
    world_size: int
    stage: int
    per_rank: tuple[dict[str, int], ...] = field(repr=False)
    tiers: tuple[dict[str, int], ...] | None = field(repr=False)
    bytes_sent: dict[str, int]
    calls: dict[str, int] | None
    formula: dict[str, int] = field(default_factory=dict)

    def model_state_bytes(self, rank: int = 0) -> int:
        """Total model-state bytes of ``rank``."""
        return sum(self.per_rank[rank].values())

    @property
    def max_model_state_bytes(self) -> int:
        """The largest rank's model-state bytes (rank 0: padding only ever removes bytes)."""
        return max(sum(r.values()) for r in self.per_rank)

    @property
    def total_bytes_sent(self) -> int:
        return sum(self.bytes_sent.values())


@dataclass(frozen=True, kw_only=True)
class _Layout:
    """One chunk as the estimator sees it."""

    size: int
    used: int
    requires_grad: bool
    master_bytes: int
    kept: bool
    #: Real (not padding) elements of each rank's shard; None: one flat parameter (padding at the end).
    real: tuple[int, ...] | None = None


def _bytes(dtype: torch.dtype | None, default: int) -> int:
    return default if dtype is None else dtype.itemsize


def estimate(
    model: nn.Module | int,
    *,
    world_size: int,
    config: ZeroConfig | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_bytes_per_element: int = 8,
    plugins: ZeroPlugins | None = None,
) -> Estimate:
    """Predict the model-state bytes per rank and tier and the bytes sent per step.

    Args:
        model: A model (its parameters may be on the meta device) or a parameter count.
        world_size: Data-parallel ranks.
        config: The :class:`ZeroConfig` to estimate (strategy, stage, precision, comm,
            placement and chunk policy); the default config when ``None``.
        optimizer: The optimizer the model would be sharded with; its parameter groups
            decide which parameters may share a chunk. ``None``: one group.
        optimizer_bytes_per_element: Optimizer-state bytes per master element (Adam and
            AdamW on fp32 masters: 8; SGD with momentum: 4; plain SGD: 0).
        plugins: The plugin set to take strategies, comm backends and placements from.

    Raises:
        ConfigError: A world size below 1, a negative count, a model with no parameters, or
            ``ChunkPolicy(param_order="first_use")`` (that order needs a forward pass).
    """
    config = config or ZeroConfig()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"estimate needs world_size >= 1, got {world_size!r}")
    if isinstance(optimizer_bytes_per_element, bool) or not isinstance(optimizer_bytes_per_element, int) \
            or optimizer_bytes_per_element < 0:
        raise ConfigError(f"optimizer_bytes_per_element must be a non-negative int, got {optimizer_bytes_per_element!r}")
    plugins = plugins or ZeroPlugins.load()
    compute = config.precision.compute
    reduce_bytes = _bytes(config.precision.reduce, 4)
    if isinstance(model, int) and not isinstance(model, bool):
        if model < 1:
            raise ConfigError(f"estimate needs a positive parameter count, got {model}")
        chunks = [_Layout(size=round_up(model, world_size), used=model, requires_grad=True, master_bytes=4,
                          kept=config.stage < 3 or world_size == 1)]
        groups: list[list[int]] | None = None
        psi = model
        comm_cls = None
    elif isinstance(model, nn.Module):
        if config.chunk.param_order == "first_use":
            raise ConfigError("estimate lays parameters out in registration order; ChunkPolicy(param_order='first_use') "
                              "needs a forward pass, so estimate with param_order='registration' (the bytes differ only by padding)")
        chunks, groups, psi = _plan(model, optimizer, world_size, config, plugins)
        strategy = plugins.strategies.get(config.strategy)
        comm_cls = plugins.comm_backends.get(config.comm or strategy.comm)
    else:
        raise ConfigError(f"estimate needs an nn.Module or a parameter count, got {type(model).__name__}")

    compute_bytes = [_bytes(compute, c.master_bytes) for c in chunks]
    policy = plugins.placement_policies.get(config.placement).from_config(config)
    placed = [_placement(chunks, rank, world_size, policy, optimizer_bytes_per_element) for rank in range(world_size)]
    copies = policy.copies_kept_shard(resolve_device(config))
    per_rank = tuple(_rank_bytes(chunks, compute_bytes, rank, world_size, config.stage, optimizer_bytes_per_element,
                                 reduce_bytes=reduce_bytes, separate=_separate(chunks, placed[rank], copies))
                     for rank in range(world_size))
    tiers = _tiers(placed, per_rank)
    sent, calls = _traffic(chunks, compute_bytes, groups, world_size, config, reduce_bytes, comm_cls)
    master = chunks[0].master_bytes
    formula_chunk = [_Layout(size=psi, used=psi, requires_grad=True, master_bytes=master, kept=config.stage < 3 or world_size == 1)]
    formula_rank = _rank_bytes(formula_chunk, [_bytes(compute, master)], 0, world_size, config.stage,
                               optimizer_bytes_per_element, reduce_bytes=reduce_bytes, exact=False)
    formula_sent, _ = _traffic(formula_chunk, [_bytes(compute, master)], None, world_size, config, reduce_bytes, None,
                               exact=False)
    return Estimate(params=psi, padded_params=sum(c.size for c in chunks), world_size=world_size, stage=config.stage,
                    per_rank=per_rank, tiers=tiers, bytes_sent=sent, calls=calls,
                    formula={"model_state_bytes": sum(formula_rank.values()), "bytes_sent": sum(formula_sent.values())})


def _plan(model: nn.Module, optimizer: torch.optim.Optimizer | None, world_size: int, config: ZeroConfig,
          plugins: ZeroPlugins) -> tuple[list[_Layout], list[list[int]], int]:
    named = list(model.named_parameters(remove_duplicate=True))
    if not named:
        raise ConfigError(f"{type(model).__name__} has no parameters to estimate")
    group_of: dict[int, int] = {}
    if optimizer is not None:
        for g, group in enumerate(optimizer.param_groups):
            group_of.update({id(p): g for p in group["params"]})
    params = [ParamInfo(name, p, group_of.get(id(p), 0 if optimizer is None else None)) for name, p in named]
    strategy = plugins.strategies.get(config.strategy)()
    plan = strategy.plan(params, world_size=world_size, config=config, hook=plugins.manager.hook)
    plan.validate(params, world_size)
    groups = [list(g) for g in plan.gather_groups] if plan.gather_groups else [[i] for i in range(len(plan.chunks))]
    keep: set[int] = set()
    if config.stage == 3:
        keep = plugins.placement_policies.get(config.placement).from_config(config).keep_gathered(
            plan.chunks, [tuple(g) for g in groups])
    chunks = []
    for i, spec in enumerate(plan.chunks):
        first = spec.params[0].param
        # the layout the chunk itself makes: torch.chunk pieces per parameter (see [Note: chunk layout])
        slots, _ = layout_slots([(p.name, p.param) for p in spec.params], world_size)
        size = world_size * padded_shard_size([p.param.shape for p in spec.params], world_size, spec.size)
        real = tuple(sum(s.local_rows(r) * s.row for s in slots) for r in range(world_size))
        chunks.append(_Layout(size=size, used=spec.used, requires_grad=first.requires_grad, master_bytes=first.element_size(),
                              kept=config.stage < 3 or world_size == 1 or i in keep, real=real))
    return chunks, groups, plan.numel


def _real(chunk: _Layout, rank: int, shard: float) -> float:
    """Elements of ``rank``'s shard that are parameters, not padding."""
    if chunk.real is not None:
        return chunk.real[rank]
    return max(0, min(chunk.used, (rank + 1) * shard) - rank * shard)


def _rank_bytes(chunks: Sequence[_Layout], compute_bytes: Sequence[int], rank: int, world: int, stage: int,
                opt_bytes: int, *, reduce_bytes: int, exact: bool = True, separate: Sequence[bool] | None = None) -> dict[str, int]:
    out = dict.fromkeys(_KINDS, 0)
    for i, (chunk, b) in enumerate(zip(chunks, compute_bytes)):
        m = chunk.master_bytes
        shard = chunk.size // world if exact else chunk.size / world
        real = _real(chunk, rank, shard)
        # a kept full buffer in the master dtype holds the shard as a view, unless the placement moved the shard away
        view = chunk.kept and b == m and not (separate and separate[i])
        out["params"] += (b * chunk.size if chunk.kept else 0) + (0 if view else m * shard)
        if chunk.requires_grad:
            full_grad = stage == 1
            # stage 1's full gradient buffer holds the reduced shard as a view when all three dtypes agree and
            # the placement leaves the shard on the device
            grad_view = full_grad and b == m == reduce_bytes and not (separate and separate[i])
            out["grads"] += (b * chunk.size if full_grad else 0) + (0 if grad_view else m * shard)
            out["optimizer_states"] += opt_bytes * real * m // 4  # the states follow the master dtype
    return {k: int(v) for k, v in out.items()}


def _placement(chunks: Sequence[_Layout], rank: int, world: int, policy: Any, opt_bytes: int) -> list[tuple[ChunkParts, Any]] | None:
    """Each chunk's shard-sized parts on ``rank`` with the tiers the policy gives them; ``None`` if it cannot say."""
    parts = []
    for chunk in chunks:
        shard = chunk.size // world
        real = _real(chunk, rank, shard)
        grads = chunk.master_bytes * shard if chunk.requires_grad else 0
        states = opt_bytes * real * chunk.master_bytes // 4 if chunk.requires_grad else 0
        parts.append(ChunkParts(params=chunk.master_bytes * shard, grads=grads, optimizer_states=states))
    where = policy.estimate_tiers(parts)
    return None if where is None else list(zip(parts, where))


def _separate(chunks: Sequence[_Layout], placed: list[tuple[ChunkParts, Any]] | None, copies: bool) -> list[bool]:
    """Kept chunks whose master shard the policy takes off the device (to keep or to step): a copy of its own."""
    if placed is None or not copies:
        return [False] * len(chunks)
    return [chunk.kept and any(tier is not MemoryTier.DEVICE for tier in where.values()) for chunk, (_, where) in zip(chunks, placed)]


def _tiers(placed: Sequence[list[tuple[ChunkParts, Any]] | None], per_rank: Sequence[dict[str, int]]) -> tuple[dict[str, int], ...] | None:
    if any(p is None for p in placed):
        return None
    result = []
    for rank_placed, held in zip(placed, per_rank):
        tiers = {"device": 0, "host": 0, "disk": 0}
        for part, where in rank_placed or ():
            for kind in _KINDS:
                tiers[where[kind].value] += getattr(part, kind)
        # what is not a shard-sized part (the full buffers stages 1 and 2 keep) stays on the compute device
        tiers["device"] += sum(held.values()) - sum(tiers.values())
        result.append(tiers)
    return tuple(result)


def _traffic(chunks: Sequence[_Layout], compute_bytes: Sequence[int], groups: Sequence[Sequence[int]] | None, world: int,
             config: ZeroConfig, reduce_bytes: int, comm_cls: Any, *, exact: bool = True) -> tuple[dict[str, int], dict[str, int] | None]:
    if world == 1:
        return {"all_gather": 0, "reduce_scatter": 0}, ({"all_gather": 0, "reduce_scatter": 0} if groups is not None else None)

    def ring(kind: CollectiveKind, payload: float) -> float:
        if exact:
            return ring_bytes_sent(kind, int(payload), world)
        return (world - 1) * payload / world

    gather_groups = groups if groups is not None else [[i] for i in range(len(chunks))]
    sent = {"all_gather": 0.0, "reduce_scatter": 0.0}
    calls = {"all_gather": 0, "reduce_scatter": 0}
    for group in gather_groups:
        # A group with a chunk that is released after use is gathered whole for forward and again for backward.
        if not all(chunks[i].kept for i in group):
            payload = sum(chunks[i].size * compute_bytes[i] for i in group)
            sent["all_gather"] += 2 * ring(CollectiveKind.ALL_GATHER, payload)
            calls["all_gather"] += 2
        # After the step, the trainable kept members are refreshed from their updated shards in one all-gather.
        refreshed = [i for i in group if chunks[i].kept and chunks[i].requires_grad]
        if refreshed:
            sent["all_gather"] += ring(CollectiveKind.ALL_GATHER, sum(chunks[i].size * compute_bytes[i] for i in refreshed))
            calls["all_gather"] += 1
    reduced = [c for c in reversed(chunks) if c.requires_grad]  # the engine reduces in reverse plan order
    for chunk in reduced:
        sent["reduce_scatter"] += ring(CollectiveKind.REDUCE_SCATTER, chunk.size * reduce_bytes)
    if comm_cls is not None:
        calls["reduce_scatter"] = comm_cls.estimate_reduce_scatter_calls(
            [c.size // world for c in reduced], element_size=reduce_bytes, world_size=world, config=config)
    else:
        calls["reduce_scatter"] = len(reduced)
    return {k: round(v) for k, v in sent.items()}, (calls if groups is not None else None)
