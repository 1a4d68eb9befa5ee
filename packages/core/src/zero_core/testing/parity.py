"""Train a zoo model sharded on N ranks or in one process, and compare the two runs.

:func:`train_sharded` runs on every rank (inside :func:`~zero_core.testing.run_distributed`);
each rank takes its slice of the same global batch. :func:`train_reference` trains the
same model in one process with plain PyTorch. With a mean loss, the mean over ranks of
the ranks' gradients equals the whole batch's gradient, so in fp32 the two runs must
agree up to floating-point reassociation: :func:`assert_parity` checks losses and
final parameters.

[Note: the 16-bit reference]
A 16-bit run cannot be compared with a one-batch fp32 run: rounding differs by far
more than any bug would. So for 16-bit compute the reference follows the same casting
rules in one process: fp32 master parameters and optimizer; for each rank's slice of
the batch, a 16-bit copy of the model (own buffers, like a rank's) computes the loss
and the 16-bit gradients (the loss multiplied by the loss scale first); the ranks'
gradients are cast to the reduce dtype, summed in rank order, cast to fp32 and divided
by ``world_size x scale``; a non-finite gradient skips the step. Run with a rank's
thread count, the reference then reproduces the sharded run bit for bit on this
machine's CPU kernels; the tests still allow 1e-3 (relative to each tensor's largest
magnitude) so that a kernel whose summation order depends on memory alignment cannot
fail them, while a broken casting rule (a gradient summed in 16 bits, a missing
unscale, a master rounded to 16 bits) is off by far more.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

from zero_core._clip import clip_grad_norm_
from zero_core._shard import shard
from zero_core.config.api import ChunkPolicy, Precision, ZeroConfig
from zero_core.runtime._scaler import LossScaler
from zero_core.setup._setup import resolve_device
from zero_core.testing.distributed import device_under_test, rank_device, threads_per_rank
from zero_core.testing.zoo import ZooCase, get_case

__all__ = ["RunResult", "assert_parity", "make_optimizer", "train_reference", "train_sharded", "train_zoo_sharded"]

SEED = 1234


@dataclass
class RunResult:
    """What a training run produced (per rank for sharded runs)."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    step_stats: list[dict[str, dict[str, int]]] = field(default_factory=list)
    model_state_bytes: dict[str, int] = field(default_factory=dict)
    chunks: list[dict[str, Any]] = field(default_factory=list)
    #: The gather groups, as lists of chunk indices (one per chunk unless the plan declares groups).
    groups: list[list[int]] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    #: The placement policy's ``report()`` (tiers, moves, budgets), for policies that have one.
    placement: dict[str, Any] = field(default_factory=dict)
    #: Per chunk: (mesh shape, this rank's (replicate, shard) coordinates, sha256 of its master shard's bytes).
    shards: list[tuple[tuple[int, ...], tuple[int, int], str]] = field(default_factory=list)
    #: Passes that replayed a repeated gather sequence (see [Note: replaying a repeated gather sequence]).
    replayed_passes: int = 0


def make_optimizer(case: ZooCase, model: torch.nn.Module, name: str = "adamw", lr: float = 1e-3) -> torch.optim.Optimizer:
    groups: Any = case.param_groups(model) if case.param_groups else [p for p in model.parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if name == "adamw_fused":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=0.01, fused=True)
    if name == "adam_foreach":
        return torch.optim.Adam(groups, lr=lr, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    if name == "sgd_fused":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, fused=True)
    if name == "adagrad":
        return torch.optim.Adagrad(groups, lr=lr * 10)
    if name == "adagrad_fused":
        return torch.optim.Adagrad(groups, lr=lr * 10, fused=True)
    if name == "adafactor":  # factored moments: stepped whole on each parameter's owner rank
        return torch.optim.Adafactor(groups, lr=lr * 10, weight_decay=0.01)
    raise ValueError(
        f"unknown optimizer {name!r}; use adamw, adamw_fused, adam, adam_foreach, sgd, sgd_fused, adagrad, "
        "adagrad_fused or adafactor"
    )


