"""Setup-time checks and helpers: process group, optimizer, parameter order, cross-rank agreement."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from zero_core.base.errors import ConfigError, RanksDisagreeError, ZeroSetupError
from zero_core.chunks.chunk import ParamInfo
from zero_core.comm._agreement import gather_objects, rank0_value
from zero_core.comm.backend import CommBackend
from zero_core.config.api import ZeroConfig

__all__ = [
    "check_ranks_agree",
    "collect_params",
    "cuda_index",
    "first_use_order",
    "optimizer_updates",
    "resolve_device",
    "resolve_group",
    "whole_reads",
]


def resolve_group(process_group: Any) -> Any:
    """The process group to shard over; ``None`` means a single process."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    env_world = os.environ.get("WORLD_SIZE", "1")
    if env_world.isdigit() and int(env_world) > 1:
        raise ZeroSetupError(
            f"WORLD_SIZE is {env_world} but torch.distributed is not initialised. Call "
            "torch.distributed.init_process_group(backend='gloo' (CPU) or 'nccl' (CUDA), timeout=...) "
            "on every rank before zero_core.shard."
        )
    return None


def cuda_index(local_rank: str | None, current: int, count: int) -> int:
    """The GPU of this process: the current device, or ``LOCAL_RANK``'s when the current one is still the default 0.

    torchrun numbers the processes of each node with ``LOCAL_RANK`` (``RANK`` counts over all
    nodes); a script that never calls ``torch.cuda.set_device`` would put every process of a node
    on GPU 0. With one visible GPU per process (``CUDA_VISIBLE_DEVICES``) this is 0 again."""
    if current != 0 or local_rank is None or count < 1:
        return current
    return int(local_rank) % count


def resolve_device(config: ZeroConfig) -> torch.device:
    if config.device is not None:
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ZeroSetupError("ZeroConfig.device asks for CUDA but torch.cuda.is_available() is False; use device='cpu'")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", _local_cuda())
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", _local_cuda())
    return torch.device("cpu")


def _local_cuda() -> int:
    index = cuda_index(os.environ.get("LOCAL_RANK"), torch.cuda.current_device(), torch.cuda.device_count())
    if index != torch.cuda.current_device():
        torch.cuda.set_device(index)  # NCCL's own calls (barriers, object collectives) use the current device
    return index


# torch's optimizers whose update of an element reads only that element's gradient and state (and scalars).
_ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
# Optimizers (by class name, anywhere in the class's MRO: torch's, transformers', third-party ports) whose update
# of a parameter reads the whole tensor: zero steps them whole, on one owner rank (see zero_core.runtime._whole_step).
_WHOLE = {"Muon": "orthogonalises each matrix's update (Newton-Schulz)",
          "Adafactor": "factors each matrix's second moment into row and column statistics",
          "Lamb": "scales each tensor's update by a trust ratio of whole-tensor norms",
          "LAMB": "scales each tensor's update by a trust ratio of whole-tensor norms",
          "Lars": "scales each tensor's update by a trust ratio of whole-tensor norms",
          "LARS": "scales each tensor's update by a trust ratio of whole-tensor norms",
          "Shampoo": "preconditions each matrix with statistics of its rows and columns",
          "SOAP": "preconditions each matrix with statistics of its rows and columns"}
# Optimizers whose update reads every parameter at once: no layout of pieces or owners gives them what they read.
_GLOBAL = {"LBFGS": "searches along the whole parameter vector with a closure"}


def whole_reads(optimizer: torch.optim.Optimizer) -> str | None:
    """What a known whole-tensor optimizer class reads (``None`` for any other class)."""
    return next((_WHOLE[c.__name__] for c in type(optimizer).__mro__ if c.__name__ in _WHOLE), None)


