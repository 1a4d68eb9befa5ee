"""The public verb: :func:`shard`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from zero_core._module import ZeroModule, adopt
from zero_core.base._host_memory import return_freed_host_memory
from zero_core.base._log import logger
from zero_core.base._state import MemoryTier
from zero_core.base._streams import streams_for
from zero_core.base.errors import CheckpointError, ConfigError, PluginContractError, ZeroSetupError
from zero_core.checkpoint._sources import open_source
from zero_core.checkpoint._state_keys import ModelKeys, check_names, fill_from_source, refresh_kept
from zero_core.chunks._collectives import broadcast_from_rank0
from zero_core.chunks._group import build_groups
from zero_core.chunks.chunk import BufferPool, Chunk, ChunkSpec
from zero_core.comm._agreement import raise_if_any_failed
from zero_core.comm.backend import CommBackend
from zero_core.config.api import ZeroConfig
from zero_core.interfaces._inspection import device_bytes
from zero_core.interfaces._plugins import ZeroPlugins
from zero_core.interfaces.mesh import MeshSpec, Topology
from zero_core.interfaces.placement import PlacementContext, PlacementPolicy
from zero_core.interfaces.strategy import ChunkPlan, ShardPlan, ShardStrategy
from zero_core.runtime._engine import Engine
from zero_core.runtime._optimizer_bridge import OptimizerBridge
from zero_core.runtime._reducer import GradientReducer
from zero_core.runtime._scaler import LossScaler
from zero_core.runtime._whole_step import WholeTensorSteps, guard_unregistered_optimizers
from zero_core.setup._lazy import LazyRecording, find_recording, release_if_unused
from zero_core.setup._materialize import materialize
from zero_core.setup._meshes import MeshGroups
from zero_core.setup._setup import (
    check_ranks_agree,
    collect_params,
    first_use_order,
    group_offsets,
    optimizer_updates,
    resolve_device,
    resolve_group,
    whole_reads,
)

__all__ = ["Sharded", "shard"]


Optimizers = torch.optim.Optimizer | tuple[torch.optim.Optimizer, ...] | list[torch.optim.Optimizer]


class Sharded(NamedTuple):
    """What :func:`shard` returns: train ``model`` and step ``optimizer`` as usual (the optimizers as passed: one,
    or the same tuple or list)."""

    model: ZeroModule
    optimizer: Any


def shard(
    model: nn.Module,
    optimizer: Optimizers,
    *,
    config: ZeroConfig | None = None,
    process_group: Any = None,
    mesh: Any = None,
    module_meshes: Mapping[str, Any] | None = None,
    reduce_process_group: Any = None,
    example_inputs: Any = None,
    plugins: Iterable[object] = (),
    load_from: Any = None,
    load_strict: bool = True,
) -> Sharded:
    """Shard ``model``'s parameters, gradients and optimizer states over the data-parallel ranks.

    Args:
        model: The model, built on every rank (same structure everywhere).
        optimizer: Any ``torch.optim`` optimizer over ``model``'s parameters, not yet stepped.
            It is re-pointed, in place, at this rank's parameter shards and returned. Or a tuple
            or list of them, every optimizer the training loop steps (the Muon recipe: Muon over
            the matrices, AdamW over the rest, ``shard(model, (muon, adamw))``): each parameter in
            at most one of them; each is re-pointed and stepped as it would be alone (whole-tensor
            or element-wise, see ``ZeroConfig.optimizer_updates``), and the same tuple or list is
            returned. An optimizer that holds the model's parameters and was not passed here
            raises :class:`~zero_core.ZeroError` at its first ``step()``. Several optimizers need
            ``placement="device"``. See [Note: several optimizers].
        config: What to build; defaults to ``ZeroConfig()`` (chunked ZeRO-3 on the compute device).
        process_group: The data-parallel group; default: the world group, or a single
            process when ``torch.distributed`` is not initialised. The same as a 1-D ``mesh``.
        mesh: A ``torch.distributed.device_mesh.DeviceMesh`` to shard over, FSDP2's
            convention: 1-D shards over all its ranks; 2-D (``mesh_dim_names`` such as
            ``("replicate", "shard")``) shards over the second dimension and replicates over
            the first (hybrid sharding, HSDP: gathers stay inside a row, gradients are
            reduce-scattered in the row and all-reduced across rows). It must span every
            rank of the default process group. See ``[Note: meshes]`` in ``zero_core.interfaces.mesh``.
        module_meshes: Module names (as in ``model.named_modules()``) to meshes: the
            parameters under each such module go on that mesh instead (the longest name
            wins); chunks never mix meshes, and each chunk gathers and reduces on its own
            mesh's groups. Each mesh spans the same ranks as ``mesh``.
        reduce_process_group: The group gradient reduce-scatters run on: another group over
            the same ranks as ``process_group`` (they run concurrently with all-gathers, so
            they must not share one). Default: a new group made with ``new_group``.
        example_inputs: One batch (a tensor, a tuple of positional args or a dict of keyword
            args) used to record the first-use order when ``config.chunk.param_order == "first_use"``.
        plugins: Plugin objects to register in addition to the installed entry points.
        load_from: Initial parameter and buffer values: a plain state dict (a mapping of tensors,
            or a path to a ``.safetensors``, ``.pt``/``.bin`` file or a ``*.index.json`` of sharded
            files), loaded strictly; each rank reads only the part its shards hold. With a model
            built under :func:`zero_core.lazy_init`, its initialisers are not run for the parameters
            the source holds. Checked against the model before anything is built.
        load_strict: ``False`` lets ``load_from`` lack some of the model's keys (those keep their
            initial values) or hold keys the model lacks; shapes must always match.

    Returns:
        The sharded ``(model, optimizer)`` pair: use them in an ordinary loop (forward,
            ``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad()``); with several
            optimizers ``optimizer`` is the tuple or list passed, step and zero each as usual.
    """
    config = ZeroConfig() if config is None else config
    if not isinstance(config, ZeroConfig):
        raise ConfigError(f"config must be a zero_core.ZeroConfig, got {type(config).__name__}")
    if isinstance(model, ZeroModule) or getattr(model, "_zero_sharded", False):
        raise ZeroSetupError("this model is already sharded by zero_core.shard; wrap the original model only once")
    optimizers = _optimizers(optimizer, config)
    if config.release_host_memory:  # before any chunk buffer exists. See [Note: host memory that is freed is returned]
        return_freed_host_memory()
    params = collect_params(model, optimizers)
    updates = [optimizer_updates(opt, config) for opt in optimizers]
    # Parameters built under lazy_init() are meta tensors; their values come from replaying the recording.
    metas = {id(p.param): p.param.data for p in params if p.param.device.type == "meta"}
    recording = None
    if metas:
        if len(metas) != len(params):
            real = next(p.name for p in params if id(p.param) not in metas)
            raise ZeroSetupError(
                f"some parameters are on the meta device and some are not (for example {real!r}); build the whole "
                "model inside `with zero_core.lazy_init():`, or none of it"
            )
        recording = find_recording(list(metas.values()))
    if config.chunk.param_order == "first_use" and example_inputs is None:
        raise ZeroSetupError(
            "ChunkPolicy(param_order='first_use') needs example_inputs=<one batch> in zero_core.shard "
            "to record the order; or use param_order='registration'"
        )

    group = _resolve_mesh_group(process_group, mesh)
    plugins_ = ZeroPlugins.load(plugins)
    plugins_.manager.hook.zero_configure.call_historic(kwargs={"config": config})
    strategy = plugins_.strategies.get(config.strategy)()
    comm_cls = plugins_.comm_backends.get(config.comm_backend or strategy.comm)
    timeout = timedelta(seconds=config.collective_timeout_s)
    comm = comm_cls.from_config(group, timeout=timeout, config=config)
    reduce_group = _check_reduce_group(reduce_process_group, group, comm) or _new_group_like(group, comm)
    reduce_comm = comm_cls.from_config(reduce_group, timeout=timeout, config=config)
    reduce_comm.stats = comm.stats  # one set of counters per engine
    placement = plugins_.placement_policies.get(config.placement).from_config(config)
    device = resolve_device(config)

    if config.check_ranks_agree:
        check_ranks_agree(params, config, comm)
    source, complete = _open_load_source(model, load_from, load_strict, comm) if load_from is not None else (None, False)
    if config.chunk.param_order == "first_use":
        params = first_use_order(model, params, example_inputs, comm, meta=recording is not None)
    topology = _topology(model, group, mesh, module_meshes, comm)
    plan = _plan(strategy, params, topology, config, plugins_.manager.hook)
    default_reshard = _default_reshard(config, topology)  # a size the model's own mesh cannot use fails here
    chunk_plans = plan.plans(ChunkPlan(mesh=topology.default, reshard_after_forward=default_reshard))
    if config.stage == 3 and not config.static_graph and any(not isinstance(p.reshard_after_forward, bool)
                                                            for p in chunk_plans):
        raise ZeroSetupError(
            "reshard_after_forward=<group size> needs ZeroConfig(static_graph=True): the backward gathers the copies "
            "the forward kept, so every rank must have run the same modules; use True or False for a dynamic graph"
        )

    groups = tuple(tuple(g) for g in plan.gather_groups) if plan.gather_groups else tuple((i,) for i in range(len(plan.chunks)))
    keep = placement.keep_gathered(plan.chunks, groups) if config.stage == 3 else set()
    keep_alone = placement.keep_gathered_alone()
    chunks = []
    pool = BufferPool(streams_for(device))  # see [Note: streams of the data plane] in zero_core.base._streams
    default_mesh = mesh if mesh is not None and mesh.ndim == 1 else _data_parallel_mesh(group, device, comm)
    mesh_groups = MeshGroups(
        world_comm=comm, world_reduce_comm=reduce_comm, default=topology.default, default_mesh=default_mesh,
        make_comm=lambda g: _shared_stats(comm_cls.from_config(g, timeout=timeout, config=config), comm),
        device=device, rank=_global_rank(comm),
    )
    across = _check_across_replicas(config, chunk_plans, keep)
    for index, spec in enumerate(plan.chunks):
        mesh_spec = chunk_plans[index].mesh
        cut = across and mesh_spec.replicate_ranks > 1
        chunk_comms = mesh_groups.for_plan(chunk_plans[index], across_replicas=cut)
        if chunk_comms.device_mesh is not None and chunk_comms.device_mesh is not default_mesh:
            _register_dtensor_ops()
        # see [Note: optimizer states across replicas] in zero_core.chunks.chunk: laid out over every rank of the mesh
        outer, world = (mesh_spec.replicate_ranks, mesh_spec.size) if cut else (1, mesh_spec.shard_ranks)
        rank = chunk_comms.replicate_rank * mesh_spec.shard_ranks + chunk_comms.shard_rank if cut else chunk_comms.shard_rank
        if spec.size % world:
            spec = ChunkSpec(spec.params, -(-spec.size // world) * world)
        chunk = Chunk(index, spec, rank=rank, world_size=world,
                      device=device, pool=pool, stage=config.stage, compute_dtype=cast("torch.dtype | None", config.precision.compute),
                      reduce_dtype=cast(torch.dtype, config.precision.reduce),
                      gradient_predivide_factor=config.precision.gradient_predivide_factor, keep_gathered=index in keep,
                      keep_alone=keep_alone,
                      mesh=chunk_comms.device_mesh, replicas=1 if cut else mesh_spec.replicate_ranks, outer=outer,
                      exact_gathers=chunk_comms.gather.params_exact, timeout=timeout)
        chunk.plan, chunk.comms = chunk_plans[index], chunk_comms
        chunk.owned = True
        # made where the policy places it first: see [Note: shards made where they live] in zero_core.chunks.chunk
        tier = _initial_tier(placement, chunk)
        if recording is None:
            chunk.pack(sync=functools.partial(broadcast_from_rank0, comm=comm) if config.sync_module_states else None,
                       tier=tier)
        else:
            chunk.begin_fill(tier=tier)
        chunks.append(chunk)
    _initial_values(model, chunks, comm, config, recording, metas, source, complete)
    if recording is not None:
        metas.clear()
        release_if_unused(recording)
    with torch.no_grad():
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is None:
                    continue
                buf = buf.to(device)
                if config.precision.compute is not None and buf.is_floating_point():
                    buf = buf.to(config.precision.compute)  # the model runs in the compute dtype throughout
                if config.sync_module_states:
                    broadcast_from_rank0(buf, comm)
                module._buffers[name] = buf
    for opt in optimizers:
        _repoint_optimizer(opt, chunks)
    # Built in an order without cycles: the reducer and the optimizer bridge exist before the placement policy,
    # which receives the bridge's step_chunks; the engine last, holding all of them.
    mesh_comms = _mesh_comms(chunks, comm, reduce_comm)
    comms = (comm, reduce_comm, *mesh_comms)
    # an upper bound of what one backward reduce-scatters on any of them (frozen chunks too: they may be unfrozen)
    reduced = [c.gather_numel for c in chunks]
    for backend in comms:
        backend.expect_reduce_scatters(reduced)
    gather_groups = build_groups(chunks, groups, pool)
    reducer = GradientReducer(gather_groups, reduce_comm=reduce_comm, mesh_comms=mesh_comms, agree=not config.static_graph)
    loss_scale = config.precision.loss_scale
    chunks_of = _chunks_by_optimizer(optimizers, chunks)
    wholes = [_whole_steps(opt, mine, comm, device, config, mesh_comms) if how == "whole" else None
              for opt, mine, how in zip(optimizers, chunks_of, updates)]
    # see [Note: a whole-tensor optimizer zero was not given]
    guard_unregistered_optimizers(optimizers, chunks, whole_reads)
    bridge = OptimizerBridge(optimizers, reducer=reducer, comm=comm, device=device,
                             scaler=LossScaler(loss_scale) if loss_scale is not None else None, wholes=wholes,
                             chunks=chunks_of)
    placement.setup(PlacementContext(
        optimizer=optimizers[0], device=device, comm=comm, config=config, gather_groups=groups,
        step_chunks=bridge.step_chunks, device_bytes=functools.partial(device_bytes, tuple(chunks), comms), model=model,
    ))
    placement.attach(chunks)  # after the optimizer holds the segments: states created eagerly (Adagrad) move too

    engine = Engine(
        module=model, optimizers=optimizers, chunks=chunks, comm=comm, reduce_comm=reduce_comm, mesh_comms=mesh_comms,
        groups=gather_groups, reducer=reducer, bridge=bridge, strategy=strategy, placement=placement,
        config=config, plugin_hooks=plugins_.manager.hook, device=device,
    )
    if bridge.scaler is not None:
        for opt in optimizers:  # each one's state_dict() carries it: whichever is loaded restores it
            _attach_scaler_state(opt, bridge.scaler)
    comm.stats.end_setup()
    used = sum(c.used for c in chunks)
    size = sum(c.size for c in chunks)
    logger.info("sharded %d parameters into %d chunks (%d elements, %.2f%% padding) over %d rank(s): stage %d, strategy "
                "%r, comm %r, placement %r", sum(len(c.slots) for c in chunks), len(chunks), size,
                100.0 * (size - used) / max(size, 1), comm.world_size, config.stage, config.strategy, comm_cls.name,
                config.placement)
    model._zero_sharded = True  # type: ignore[assignment]  # Module.__setattr__'s stub takes tensors and modules only
    for opt in optimizers:
        opt._zero_sharded = True  # type: ignore[attr-defined]
    return Sharded(adopt(model, engine), optimizer)


def _initial_tier(placement: PlacementPolicy, chunk: Chunk) -> MemoryTier:
    """The policy's ``initial_tier`` for ``chunk``, checked: the device or the host."""
    tier = placement.initial_tier(chunk)
    if tier is not MemoryTier.DEVICE and tier is not MemoryTier.HOST:
        raise PluginContractError(
            f"placement policy {placement.name!r} ({type(placement).__module__}.{type(placement).__qualname__}) "
            f"answered initial_tier(chunk {chunk.index}) with {tier!r}; a master shard is made on the device "
            "(MemoryTier.DEVICE) or in host memory (MemoryTier.HOST). Answer HOST for a shard attach() puts on disk: "
            "it is made in host memory and attach() moves it on"
        )
    return tier