def _build(case: ZooCase) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return case.build()


def train_reference(case_name: str, *, steps: int = 4, batch_size: int = 8, optimizer: str = "adamw",
                    lr: float = 1e-3, clip: float | None = None, norm_type: float = 2.0,
                    precision: Precision | None = None, world: int = 1) -> RunResult:
    """One process, plain PyTorch (``torch.nn.utils.clip_grad_norm_`` when clipping).

    In the parameters' dtype: the whole global batch at once. With 16-bit compute:
    ``world`` simulated ranks, see [Note: the 16-bit reference].
    """
    if precision is not None and precision.compute is not None:
        # Match a rank's thread count: a CPU kernel's summation order depends on it, and one 16-bit
        # rounding that falls the other way shows in every later step.
        threads = torch.get_num_threads()
        torch.set_num_threads(threads_per_rank(world))
        try:
            return _train_reference_16bit(case_name, steps=steps, batch_size=batch_size, optimizer=optimizer, lr=lr,
                                          clip=clip, norm_type=norm_type, precision=precision, world=world)
        finally:
            torch.set_num_threads(threads)
    case = get_case(case_name)
    device = rank_device()  # where the ranks compute: kernels, and 16-bit rounding, differ by device
    model = _build(case).to(device)
    opt = make_optimizer(case, model, optimizer, lr)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        inputs, targets = (t.to(device) for t in case.batch(step, batch_size))
        loss = case.loss(model(inputs), targets)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type).item())
        opt.step()
        losses.append(loss.item())
    params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return RunResult(losses, params, norms=norms)


def _train_reference_16bit(case_name: str, *, steps: int, batch_size: int, optimizer: str, lr: float,
                           clip: float | None, norm_type: float, precision: Precision, world: int) -> RunResult:
    case = get_case(case_name)
    compute, reduce = precision.compute, precision.reduce
    assert isinstance(compute, torch.dtype) and isinstance(reduce, torch.dtype)
    device = rank_device()  # where the ranks compute: kernels, and 16-bit rounding, differ by device
    master = _build(case).to(device)
    opt = make_optimizer(case, master, optimizer, lr)
    replicas = [copy.deepcopy(master).to(compute) for _ in range(world)]
    scaler = LossScaler(precision.loss_scale) if precision.loss_scale is not None else None
    named = [(n, p) for n, p in master.named_parameters() if p.requires_grad]
    local = batch_size // world
    losses, norms, scales = [], [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        inputs, targets = (t.to(device) for t in case.batch(step, batch_size))
        scale = scaler.scale if scaler is not None else 1.0
        loss_sum = torch.zeros((), device=device)
        for rank, replica in enumerate(replicas):
            with torch.no_grad():
                for (_, p), q in zip(master.named_parameters(), replica.parameters()):
                    q.copy_(p)
                    q.grad = None
            x, y = inputs[rank * local:(rank + 1) * local], targets[rank * local:(rank + 1) * local]
            if x.is_floating_point():
                x = x.to(compute)
            loss = case.loss(replica(x), y)
            (loss.float() * scale if scaler is not None else loss).backward()
            loss_sum += loss.detach()
        replica_params = [dict(r.named_parameters()) for r in replicas]
        for name, p in named:
            grads = [rp[name].grad for rp in replica_params]
            if all(g is None for g in grads):
                continue
            summed = torch.stack([(g if g is not None else torch.zeros_like(rp[name])).to(reduce)
                                  for g, rp in zip(grads, replica_params)]).sum(0)
            grad = summed.to(p.dtype)
            if world * scale != 1.0:
                grad = grad.div_(world * scale)
            p.grad = grad
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_([p for _, p in named], clip, norm_type).item())
        if scaler is not None:
            overflow = any(not torch.isfinite(p.grad).all() for _, p in named if p.grad is not None)
            if overflow:
                opt.zero_grad(set_to_none=True)
            scales.append(scaler.scale)
            scaler.update(overflow)
        opt.step()
        losses.append((loss_sum / world).item())
    params = {n: p.detach().cpu().clone() for n, p in master.named_parameters()}
    return RunResult(losses, params, norms=norms, scales=scales)