def optimizer_updates(optimizer: torch.optim.Optimizer, config: ZeroConfig) -> str:
    """How zero steps this optimizer: ``"elementwise"`` (each rank its pieces) or ``"whole"`` (each parameter whole,
    on its owner rank); raises for one it cannot step or cannot classify.

    See ``ZeroConfig.optimizer_updates`` and [Note: whole-tensor optimizer steps] in ``zero_core.runtime._whole_step``."""
    name = type(optimizer).__name__
    mro = [c.__name__ for c in type(optimizer).__mro__]
    global_ = next((_GLOBAL[c] for c in mro if c in _GLOBAL), None)
    if global_ is not None:
        raise ConfigError(
            f"{name} {global_}, which no sharded layout gives it: zero cannot run it. Use an element-wise optimizer "
            "(torch.optim.AdamW, SGD, ...) or a whole-tensor one (torch.optim.Muon, Adafactor)")
    whole = whole_reads(optimizer)
    if whole is not None and config.optimizer_updates == "elementwise":
        raise ConfigError(
            f"ZeroConfig(optimizer_updates='elementwise') declares {name} element-wise, but it {whole}: stepped on "
            "each rank's pieces it would train another model. Leave optimizer_updates='auto' (or 'whole'): zero then "
            "steps each parameter whole on one rank")
    if config.optimizer_updates != "auto":
        return config.optimizer_updates
    if whole is not None:
        return "whole"
    if any(isinstance(optimizer, known) for cls in _ELEMENTWISE if (known := getattr(torch.optim, cls, None)) is not None):
        return "elementwise"
    raise ConfigError(
        f"zero cannot tell whether {type(optimizer).__module__}.{name} updates each element of a parameter from that "
        "element's gradient and state alone (Adam, SGD, Lion, ...: each rank steps its pieces) or reads whole "
        "tensors (Muon, Shampoo, LAMB's trust ratio, Adafactor: each parameter is stepped whole on one rank). "
        "Declare it: ZeroConfig(optimizer_updates='elementwise') or ZeroConfig(optimizer_updates='whole')")


def group_offsets(optimizers: Sequence[torch.optim.Optimizer]) -> list[int]:
    """Where each optimizer's param groups begin in the numbering across all of them (see :func:`collect_params`)."""
    offsets, at = [], 0
    for optimizer in optimizers:
        offsets.append(at)
        at += len(optimizer.param_groups)
    return offsets