def _optimizers(optimizer: Any, config: ZeroConfig) -> tuple[torch.optim.Optimizer, ...]:
    """The optimizers passed to shard(): one, or a tuple or list of them (see [Note: several optimizers]).

    [Note: several optimizers]
    A recipe may step several optimizers over one model: Muon over the matrices and AdamW over the
    embeddings, norms, biases and head, both built before shard() and passed together. Each parameter
    belongs to at most one of them, and their param groups are numbered across all of them, so a chunk
    never mixes optimizers. Each is re-pointed at the shards and hooked; each ``step()`` is an engine
    step of its own: a lockstep round naming the optimizer (ranks that step different ones raise
    RanksOutOfStepError), its own whole-tensor exchange when it reads whole tensors (owners balanced
    over its parameters), and the kept buffers of its chunks refreshed after it (the engine's step count
    and the plugins' ``zero_after_step`` count each optimizer's step). Stepping only one of them in
    some iteration is therefore what one process does too: the other's parameters keep their
    gradients. An fp16 overflow check runs once per backward, at the first step after it: an
    overflow drops every gradient, so every optimizer skips that iteration, and the scale is updated
    once. ``zero_grad()`` of one optimizer drops the ``no_sync()`` gradients of its own chunks (and of
    parameters in no optimizer), as in one process it zeroes its own parameters' gradients. Placement
    policies see one optimizer (``PlacementContext.optimizer``) and may step chunks early through
    it, so several optimizers need ``placement="device"``. Any other optimizer that holds the model's
    parameters as they were before shard() is refused at its step (see [Note: a whole-tensor
    optimizer zero was not given]).
    """
    several = isinstance(optimizer, (tuple, list))
    optimizers = tuple(optimizer) if several else (optimizer,)
    if not optimizers:
        raise ZeroSetupError("zero_core.shard got an empty tuple of optimizers; pass the optimizer(s) the loop steps")
    if len({id(o) for o in optimizers}) != len(optimizers):
        raise ZeroSetupError("zero_core.shard got the same optimizer twice; pass each optimizer once")
    if any(getattr(o, "_zero_sharded", False) for o in optimizers):
        raise ZeroSetupError("this optimizer was already re-pointed by zero_core.shard; create a new optimizer")
    if len(optimizers) > 1 and config.placement != "device":
        raise ConfigError(
            f"{len(optimizers)} optimizers were passed to zero_core.shard with placement={config.placement!r}, whose "
            "policy sees and steps one optimizer (it may step chunks early or move optimizer states). Use "
            "placement='device', or one optimizer with a param group per setting (an element-wise optimizer can "
            "take every parameter)")
    return optimizers


