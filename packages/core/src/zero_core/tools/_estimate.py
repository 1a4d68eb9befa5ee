"""Predict model-state bytes per rank and tier, and bytes communicated per step, without running.

:func:`estimate` lays a model out the way :func:`~zero_core.shard` would (the same strategy
plugin, the same plan, the same gather groups) and counts what every rank would hold and
send, exactly, padding included. Given only a parameter count it uses the closed ZeRO formulas
(Rajbhandari et al., 2020) with the count rounded up to the shard group size, as one chunk (so a
placement's fractions take it whole or not at all). The model may live
on the meta device, so a 70B-parameter model can be estimated for 1024 ranks on a laptop.

What it counts, per rank, between steps (the same definitions as
:meth:`ZeroModule.model_state_bytes` and :class:`~zero_core.CommStats`):

* ``params``: master shards, plus the full compute-dtype buffer stages 1 and 2 keep (the
  shard is a view of it when both have one dtype, unless a parameter of the chunk is cut along a
  later dimension: see [Note: shard dimension] in ``zero_core.chunks._slots``);
* ``grads``: the masters' gradient shards, plus stage 1's full gradient buffer;
* ``optimizer_states``: per-element optimizer state of the shard's real elements (Adam:
  two fp32 moments, 8 bytes per fp32 master element; padding holds none);
* bytes sent per step by the data collectives (all-gathers of parameters, reduce-scatters
  of gradients, and on a mesh with replicas the all-reduces of the reduced shards), counted
  the ring way (``ring_bytes_sent``); the scalar agreement rounds a dynamic graph needs are
  not predicted (they are a few bytes per gather).

[Note: estimating a mesh]
``mesh_shape=(R, S)`` lays the ``R * S`` ranks out as :meth:`MeshSpec.of_shape` does (rows of
``S`` consecutive ranks). Every chunk is sharded over a row, so the strategy plans for a world
of ``S`` ranks (``world_size=S``, ``topology`` the one mesh) and every rank holds what a rank
of an ``S``-rank world holds: shard index ``rank % S``. The all-gathers and reduce-scatters
are those of an ``S``-rank world (none when ``S == 1``); then each reduced chunk's shard-sized
gradient (the whole chunk when ``S == 1``) is all-reduced over the ``R`` replicas, one call
per chunk: ``ring_bytes_sent(ALL_REDUCE, shard_size * reduce_bytes, R)``.

With ``shard_optimizer_across_replicas`` (see [Note: optimizer states across replicas] in
``zero_core.chunks.chunk``) the chunks are laid out over all ``N`` ranks, so rank ``n`` holds shard
index ``n`` of an ``N``-rank layout plus its group shard (``R`` shards, compute dtype); the
all-reduce becomes a reduce-scatter of the group shard over the ``R`` replicas, and after the
step one all-gather per trainable chunk of the updated shards into the group shard:
``ring_bytes_sent(REDUCE_SCATTER, size / S * reduce_bytes, R)`` and
``ring_bytes_sent(ALL_GATHER, size / S * compute_bytes, R)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from zero_core.base._state import MemoryTier
from zero_core.base.errors import ConfigError
from zero_core.chunks.chunk import ParamInfo, layout_slots, padded_shard_size
from zero_core.comm.backend import CollectiveKind, ring_bytes_sent
from zero_core.config.api import ZeroConfig
from zero_core.interfaces._plugins import ZeroPlugins
from zero_core.interfaces.mesh import MeshSpec, Topology
from zero_core.interfaces.placement import ChunkParts
from zero_core.interfaces.strategy import ChunkPlan, Reduction, round_up
from zero_core.setup._setup import resolve_device

__all__ = ["Estimate", "estimate"]

_KINDS = ("params", "grads", "optimizer_states")


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """What one configuration holds and sends, per rank.

    Attributes:
        params: Unique parameter elements (``Psi``).
        padded_params: Elements in all chunks (``Psi`` plus padding); ``Psi`` rounded up to
            the shard group size when estimated from a count.
        world_size: Ranks (``R * S`` on a mesh).
        mesh_shape: ``(R, S)``: ``R`` replicas of every chunk, each sharded over ``S`` ranks;
            ``(1, world_size)`` for plain sharding.
        stage: ZeRO stage.
        per_rank: Model-state bytes by kind (``params``, ``grads``, ``optimizer_states``),
            one mapping per rank; padding sits on the last ranks of each shard group, so they
            may hold fewer optimizer-state bytes.
        tiers: Model-state bytes by tier (``device``, ``host``, ``disk``) per rank, or
            ``None`` when the placement policy decides at run time (Gemini measures first).
        bytes_sent: Bytes one rank sends per step, by collective (``all_gather``,
            ``reduce_scatter``, and ``all_reduce`` when ``R > 1``); every rank sends the same.
        bytes_sent_by_group: The same bytes by the group they travel in: ``shard`` (the
            all-gathers and reduce-scatters, inside a shard group of ``S`` ranks) and
            ``replicate`` (the all-reduces, across the ``R`` replicas).
        calls: Collective calls per step, by collective; ``None`` when estimated from a
            count (the number of chunks and buckets depends on the model's layout).
        formula: The closed formulas on ``Psi`` with no padding, the theory each measurement
            is compared with: ``model_state_bytes`` per rank, ``bytes_sent`` per step, and
            that split by group as ``bytes_sent_shard`` and ``bytes_sent_replicate``.
    """

    params: int
    padded_params: int
    world_size: int
    mesh_shape: tuple[int, int]
    stage: int
    per_rank: tuple[dict[str, int], ...] = field(repr=False)
    tiers: tuple[dict[str, int], ...] | None = field(repr=False)
    bytes_sent: dict[str, int]
    bytes_sent_by_group: dict[str, int]
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

    def inter_node_bytes(self, gpus_per_node: int) -> int:
        """Bytes per GPU per step that cross a node boundary, in a model of the cluster.

        A planning figure, not a count of anything the engine does. The model:

        * global rank ``r`` runs on node ``r // gpus_per_node``, and the mesh lays ranks out
          row-major (shard groups are runs of ``S`` consecutive ranks, as
          :meth:`MeshSpec.of_shape`);
        * every collective runs as one ring through its group's ranks in rank order (a ring
          ordered by node, as NCCL builds it), so each rank sends its whole share
          (:attr:`bytes_sent`) to its successor, and the share of a group's bytes that crosses
          nodes is the share of the ring's edges that join two nodes: ``k / n`` for a group of
          ``n`` ranks over ``k > 1`` nodes in contiguous blocks, 0 inside one node, 1 for a
          group with one rank per node;
        * the result is averaged over the GPUs: with whole nodes, a node's inter-node egress
          divided by ``gpus_per_node`` (with one NIC per GPU, the load of one NIC, as NCCL
          spreads its rings over the NICs; in one ring only the GPU at the node's edge sends
          across).

        So with ``S == gpus_per_node`` (HSDP, one shard group per node) only the replicate
        all-reduce crosses nodes: ``bytes_sent_by_group["replicate"]``. Full sharding over
        ``W`` GPUs in whole nodes sends ``bytes_sent / gpus_per_node`` across nodes (for
        ``W > gpus_per_node``; 0 in one node). Node-aware hierarchical algorithms can do a
        little better than a ring (an all-gather needs only ``(W - g) / W`` of the payload
        into each node, the ring carries ``(W - 1) / W``); this model does not assume them.
        """
        if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            raise ConfigError(f"inter_node_bytes needs gpus_per_node >= 1, got {gpus_per_node!r}")
        mesh = MeshSpec.of_shape(self.mesh_shape)
        shard = _ring_crossing_share(mesh.shard_groups(), gpus_per_node)
        replicate = _ring_crossing_share(mesh.replicate_groups(), gpus_per_node)
        return round(self.bytes_sent_by_group["shard"] * shard + self.bytes_sent_by_group["replicate"] * replicate)


def _ring_crossing_share(groups: Sequence[Sequence[int]], gpus_per_node: int) -> Fraction:
    """Of the ring edges of these groups (each a ring in rank order), the share that joins two nodes."""
    edges = crossing = 0
    for group in groups:
        if len(group) < 2:
            continue
        ring = sorted(group)
        edges += len(ring)
        crossing += sum(a // gpus_per_node != b // gpus_per_node for a, b in zip(ring, ring[1:] + ring[:1]))
    return Fraction(crossing, edges) if edges else Fraction(0)


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
    #: Replicas its shards are cut over (each rank keeps a group shard of ``outer`` shards); 1: not cut.
    outer: int = 1
    #: A parameter is cut along a later dimension: a kept full buffer cannot hold the shard as a view.
    strided: bool = False


def _bytes(dtype: torch.dtype | str | None, default: int) -> int:
    if dtype is None:
        return default
    assert isinstance(dtype, torch.dtype)  # a Precision's str dtypes are torch.dtypes once it is constructed
    return dtype.itemsize


def estimate(
    model: nn.Module | int,
    *,
    world_size: int | None = None,
    mesh_shape: Sequence[int] | None = None,
    config: ZeroConfig | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_bytes_per_element: int = 8,
    plugins: ZeroPlugins | None = None,
) -> Estimate:
    """Predict the model-state bytes per rank and tier and the bytes sent per step.

    Args:
        model: A model (its parameters may be on the meta device) or a parameter count.
        world_size: Data-parallel ranks (plain sharding over all of them).
        mesh_shape: ``(R, S)``: shard every chunk over ``S`` ranks and replicate it over ``R``
            (HSDP; what ``shard(..., mesh=)`` does with a 2-D mesh of that shape), or ``(S,)``
            for plain sharding over ``S`` ranks. Give ``world_size`` or ``mesh_shape``, or
            both when ``world_size == R * S``. See [Note: estimating a mesh].
        config: The :class:`ZeroConfig` to estimate (strategy, stage, precision, comm,
            placement and chunk policy); the default config when ``None``.
        optimizer: The optimizer the model would be sharded with; its parameter groups
            decide which parameters may share a chunk. ``None``: one group.
        optimizer_bytes_per_element: Optimizer-state bytes per master element (Adam and
            AdamW on fp32 masters: 8; SGD with momentum: 4; plain SGD: 0).
        plugins: The plugin set to take strategies, comm backends and placements from.

    Raises:
        ConfigError: A world size below 1, a mesh shape that is not ``(S,)`` or ``(R, S)`` of
            positive ints or disagrees with ``world_size``, a negative count, a model with no
            parameters, ``ChunkPolicy(param_order="first_use")`` (that order needs a forward
            pass), or a plan the estimator does not model (``reshard_after_forward`` other
            than ``True`` at stage 3, chunks on another mesh or with another reduction).
    """
    config = config or ZeroConfig()
    mesh = _mesh(world_size, mesh_shape)
    world, replicas, shards = mesh.size, mesh.replicate_ranks, mesh.shard_ranks
    across = config.shard_optimizer_across_replicas and replicas > 1
    # the ranks a chunk is laid out over: its shard group, or every rank when cut over the replicas too
    outer, layout_world = (replicas, world) if across else (1, shards)
    if isinstance(optimizer_bytes_per_element, bool) or not isinstance(optimizer_bytes_per_element, int) \
            or optimizer_bytes_per_element < 0:
        raise ConfigError(f"optimizer_bytes_per_element must be a non-negative int, got {optimizer_bytes_per_element!r}")
    plugins = plugins or ZeroPlugins.load()
    compute = config.precision.compute
    reduce_bytes = _bytes(config.precision.reduce, 4)
    released = config.stage == 3 and shards > 1  # chunks a shard group gathers for use and frees after
    if isinstance(model, int) and not isinstance(model, bool):
        if model < 1:
            raise ConfigError(f"estimate needs a positive parameter count, got {model}")
        _check_reshard(config.reshard_after_forward, released, "")
        chunks = [_Layout(size=round_up(model, layout_world), used=model, requires_grad=True, master_bytes=4,
                          kept=not released, outer=outer)]
        groups: list[list[int]] | None = None
        psi = model
        # the backend decides the bytes a gather or reduction sends (a quantized one sends fewer); the calls of a
        # count stay one per chunk of the single chunk a count is laid out as, whatever the backend's buckets
        comm_cls = plugins.comm_backends.get(config.comm_backend or plugins.strategies.get(config.strategy).comm)
    elif isinstance(model, nn.Module):
        if config.chunk.param_order == "first_use":
            raise ConfigError("estimate lays parameters out in registration order; ChunkPolicy(param_order='first_use') "
                              "needs a forward pass, so estimate with param_order='registration' (the bytes differ only by padding)")
        chunks, groups, psi = _plan(model, optimizer, mesh, config, plugins, outer=outer)
        strategy = plugins.strategies.get(config.strategy)
        comm_cls = plugins.comm_backends.get(config.comm_backend or strategy.comm)
    else:
        raise ConfigError(f"estimate needs an nn.Module or a parameter count, got {type(model).__name__}")

    # Every rank holds what a rank of an S-rank world holds: shard index rank % S (see [Note: estimating a mesh]);
    # cut over the replicas too, rank n holds shard n of an N-rank layout.
    compute_bytes = [_bytes(compute, c.master_bytes) for c in chunks]
    policy = plugins.placement_policies.get(config.placement).from_config(config)
    placed = [_placement(chunks, rank, layout_world, policy, optimizer_bytes_per_element) for rank in range(layout_world)]
    copies = policy.copies_kept_shard(resolve_device(config))
    by_shard = [_rank_bytes(chunks, compute_bytes, rank, layout_world, config.stage, optimizer_bytes_per_element,
                            reduce_bytes=reduce_bytes, separate=_separate(chunks, placed[rank], copies))
                for rank in range(layout_world)]
    tiers_by_shard = _tiers(placed, by_shard)
    per_rank = tuple(dict(by_shard[rank % layout_world]) for rank in range(world))
    tiers = None if tiers_by_shard is None else tuple(dict(tiers_by_shard[rank % layout_world]) for rank in range(world))
    sent, calls = _traffic(chunks, compute_bytes, groups, shards, replicas, config, reduce_bytes, comm_cls,
                           backend_calls=isinstance(model, nn.Module))
    if comm_cls is not None and not comm_cls.params_exact_at(shards):
        # lossy parameter gathers: kept chunks hold their master shard apart (see CommBackend.params_exact)
        by_shard = [_rank_bytes(chunks, compute_bytes, rank, layout_world, config.stage, optimizer_bytes_per_element,
                                reduce_bytes=reduce_bytes, separate=_separate(chunks, placed[rank], copies),
                                masters_apart=True)
                    for rank in range(layout_world)]
        tiers_by_shard = _tiers(placed, by_shard)
        per_rank = tuple(dict(by_shard[rank % layout_world]) for rank in range(world))
        tiers = None if tiers_by_shard is None else tuple(dict(tiers_by_shard[rank % layout_world]) for rank in range(world))
    master = chunks[0].master_bytes
    formula_chunk = [_Layout(size=psi, used=psi, requires_grad=True, master_bytes=master, kept=not released, outer=outer)]
    formula_rank = _rank_bytes(formula_chunk, [_bytes(compute, master)], 0, layout_world, config.stage,
                               optimizer_bytes_per_element, reduce_bytes=reduce_bytes, exact=False)
    formula_sent, _ = _traffic(formula_chunk, [_bytes(compute, master)], None, shards, replicas, config, reduce_bytes, None,
                               exact=False)
    by_group = _by_group(sent, sent.pop("across_replicas", 0))
    formula_by_group = _by_group(formula_sent, formula_sent.pop("across_replicas", 0))
    return Estimate(params=psi, padded_params=sum(c.size for c in chunks), world_size=world, mesh_shape=(replicas, shards),
                    stage=config.stage, per_rank=per_rank, tiers=tiers, bytes_sent=sent, bytes_sent_by_group=by_group,
                    calls=calls,
                    formula={"model_state_bytes": sum(formula_rank.values()), "bytes_sent": sum(formula_sent.values()),
                             "bytes_sent_shard": formula_by_group["shard"],
                             "bytes_sent_replicate": formula_by_group["replicate"]})


def _mesh(world_size: int | None, mesh_shape: Sequence[int] | None) -> MeshSpec:
    """The mesh to estimate on, from ``world_size`` and/or ``mesh_shape``."""
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ConfigError(f"estimate needs world_size >= 1, got {world_size!r}")
    if mesh_shape is None:
        if world_size is None:
            raise ConfigError("estimate needs world_size=N (plain sharding over N ranks) or mesh_shape=(R, S) "
                              "(S ranks shard each chunk, R replicas of them)")
        return MeshSpec.of_shape((world_size,))
    if isinstance(mesh_shape, (str, bytes)) or not isinstance(mesh_shape, Sequence) or len(mesh_shape) not in (1, 2) \
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in mesh_shape):
        raise ConfigError(f"estimate's mesh_shape must be (shard,) or (replicate, shard) of positive ints, e.g. (16, 8) "
                          f"for 16 nodes of 8 GPUs that shard inside each node; got {mesh_shape!r}")
    mesh = MeshSpec.of_shape(tuple(mesh_shape))
    if world_size is not None and world_size != mesh.size:
        raise ConfigError(f"estimate got world_size={world_size} but mesh_shape={tuple(mesh_shape)} spans {mesh.size} "
                          "ranks; give one of them, or a mesh of world_size ranks")
    return mesh


def _check_reshard(value: object, released: bool, where: str) -> None:
    if released and value is not True:
        raise ConfigError(f"estimate predicts stage 3 with reshard_after_forward=True only{where}; got {value!r}, "
                          "which changes the backward's gathers (estimate with True for the model states, which "
                          "it does not change between steps)")


def _plan(model: nn.Module, optimizer: torch.optim.Optimizer | None, mesh: MeshSpec, config: ZeroConfig,
          plugins: ZeroPlugins, *, outer: int = 1) -> tuple[list[_Layout], list[list[int]], int]:
    named = list(model.named_parameters(remove_duplicate=True))
    if not named:
        raise ConfigError(f"{type(model).__name__} has no parameters to estimate")
    group_of: dict[int, int] = {}
    if optimizer is not None:
        for g, group in enumerate(optimizer.param_groups):
            group_of.update({id(p): g for p in group["params"]})
    params = [ParamInfo(name, p, group_of.get(id(p), 0 if optimizer is None else None)) for name, p in named]
    strategy = plugins.strategies.get(config.strategy)()
    world_size = mesh.shard_ranks  # the strategy plans for the default mesh's shard group
    topology = Topology.of(mesh)
    # as shard() does: a strategy written before meshes takes no topology, and plans for a 1-D mesh only
    takes_topology = "topology" in inspect.signature(strategy.plan).parameters
    if mesh.ndim > 1 and not takes_topology:
        raise ConfigError(f"shard strategy {config.strategy!r} plans for one 1-D mesh only (its plan() takes no topology), "
                          "so shard() refuses a 2-D mesh; estimate a strategy that supports meshes (chunk, tensor), "
                          "or plain sharding (world_size=N)")
    extra = {"topology": topology} if takes_topology else {}
    plan = strategy.plan(params, world_size=world_size, config=config, hook=plugins.manager.hook, **extra)
    plan.validate(params, world_size, topology)
    default = ChunkPlan(mesh=mesh, reshard_after_forward=config.reshard_after_forward)
    chunk_plans = plan.plans(default)
    for i, cp in enumerate(chunk_plans):
        assert cp.reduction is not None  # ChunkPlan fills it in
        if cp.mesh != mesh or cp.reduction is not Reduction.for_mesh(mesh):
            raise ConfigError(f"estimate predicts chunks on the one mesh it is given ({mesh}, {Reduction.for_mesh(mesh).value}); "
                              f"strategy {config.strategy!r} planned chunk {i} on {cp.mesh} with {cp.reduction.value}")
    groups = [list(g) for g in plan.gather_groups] if plan.gather_groups else [[i] for i in range(len(plan.chunks))]
    keep: set[int] = set()
    policy = plugins.placement_policies.get(config.placement).from_config(config)
    keep_alone = policy.keep_gathered_alone()
    if config.stage == 3:
        keep = policy.keep_gathered(plan.chunks, [tuple(g) for g in groups])
    chunks = []
    layout_world = world_size * outer  # cut over the replicas too: laid out over every rank, as shard() does
    for i, spec in enumerate(plan.chunks):
        first = spec.params[0].param
        # the layout the chunk itself makes: torch.chunk pieces per parameter (see [Note: chunk layout])
        slots, _ = layout_slots([(p.name, p.param) for p in spec.params], layout_world)
        size = layout_world * padded_shard_size([p.param.shape for p in spec.params], layout_world,
                                                round_up(spec.size, layout_world))
        real = tuple(sum(s.local_numel(r) for s in slots) for r in range(layout_world))
        kept = config.stage < 3 or (layout_world == 1 and keep_alone) or i in keep
        _check_reshard(chunk_plans[i].reshard_after_forward, not kept, f" (chunk {i})")
        chunks.append(_Layout(size=size, used=spec.used, requires_grad=first.requires_grad, master_bytes=first.element_size(),
                              kept=kept, real=real, outer=outer, strided=any(s.strided for s in slots)))
    return chunks, groups, plan.numel


def _real(chunk: _Layout, rank: int, shard: int | Fraction) -> int | Fraction:
    """Elements of ``rank``'s shard that are parameters, not padding."""
    if chunk.real is not None:
        return chunk.real[rank]
    return max(0, min(chunk.used, (rank + 1) * shard) - rank * shard)