def train_sharded(case_name: str, *, config: ZeroConfig | None = None, steps: int = 4, batch_size: int = 8,
                  optimizer: str = "adamw", lr: float = 1e-3, micro_batches: int = 1, clip: float | None = None,
                  norm_type: float = 2.0, no_sync: bool = True, reduce_process_group: Any = None,
                  plugins: Sequence[object] = (), mesh_shape: tuple[int, ...] | None = None,
                  module_meshes: dict[str, tuple[int, ...]] | None = None, clip_with: str = "zero",
                  after_step: Callable[[torch.nn.Module, int], None] | None = None) -> RunResult:
    """Run on every rank: shard the zoo model, train on this rank's slice of each global batch.

    With ``micro_batches > 1`` the slice is split and all but the last micro-batch run
    inside ``model.no_sync()`` (or, with ``no_sync=False``, each reduces its own
    gradients), each loss scaled so the sum equals the slice's mean loss.
    With ``clip`` the gradients are clipped by :func:`zero_core.clip_grad_norm_` (``clip_with="torch"``:
    by ``torch.nn.utils.clip_grad_norm_`` over ``model.parameters()``).
    ``reduce_process_group`` and ``plugins`` are passed to :func:`zero_core.shard`;
    ``mesh_shape`` (and each shape of ``module_meshes``) becomes a CPU device mesh,
    ``(replicate, shard)`` for two dimensions. ``after_step(model, step)`` runs after each optimizer step (work
    between steps: an evaluation, a weight sync); it must be a module-level function.
    """
    case = get_case(case_name)
    config = config or ZeroConfig(chunk=ChunkPolicy(chunk_size=case.chunk_size))
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if batch_size % world:
        raise ValueError(f"global batch {batch_size} must divide evenly over {world} ranks")
    local = batch_size // world
    built = _build(case)
    device = resolve_device(config)
    example = case.batch(0, batch_size)[0][:local].to(device) if config.chunk.param_order == "first_use" else None
    meshes = {}
    if mesh_shape is not None:
        meshes["mesh"] = _device_mesh(mesh_shape)
    if module_meshes:
        meshes["module_meshes"] = {name: _device_mesh(shape) for name, shape in module_meshes.items()}
    model, opt = shard(built, make_optimizer(case, built, optimizer, lr), config=config, example_inputs=example,
                       reduce_process_group=reduce_process_group, plugins=plugins, **meshes)
    if local % micro_batches:
        raise ValueError(f"{local} samples per rank do not split into {micro_batches} micro-batches")
    micro = local // micro_batches
    module = cast(torch.nn.Module, model)  # the same object: a ZeroModule is also the model's own nn.Module class
    losses, norms, scales = [], [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        inputs, targets = case.batch(step, batch_size)
        inputs = inputs[rank * local:(rank + 1) * local].to(device)
        targets = targets[rank * local:(rank + 1) * local].to(device)
        loss = torch.zeros((), device=device)
        for m in range(micro_batches):
            part = slice(m * micro, (m + 1) * micro)
            context = model.no_sync() if no_sync and m < micro_batches - 1 else contextlib.nullcontext()
            with context:
                micro_loss = case.loss(model(inputs[part]), targets[part]) / micro_batches
                model.backward(micro_loss)
            loss += micro_loss.detach()
        if clip is not None and clip_with == "torch":  # the user's own call, on the sharded parameters
            norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), clip, norm_type)))
        elif clip is not None:
            norms.append(clip_grad_norm_(model, clip, norm_type))
        if model.loss_scaler is not None:
            scales.append(model.loss_scaler.scale)
        opt.step()
        if after_step is not None:
            after_step(module, step)
        reported = loss.detach().clone()
        if world > 1:  # reporting only: not part of the engine's counted traffic
            dist.all_reduce(reported)
            reported /= world
        losses.append(reported.item())
    engine = model.engine
    result = RunResult(
        losses=losses,
        params={name: value.cpu() for name, value in model.full_parameters().items()},
        step_stats=[engine.comm.stats.summary(s) for s in engine.comm.stats.steps],
        model_state_bytes=model.model_state_bytes(),
        chunks=[{"size": c.size, "used": c.used, "requires_grad": c.requires_grad, "params": len(c.slots),
                 # real (not padding) elements of each rank's shard: torch.chunk pieces, see [Note: chunk layout]
                 "real": [sum(s.local_numel(r) for s in c.slots) for r in range(c.world_size)],
                 # a parameter cut along a later dimension (see [Note: shard dimension] in zero_core.chunks._slots)
                 "strided": c.layout.strided}
                for c in engine.chunks],
        groups=[[c.index for c in g.chunks] for g in engine.groups],
        replayed_passes=engine.residency.scheduler.replayed_passes,
        norms=norms,
        scales=scales,
        placement=engine.placement.report() if hasattr(engine.placement, "report") else {},
        shards=[(c.plan.mesh.shape if c.plan is not None else (c.world_size,),
                 (c.comms.replicate_rank, c.comms.shard_rank) if c.comms is not None else (0, c.rank),
                 # what a shard group gathers from, the same in every replica (a group shard, when cut over replicas)
                 hashlib.sha256((c.shard if c.group_shard is None else c.group_shard).detach().cpu().contiguous()
                                .view(torch.uint8).numpy().tobytes()).hexdigest())
                for c in engine.chunks],
    )
    engine.close()
    return result