def _chunks_by_optimizer(optimizers: Sequence[torch.optim.Optimizer], chunks: list[Chunk]) -> list[list[Chunk]]:
    """Each optimizer's chunks (by the param groups numbered across the optimizers); one optimizer has them all."""
    if len(optimizers) == 1:
        return [list(chunks)]
    offsets = [*group_offsets(optimizers), sum(len(o.param_groups) for o in optimizers)]
    return [[c for c in chunks if c.param_group is not None and offsets[i] <= c.param_group < offsets[i + 1]]
            for i in range(len(optimizers))]


def _mesh_comms(chunks: list[Chunk], comm: CommBackend, reduce_comm: CommBackend) -> list[CommBackend]:
    """The chunks' own groups beyond the default two (meshes, see [Note: one group per direction of traffic])."""
    found: list[CommBackend] = []
    for chunk in chunks:
        if chunk.comms is None:
            continue
        g = chunk.comms
        for c in (g.gather, g.reduce, g.reduce_all, g.replicate, g.sub, g.outer, g.everyone):
            if c is not None and c is not comm and c is not reduce_comm and all(c is not f for f in found):
                found.append(c)
    return found


def _check_across_replicas(config: ZeroConfig, plans: Sequence[ChunkPlan], keep: set[int]) -> bool:
    """Whether chunks on meshes with replicas are cut over the replicas too (``shard_optimizer_across_replicas``),
    refusing the settings that layout does not support."""
    if not config.shard_optimizer_across_replicas:  # ZeroConfig checked stage 3 and the "device" placement
        return False
    what = "ZeroConfig(shard_optimizer_across_replicas=True)"
    if keep:
        raise ConfigError(
            f"{what} keeps every shard on the compute device; placement={config.placement!r} moves or keeps chunks "
            "elsewhere. Use placement='device', or switch the option off")
    for plan in plans:
        ranks = list(plan.mesh.ranks)
        if plan.mesh.replicate_ranks > 1 and ranks != sorted(ranks):
            raise ConfigError(
                f"{what} lays shards out over the data-parallel group in rank order, but {plan.mesh} lists its ranks "
                f"out of order ({ranks}); build the mesh with init_device_mesh, whose ranks are in order")
    return True