def _rank_bytes(chunks: Sequence[_Layout], compute_bytes: Sequence[int], rank: int, world: int, stage: int,
                opt_bytes: int, *, reduce_bytes: int, exact: bool = True, separate: Sequence[bool] | None = None,
                masters_apart: bool = False) -> dict[str, int]:
    out: dict[str, int | Fraction] = dict.fromkeys(_KINDS, 0)
    for i, (chunk, b) in enumerate(zip(chunks, compute_bytes)):
        m = chunk.master_bytes
        shard = chunk.size // world if exact else Fraction(chunk.size, world)
        real = _real(chunk, rank, shard)
        # a kept full buffer in the master dtype holds the shard as a view, unless the placement moved the shard away;
        # so does a group shard (cut over the replicas) in the master dtype
        # (not a kept buffer gathered lossily, ``masters_apart``: see CommBackend.params_exact)
        view = ((chunk.kept and not chunk.strided and not masters_apart) or chunk.outer > 1) and b == m \
            and not (separate and separate[i])
        out["params"] += (b * chunk.size if chunk.kept else 0) + (b * shard * chunk.outer if chunk.outer > 1 else 0) \
            + (0 if view else m * shard)
        if chunk.requires_grad:
            full_grad = stage == 1
            # stage 1's full gradient buffer holds the reduced shard as a view when all three dtypes agree and
            # the placement leaves the shard on the device
            grad_view = full_grad and b == m == reduce_bytes and not (separate and separate[i]) and not chunk.strided
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