def collect_params(model: nn.Module, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> list[ParamInfo]:
    """The model's unique parameters in registration order, each with its optimizer group.

    With several optimizers a parameter's group is numbered across all of them, in order (the first
    optimizer's groups, then the second's, ...; see :func:`group_offsets`), so chunks never mix
    optimizers. Raises :class:`ZeroSetupError` when an optimizer holds a tensor that is not one of
    the model's parameters, a parameter is in two optimizers, an optimizer already has state, or
    the model has nothing to shard.
    """
    if not isinstance(model, nn.Module):
        raise ZeroSetupError(f"zero_core.shard needs an nn.Module, got {type(model).__name__}")
    optimizers = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ZeroSetupError(
                f"zero_core.shard needs a torch.optim.Optimizer (or a tuple or list of them), got "
                f"{type(optimizer).__name__}; build it with e.g. torch.optim.AdamW(model.parameters())"
            )
    named = list(model.named_parameters(remove_duplicate=True))
    if not named:
        raise ZeroSetupError(f"{type(model).__name__} has no parameters to shard")
    by_id = {id(p): name for name, p in named}
    group_of: dict[int, int] = {}
    optimizer_of: dict[int, int] = {}
    several = len(optimizers) > 1
    offsets = group_offsets(optimizers)
    for o, optimizer in enumerate(optimizers):
        which = f"optimizer {o} ({type(optimizer).__name__}) " if several else "optimizer "
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) not in by_id:
                    raise ZeroSetupError(
                        f"{which}param group {g}, parameter {i} (shape {tuple(p.shape)}) is not a parameter of the "
                        "model being sharded; build the optimizer from this model's parameters"
                    )
                if optimizer_of.get(id(p), o) != o:
                    first = optimizer_of[id(p)]
                    raise ZeroSetupError(
                        f"parameter {by_id[id(p)]!r} is in optimizer {first} ({type(optimizers[first]).__name__}) "
                        f"and in optimizer {o} ({type(optimizer).__name__}); each parameter may be stepped by one "
                        "optimizer only: split the parameters between them (e.g. matrices to Muon, the rest to AdamW)"
                    )
                group_of[id(p)] = offsets[o] + g
                optimizer_of[id(p)] = o
    # Eagerly initialised state (Adagrad's accumulators, with step 0) is carried over to the shards;
    # state of an optimizer that already stepped is not.
    states = [state for optimizer in optimizers for state in optimizer.state.values()]
    if any(isinstance(v, torch.Tensor) and v.device.type == "meta" for state in states for v in state.values()):
        raise ZeroSetupError(
            "the optimizer created its state eagerly on the meta parameters of a lazily built model (Adagrad does), "
            "and those values cannot be replayed; build such a model eagerly, or use an optimizer that creates "
            "its state at the first step (SGD, Adam, AdamW, RMSprop, ...)"
        )
    if any(state and float(state.get("step", 1)) > 0 for state in states):
        raise ZeroSetupError(
            "the optimizer already has state (it has stepped); create the optimizer fresh and call "
            "zero_core.shard before the first optimizer.step()"
        )
    for name, p in named:
        if not p.is_floating_point():
            raise ZeroSetupError(f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters can be sharded")
    return [ParamInfo(name, p, group_of.get(id(p))) for name, p in named]


def first_use_order(model: nn.Module, params: Sequence[ParamInfo], example_inputs: Any, comm: CommBackend, *,
                    meta: bool = False) -> list[ParamInfo]:
    """``params`` reordered by the first forward's use (rank 0's order, so every rank agrees).

    Runs one forward on ``example_inputs`` without gradients, recording the order in which
    modules run; each module's own parameters count as used when it starts. Parameters
    the forward did not touch keep their registration order at the end.
    """
    order: list[int] = []
    seen: set[int] = set()
    index = {id(p.param): i for i, p in enumerate(params)}

    def record(module: nn.Module, args: Any) -> None:
        for p in module.parameters(recurse=False):
            if id(p) in index and id(p) not in seen:
                seen.add(id(p))
                order.append(index[id(p)])

    # The model is not on the compute device yet (shard() moves it after choosing the order), while the
    # example is usually a batch already there; a lazily built model runs on meta tensors: shapes only.
    where = torch.device("meta") if meta else next((p.param.device for p in params), None)
    if where is not None:
        example_inputs = tree_map(lambda v: v.to(where) if isinstance(v, torch.Tensor) else v, example_inputs)
    handles = [m.register_forward_pre_hook(record) for m in model.modules()]
    try:
        with torch.no_grad():
            if isinstance(example_inputs, dict):
                model(**example_inputs)
            elif isinstance(example_inputs, tuple):
                model(*example_inputs)
            else:
                model(example_inputs)
    except Exception as exc:
        if not meta:
            raise
        raise ZeroSetupError(
            f"ChunkPolicy(param_order='first_use') runs one forward to record the order, which failed on the meta "
            f"tensors of a lazily built model ({type(exc).__name__}: {exc}); use param_order='registration'"
        ) from exc
    finally:
        for h in handles:
            h.remove()
    order += [i for i in range(len(params)) if i not in set(order)]
    order = rank0_value(comm, order)
    return [params[i] for i in order]


def _signature(params: Sequence[ParamInfo], config: ZeroConfig) -> list[str]:
    lines = [f"config {config!r}"]
    lines += [f"param {p.name} shape={tuple(p.param.shape)} dtype={p.param.dtype} "
              f"requires_grad={p.param.requires_grad} group={p.param_group}" for p in params]
    return lines


def check_ranks_agree(params: Sequence[ParamInfo], config: ZeroConfig, comm: CommBackend) -> None:
    """Fail on every rank, with the first difference, when ranks hold different models or configs."""
    if comm.world_size <= 1:
        return
    lines = _signature(params, config)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    digests = gather_objects(comm, digest)
    if len(set(digests)) == 1:
        return
    every = gather_objects(comm, lines)
    reference = every[0]
    for rank, theirs in enumerate(every):
        if theirs == reference:
            continue
        for i in range(max(len(theirs), len(reference))):
            a = reference[i] if i < len(reference) else "<nothing>"
            b = theirs[i] if i < len(theirs) else "<nothing>"
            if a != b:
                raise RanksDisagreeError(
                    f"rank {rank} holds a different model or config than rank 0 "
                    f"({len(theirs) - 1} vs {len(reference) - 1} entries); first difference:\n"
                    f"  rank 0:    {a}\n  rank {rank}: {b}\n"
                    "Build the same model with the same config on every rank."
                )
    raise RanksDisagreeError("ranks disagree on the model or config")  # unreachable in practice