def _resolve_mesh_group(process_group: Any, mesh: Any) -> Any:
    """The group every rank's control rounds run on: the data-parallel group, from ``process_group`` or ``mesh``."""
    if mesh is None:
        return resolve_group(process_group)
    from torch.distributed.device_mesh import DeviceMesh

    if process_group is not None:
        raise ZeroSetupError("pass either process_group= or mesh= to zero_core.shard, not both (a group is a 1-D mesh)")
    if not isinstance(mesh, DeviceMesh):
        raise ZeroSetupError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; build one with "
            "init_device_mesh('cuda' or 'cpu', (replicate, shard), mesh_dim_names=('replicate', 'shard'))"
        )
    MeshSpec.of_device_mesh(mesh)  # 1-D or 2-D, or a clear error
    if mesh.ndim == 1:
        return mesh.get_group()
    import torch.distributed as dist

    if sorted(mesh.mesh.flatten().tolist()) != list(range(dist.get_world_size())):
        raise ZeroSetupError(
            f"a 2-D mesh must span every rank of the default process group ({dist.get_world_size()} ranks), but it "
            f"holds ranks {sorted(mesh.mesh.flatten().tolist())}; meshes with further (tensor-parallel) dimensions "
            "are not supported"
        )
    return dist.group.WORLD