def _by_group(sent: dict[str, int], across: int) -> dict[str, int]:
    """``across``: the bytes of the reduce-scatters and all-gathers over the replicas (shards cut over them)."""
    return {"shard": sent["all_gather"] + sent["reduce_scatter"] - across, "replicate": sent.get("all_reduce", 0) + across}


def _traffic(chunks: Sequence[_Layout], compute_bytes: Sequence[int], groups: Sequence[Sequence[int]] | None, world: int,
             replicas: int, config: ZeroConfig, reduce_bytes: int, comm_cls: Any, *,
             exact: bool = True, backend_calls: bool = True) -> tuple[dict[str, int], dict[str, int] | None]:
    """Bytes and calls per step: gathers and reduce-scatters over a shard group of ``world`` ranks, then
    (``replicas > 1``) one all-reduce per reduced chunk of its shard over the replicas."""
    outer = chunks[0].outer if chunks else 1
    kinds = ("all_gather", "reduce_scatter") + (("all_reduce",) if replicas > 1 and outer == 1 else ())
    sent: dict[str, Fraction | int] = dict.fromkeys(kinds, 0)
    calls = dict.fromkeys(kinds, 0)

    def ring(kind: CollectiveKind, payload: Fraction | int, n: int) -> Fraction | int:
        if exact:
            return ring_bytes_sent(kind, int(payload), n)
        return (2 if kind is CollectiveKind.ALL_REDUCE else 1) * Fraction(n - 1, n) * payload

    def data(kind: CollectiveKind, numel_per_rank: Fraction | int, element_size: int, n: int) -> Fraction | int:
        """A parameter gather or gradient reduce-scatter: what the backend sends, which may be fewer bytes (see
        [Note: collectives that may be lossy] in zero_core.comm.backend)."""
        if comm_cls is None or not exact:
            return ring(kind, numel_per_rank * n * element_size, n)
        return int(comm_cls.estimate_bytes_sent(kind, int(numel_per_rank), element_size=element_size, world_size=n,
                                                config=config))

    reduced = [c for c in reversed(chunks) if c.requires_grad]  # the engine reduces in reverse plan order
    if world > 1:
        gather_groups = groups if groups is not None else [[i] for i in range(len(chunks))]
        for group in gather_groups:
            # A group with a chunk that is released after use is gathered whole for forward and again for backward.
            if not all(chunks[i].kept for i in group):  # a group is one dtype: one element size
                numel = sum(chunks[i].size for i in group) // world if exact else Fraction(sum(chunks[i].size for i in group), world)
                sent["all_gather"] += 2 * data(CollectiveKind.ALL_GATHER, numel, compute_bytes[group[0]], world)
                calls["all_gather"] += 2
            # After the step, the trainable kept members are refreshed from their updated shards in one all-gather.
            refreshed = [i for i in group if chunks[i].kept and chunks[i].requires_grad]
            if refreshed:
                numel = sum(chunks[i].size for i in refreshed) // world if exact else \
                    Fraction(sum(chunks[i].size for i in refreshed), world)
                sent["all_gather"] += data(CollectiveKind.ALL_GATHER, numel, compute_bytes[refreshed[0]], world)
                calls["all_gather"] += 1
        for chunk in reduced:
            numel = chunk.size // world if exact else Fraction(chunk.size, world)
            sent["reduce_scatter"] += data(CollectiveKind.REDUCE_SCATTER, numel, reduce_bytes, world)
        if comm_cls is not None and backend_calls:
            calls["reduce_scatter"] = comm_cls.estimate_reduce_scatter_calls(
                [c.size // world for c in reduced], element_size=reduce_bytes, world_size=world, config=config)
        else:
            calls["reduce_scatter"] = len(reduced)
    if replicas > 1 and outer > 1:
        # cut over the replicas: each reduced group shard is reduce-scattered across them, and after the step each
        # trainable chunk's updated shards are all-gathered into the group shard, one call each a chunk
        across: dict[str, Fraction | int] = {"reduce_scatter": 0, "all_gather": 0}
        for chunk, b in zip(chunks, compute_bytes):
            if chunk.requires_grad:
                group_shard = chunk.size // world if exact else Fraction(chunk.size, world)
                per_replica = chunk.size // world // replicas if exact else Fraction(chunk.size, world * replicas)
                across["reduce_scatter"] += data(CollectiveKind.REDUCE_SCATTER, per_replica, reduce_bytes, replicas)
                across["all_gather"] += ring(CollectiveKind.ALL_GATHER, group_shard * b, replicas)
        for kind, value in across.items():
            sent[kind] += value
            calls[kind] += len(reduced)
        sent["across_replicas"] = sum(across.values())  # taken out again by estimate(), for bytes_sent_by_group
    elif replicas > 1:
        # HSDP: each reduced shard (the whole chunk when world == 1) is all-reduced across the replicas, one call a chunk.
        for chunk in reduced:
            shard = chunk.size // world if exact else Fraction(chunk.size, world)
            sent["all_reduce"] += ring(CollectiveKind.ALL_REDUCE, shard * reduce_bytes, replicas)
        calls["all_reduce"] = len(reduced)
    return {k: round(v) for k, v in sent.items()}, (calls if groups is not None else None)
