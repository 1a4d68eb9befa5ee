"""The public verb: :func:`shard`."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any, NamedTuple

import torch
from torch import nn

from zero_core._agreement import raise_if_any_failed
from zero_core._engine import Engine
from zero_core._layout import ModelLayout, check_names, fill_from_source, publish_kept
from zero_core._lazy import LazyRecording, find_recording, release_if_unused
from zero_core._materialize import materialize
from zero_core._module import ZeroModule, adopt
from zero_core._plugins import ZeroPlugins
from zero_core._scaler import LossScaler
from zero_core._setup import check_ranks_agree, collect_params, first_use_order, resolve_device, resolve_group
from zero_core._sources import open_source
from zero_core.api import ZeroConfig
from zero_core.chunk import BufferPool, Chunk
from zero_core.errors import CheckpointError, ConfigError, ZeroSetupError
from zero_core.placement import PlacementContext

__all__ = ["Sharded", "shard"]


class Sharded(NamedTuple):
    """What :func:`shard` returns: train ``model`` and step ``optimizer`` as usual."""

    model: ZeroModule
    optimizer: torch.optim.Optimizer


def shard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    config: ZeroConfig | None = None,
    process_group: Any = None,
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
            It is re-pointed, in place, at this rank's parameter shards and returned.
        config: What to build; defaults to ``ZeroConfig()`` (chunked ZeRO-3 on the compute device).
        process_group: The data-parallel group; default: the world group, or a single
            process when ``torch.distributed`` is not initialised.
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
        ``(model, optimizer)``: use them in an ordinary loop (forward, ``loss.backward()``,
        ``optimizer.step()``, ``optimizer.zero_grad()``).
    """
    config = ZeroConfig() if config is None else config
    if not isinstance(config, ZeroConfig):
        raise ConfigError(f"config must be a zero_core.ZeroConfig, got {type(config).__name__}")
    if isinstance(model, ZeroModule) or getattr(model, "_zero_sharded", False):
        raise ZeroSetupError("this model is already sharded by zero_core.shard; wrap the original model only once")
    if getattr(optimizer, "_zero_sharded", False):
        raise ZeroSetupError("this optimizer was already re-pointed by zero_core.shard; create a new optimizer")
    params = collect_params(model, optimizer)
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

    group = resolve_group(process_group)
    plugins_ = ZeroPlugins.load(plugins)
    plugins_.manager.hook.zero_configure.call_historic(kwargs={"config": config})
    strategy = plugins_.strategies.get(config.strategy)()
    comm_cls = plugins_.comm_backends.get(config.comm or strategy.comm)
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
    plan = strategy.plan(params, world_size=comm.world_size, config=config, hook=plugins_.manager.hook)
    plan.validate(params, comm.world_size)

    groups = tuple(tuple(g) for g in plan.gather_groups) if plan.gather_groups else tuple((i,) for i in range(len(plan.chunks)))
    keep = placement.keep_gathered(plan.chunks, groups) if config.stage == 3 else set()
    chunks = []
    pool = BufferPool()
    mesh = _data_parallel_mesh(group, device)
    for index, spec in enumerate(plan.chunks):
        chunk = Chunk(index, spec, rank=comm.rank, world_size=comm.world_size, device=device, pool=pool,
                      stage=config.stage, compute_dtype=config.precision.compute,
                      reduce_dtype=config.precision.reduce,
                      gradient_predivide_factor=config.precision.gradient_predivide_factor, keep_gathered=index in keep, mesh=mesh)
        if recording is None:
            chunk.pack(comm, broadcast_from_rank0=config.sync_module_states)
        else:
            chunk.begin_fill()
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
                if config.sync_module_states and comm.world_size > 1:
                    comm.broadcast(buf, src=0)
                module._buffers[name] = buf
    _repoint_optimizer(optimizer, chunks)
    engines: list[Engine] = []  # the context's callables reach the engine built below
    placement.setup(PlacementContext(
        optimizer=optimizer, device=device, comm=comm, config=config, groups=groups,
        step_chunks=lambda cs: engines[0].step_chunks(cs), device_bytes=lambda: engines[0].device_bytes(),
    ))
    placement.attach(chunks)  # after the optimizer holds the segments: states created eagerly (Adagrad) move too

    engine = Engine(
        module=model, optimizer=optimizer, chunks=chunks, gather_groups=plan.gather_groups, comm=comm, reduce_comm=reduce_comm, strategy=strategy,
        placement=placement, config=config, hook=plugins_.manager.hook, device=device,
    )
    engines.append(engine)
    if engine.scaler is not None:
        _attach_scaler_state(optimizer, engine.scaler)
    comm.stats.end_setup()
    model._zero_sharded = True  # type: ignore[attr-defined]
    optimizer._zero_sharded = True  # type: ignore[attr-defined]
    return Sharded(adopt(model, engine), optimizer)


def _open_load_source(model: nn.Module, load_from: Any, strict: bool, comm: Any) -> tuple[Any, bool]:
    """The opened ``load_from``, checked against the model before anything is built; and whether it holds
    every parameter (then a lazily built model's initialisers need not run for them)."""
    layout = ModelLayout.of(model)  # not sharded yet: names and shapes are the plain model's
    error, source, complete = None, None, False
    try:
        source = open_source(load_from)
        available = set(source.keys())
        check_names(layout, {k: source.shape(k) for k in available}, strict=strict, what=source.description,
                    lenient="pass load_strict=False to shard")
        complete = all(layout.source_name(names[0], available) is not None for names in layout.names.values())
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
            fill_from_source(ModelLayout.of(model, chunks), source, chunks, comm=comm)
            source.close()
        elif recording is not None:
            for chunk in chunks:
                publish_kept(chunk, comm)


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


def _data_parallel_mesh(group: Any, device: torch.device) -> Any:
    """The 1-D device mesh of the sharded parameters' DTensors; ``None`` in one process without torch.distributed."""
    if group is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    from zero_core._dtensor_ops import register_fused_optimizer_ops

    register_fused_optimizer_ops()
    return DeviceMesh.from_group(group, device.type)


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
        lo, hi = chunk.held_range(seg.slot)
        device = seg.local.device

        def piece(key: str, value: torch.Tensor, slot=slot, lo=lo, hi=hi, device=device, i=seg.slot, chunk=chunk) -> torch.Tensor:
            if value.shape != slot.shape or key == "step":  # a step count, even of a zero-dimensional parameter
                return value.clone()
            return chunk.wrap(i, value.reshape(-1)[lo:hi].to(device, copy=True).view(slot.local_shape(chunk.rank)))

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