def _global_rank(comm: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() and comm.world_size > 1 else 0


def _group_ranks(group: Any, comm: Any) -> tuple[int, ...]:
    if group is None or comm.world_size == 1:
        return (_global_rank(comm),)
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))


def _topology(model: nn.Module, group: Any, mesh: Any, module_meshes: Mapping[str, Any] | None, comm: Any) -> Topology:
    """The user's meshes as specs: the model's, and one per named module."""
    if mesh is not None:
        default = MeshSpec.of_device_mesh(mesh)
    else:
        default = MeshSpec((comm.world_size,), _group_ranks(group, comm))
    if not module_meshes:
        return Topology(default)
    if not isinstance(module_meshes, Mapping):
        raise ZeroSetupError(f"module_meshes must map module names to DeviceMeshes, got {type(module_meshes).__name__}")
    names = {name for name, _ in model.named_modules()}
    specs = {}
    for name, value in module_meshes.items():
        if name not in names:
            close = sorted(n for n in names if n and (n.startswith(name) or name.startswith(n)))[:5]
            raise ZeroSetupError(
                f"module_meshes names {name!r}, which is not a module of {type(model).__name__}"
                + (f" (similar: {close})" if close else "") + "; use names from model.named_modules()"
            )
        specs[name] = value if isinstance(value, MeshSpec) else MeshSpec.of_device_mesh(value)
    try:
        return Topology.of(default, specs)
    except ConfigError as err:
        raise ZeroSetupError(str(err)) from None