def _device_mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh(device_under_test(), tuple(shape), mesh_dim_names=names)


def train_zoo_sharded(cases: list[str], *, config: ZeroConfig | None = None, **kwargs: Any) -> dict[str, RunResult]:
    """:func:`train_sharded` on each zoo case in turn, in one process group (each case's own chunk size)."""
    results = {}
    for name in cases:
        case_config = None
        if config is not None:
            case_config = config.replace(chunk=ChunkPolicy(chunk_size=get_case(name).chunk_size))
        results[name] = train_sharded(name, config=case_config, **kwargs)
        results[name].step_stats = []  # keep the pickled result small
    return results


def assert_parity(reference: RunResult, sharded: RunResult, *, rtol: float = 1e-5, label: str = "") -> None:
    """Losses and parameters agree within ``rtol``, relative to each tensor's largest magnitude.

    A tolerance relative to the tensor's scale rather than to each element: elements near
    zero (fresh biases, padding-adjacent values) would otherwise demand exact equality
    from sums computed in a different order.
    """
    assert len(reference.losses) == len(sharded.losses), (reference.losses, sharded.losses)
    for step, (a, b) in enumerate(zip(reference.losses, sharded.losses)):
        assert abs(a - b) <= rtol * max(abs(a), 1e-12), f"{label} step {step}: loss {b!r} vs reference {a!r}"
    assert reference.params.keys() == sharded.params.keys(), (
        sorted(set(reference.params) ^ set(sharded.params)))
    for name, ref in reference.params.items():
        got = sharded.params[name]
        assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
        scale = ref.abs().max().item()
        err = (got - ref).abs().max().item()
        assert err <= rtol * max(scale, 1e-12), f"{label} {name}: max error {err:.3g} exceeds {rtol} x {scale:.3g}"
    assert len(reference.norms) == len(sharded.norms), (reference.norms, sharded.norms)
    for step, (a, b) in enumerate(zip(reference.norms, sharded.norms)):
        assert abs(a - b) <= rtol * max(abs(a), 1e-12), f"{label} step {step}: gradient norm {b!r} vs reference {a!r}"
    assert reference.scales == sharded.scales, f"{label} loss scales {sharded.scales} vs reference {reference.scales}"