def _plan(strategy: ShardStrategy, params: list[Any], topology: Topology, config: ZeroConfig, hook: Any) -> ShardPlan:
    """The strategy's plan for ``topology``, validated; a strategy that predates meshes gets the plain call."""
    takes_topology = "topology" in inspect.signature(strategy.plan).parameters
    nontrivial = topology.modules or topology.default.ndim > 1
    if nontrivial and not takes_topology:
        raise ZeroSetupError(
            f"shard strategy {strategy.name!r} plans for one 1-D mesh only (its plan() takes no topology), but "
            f"{'module_meshes' if topology.modules else 'a 2-D mesh'} was given; use a strategy that supports "
            "meshes (chunk, tensor) or a 1-D mesh"
        )
    kwargs = {"topology": topology} if takes_topology else {}
    plan = strategy.plan(params, world_size=topology.default.shard_ranks, config=config, hook=hook, **kwargs)
    if topology.modules and plan.chunk_plans is None:
        raise ZeroSetupError(
            f"shard strategy {strategy.name!r} returned no chunk_plans, so module_meshes would be ignored; it must "
            "give each chunk a ChunkPlan on its module's mesh"
        )
    plan.validate(params, topology.default.shard_ranks, topology)
    return plan


def _default_reshard(config: ZeroConfig, topology: Topology) -> bool | int:
    """The config's ``reshard_after_forward`` for a strategy that gave no chunk plans; a group size the default
    mesh cannot be cut into is rejected here, with what it can be."""
    k, size = config.reshard_after_forward, topology.default.shard_ranks
    if isinstance(k, bool) or (1 < k < size and size % k == 0):
        return k
    raise ZeroSetupError(
        f"reshard_after_forward={k} must divide the shard group of {size} ranks and be smaller than it; "
        f"use one of {[d for d in range(2, size) if size % d == 0] or 'nothing (use True or False)'}"
    )


def _shared_stats(backend: Any, comm: Any) -> Any:
    backend.stats = comm.stats  # one set of counters per engine
    return backend


def _register_dtensor_ops() -> None:
    from zero_core.base._dtensor_ops import register_cross_mesh_stack, register_fused_optimizer_ops

    register_fused_optimizer_ops()
    register_cross_mesh_stack()  # a model on several meshes: torch's clip stacks norms from all of them


def _open_load_source(model: nn.Module, load_from: Any, strict: bool, comm: Any) -> tuple[Any, bool]:
    """The opened ``load_from``, checked against the model before anything is built; and whether it holds
    every parameter (then a lazily built model's initialisers need not run for them)."""
    model_keys = ModelKeys.of(model)  # not sharded yet: names and shapes are the plain model's
    error, source, complete = None, None, False
    try:
        source = open_source(load_from)
        available = set(source.keys())
        check_names(model_keys, {k: source.shape(k) for k in available}, strict=strict, what=source.description,
                    lenient="pass load_strict=False to shard")
        complete = all(model_keys.source_name(names[0], available) is not None for names in model_keys.names.values())
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or the others wait for this one
        error = str(exc) if isinstance(exc, CheckpointError) else f"cannot read {load_from!r} ({exc})"
    raise_if_any_failed(comm, error, "shard(load_from=...) failed; nothing was built")
    return source, complete


def _initial_values(
    model: nn.Module, chunks: list[Chunk], comm: Any, config: ZeroConfig, recording: LazyRecording | None,
    metas: dict[int, torch.Tensor], source: Any, complete: bool,
) -> None:
    """Values for shards that were not packed from real parameters: replayed initialisers, then ``source``."""
    with torch.no_grad():
        if recording is not None:
            materialize(recording, model, chunks, metas, comm=comm, from_rank0=config.sync_module_states,
                        params_loaded=complete)
        if source is not None:
            fill_from_source(ModelKeys.of(model, chunks), source, chunks, comm=comm)
            source.close()
        elif recording is not None:
            for chunk in chunks:
                refresh_kept(chunk, comm)


def _check_reduce_group(reduce_group: Any, group: Any, comm: Any) -> Any:
    """The user's reduce-scatter group, checked to span the data-parallel ranks without being that group."""
    if reduce_group is None or comm.world_size == 1:
        return None
    import torch.distributed as dist

    if reduce_group is group:
        raise ZeroSetupError(
            "reduce_process_group is the data-parallel group itself; reduce-scatters run concurrently with "
            "all-gathers and would interleave differently on each rank. Pass another group over the same ranks: "
            "torch.distributed.new_group(ranks)"
        )
    if not isinstance(reduce_group, dist.ProcessGroup):
        raise ZeroSetupError(
            f"rank {dist.get_rank()} is not a member of reduce_process_group, but it is in the data-parallel group; "
            "build the reduce-scatter group over exactly the data-parallel ranks: torch.distributed.new_group(ranks)"
        )
    ours, theirs = dist.get_process_group_ranks(group), dist.get_process_group_ranks(reduce_group)
    if sorted(ours) != sorted(theirs):
        raise ZeroSetupError(
            f"reduce_process_group spans ranks {theirs} but the data-parallel group spans {ours}; "
            "gradients are reduced over the data-parallel ranks, so build it with torch.distributed.new_group(ranks)"
        )
    return reduce_group


def _new_group_like(group: Any, comm: Any) -> Any:
    """A second process group over the same ranks (collective: every rank calls it), with zero's timeout."""
    if group is None or comm.world_size == 1:
        return group
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks, backend=dist.get_backend(group), timeout=comm.timeout)


def _data_parallel_mesh(group: Any, device: torch.device, comm: Any) -> Any:
    """The 1-D device mesh of the sharded parameters' DTensors; ``None`` in one process without torch.distributed.

    [Note: torch's collectives on a group of their own]
    torch's own collectives over the sharded parameters (the all-reduce of
    ``torch.nn.utils.clip_grad_norm_``, ``full_tensor()``, ``redistribute``) run on the process group of
    the DTensors' mesh. Built over the engine's group, they would pair with zero's lockstep rounds
    whenever ranks differ: one rank clipping while another starts its step paired a float all-reduce
    with the round's int64 one, and gloo aborted the process (``EnforceNotMet ... 8 vs 4``). So the
    mesh gets a group of its own over the same ranks, with zero's ``collective_timeout_s``: a torch
    collective that its peers never join times out there (a ``RuntimeError`` from the backend, inside
    torch), while the peers' next round times out as a ``CollectiveTimeoutError``; nothing aborts.

    One such mesh serves every model sharded over the same ranks with the same timeout: torch
    compares meshes by their ranks and names, not their groups, and caches sharding decisions by
    that, so two equal meshes on different groups could send one rank's collective to the other
    group (a hang, after a rank ran ops its peers did not). A user's ``mesh`` is used as given (its
    groups are the user's; a 1-D one is also the engine's group), so there a lone ``full_tensor()``
    still meets zero's rounds. torch's clip is fronted by a round of its own either way (see [Note: a
    round before torch's clip] in ``zero_core.base._dtensor_ops``), so a rank skipping it fails at once
    on every rank."""
    if group is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    from zero_core.base._dtensor_ops import register_fused_optimizer_ops, register_torch_collective_rounds

    register_fused_optimizer_ops()
    register_torch_collective_rounds()
    key = (_group_ranks(group, comm), device.type, comm.timeout)
    if key not in _DTENSOR_MESHES:  # every rank shards the same models in the same order: hits agree
        _DTENSOR_MESHES[key] = DeviceMesh.from_group(_new_group_like(group, comm), device.type)
    return _DTENSOR_MESHES[key]


# See [Note: torch's collectives on a group of their own]: by (ranks, device type, timeout).
_DTENSOR_MESHES: dict[tuple[Any, ...], Any] = {}


def _repoint_optimizer(optimizer: torch.optim.Optimizer, chunks: list[Chunk]) -> None:
    """Make each param group hold the sharded parameters in place of the originals, in the same order.
    See [Note: optimizer segments].

    Hyperparameters stay as the user set them, group by group, so learning-rate schedulers
    and per-group settings keep working.
    """
    sharded = {id(slot.param): (chunk, seg) for chunk in chunks for slot, seg in zip(chunk.slots, chunk.segments)}
    initial = {id(p): state for p, state in optimizer.state.items()}
    optimizer.state.clear()
    for group in optimizer.param_groups:
        group["params"] = [sharded[id(p)][1].param for p in group["params"]]
    for key, (chunk, seg) in sharded.items():
        state = initial.get(key)
        if not state:
            continue
        # eagerly initialised (Adagrad): each sharded parameter takes its rows of the parameter's state
        slot = chunk.slots[seg.slot]
        device = seg.local.device

        def piece(key: str, value: torch.Tensor, slot=slot, device=device, i=seg.slot, chunk=chunk) -> torch.Tensor:
            if value.shape != slot.shape or key == "step":  # a step count, even of a zero-dimensional parameter
                return value.clone()
            return chunk.wrap(i, slot.local_of(value, chunk.rank).to(device, copy=True).contiguous())

        optimizer.state[seg.param] = {k: piece(k, v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _attach_scaler_state(optimizer: torch.optim.Optimizer, scaler: LossScaler) -> None:
    """Make the loss scaler's state part of the optimizer's state dict (saved and restored with it)."""

    def save(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict[LossScaler.STATE_KEY] = scaler.state_dict()
        return state_dict

    def load(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict = dict(state_dict)
        saved = state_dict.pop(LossScaler.STATE_KEY, None)
        if saved is not None:
            scaler.load_state_dict(saved)
        return state_dict

    optimizer.register_state_dict_post_hook(save)
    optimizer.register_load_state_dict_pre_hook(load)


def _whole_steps(optimizer: torch.optim.Optimizer, chunks: list[Chunk], comm: CommBackend, device: torch.device,
                 config: ZeroConfig, mesh_comms: Any) -> WholeTensorSteps:
    """Whole-tensor steps (see [Note: whole-tensor optimizer steps]), where their layout holds."""
    name = type(optimizer).__name__
    if config.placement != "device":
        raise ConfigError(
            f"{name} is stepped whole on one rank per parameter (optimizer_updates='whole'), which needs the shards "
            f"on the device; placement={config.placement!r} keeps or steps them elsewhere. Use placement='device', "
            "or an element-wise optimizer with offload")
    if mesh_comms or any(c.plan.mesh.replicate_ranks > 1 or c.world_size != comm.world_size for c in chunks):
        raise ConfigError(
            f"{name} is stepped whole on one rank per parameter (optimizer_updates='whole'), which zero runs over one "
            "data-parallel group; this model has replicas (HSDP) or module meshes. Shard over one group, or use an "
            "element-wise optimizer")
    return WholeTensorSteps(optimizer, chunks, comm=comm, device=device)
