"""HuggingFace Accelerate's custom training loops under zero: :func:`prepare`.

A loop written for ``Accelerator`` keeps every line; only the ``prepare`` call changes::

    accelerator = Accelerator(gradient_accumulation_steps=4)
    model, optimizer, loader, scheduler = zero_integrations.accelerate.prepare(
        accelerator, model, optimizer, loader, scheduler, config=ZeroConfig(stage=3))
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    accelerator.save_state("ckpt")          # every rank; a resume: accelerator.load_state("ckpt")

What each of Accelerate's calls does then (see [Note: zero under Accelerate]):

* ``prepare``: the model is sharded by :func:`zero_core.shard` and handed to Accelerate marked as prepared,
  so it is not wrapped in DDP; the dataloader, scheduler and any other object are prepared by Accelerate as usual;
* ``accelerator.backward``: Accelerate's own (the loss divided by the accumulation steps, then
  ``loss.backward()``); with zero's fp16 loss scaler, the scaled backward of :meth:`zero_core.ZeroModule.backward`;
* ``accelerator.accumulate(model)`` / ``no_sync``: the model's own :meth:`~zero_core.ZeroModule.no_sync`, and
  Accelerate's optimizer wrapper skips ``step`` and ``zero_grad`` on the accumulating micro-batches;
* ``accelerator.clip_grad_norm_(model.parameters(), max_norm)``: torch's clipping over the DTensor gradients,
  the global norm as in one process;
* ``accelerator.save_state`` / ``load_state``: the checkpoint Accelerate writes in one process, world-size
  free: ``model.safetensors`` holds the full weights and ``optimizer.bin`` the full optimizer state in torch's
  own layout, so a run at another world size, or plain Accelerate in one process, loads it.
"""

from __future__ import annotations

from typing import Any, cast

import torch

import zero_core
from zero_core import ZeroConfig, ZeroModule
from zero_core.base.errors import ConfigError

try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - the [accelerate] extra installs it
    from zero_core.base._install import install_command

    raise ImportError(f"zero_integrations.accelerate needs accelerate: "
                      f"{install_command('zero-integrations', extra='[accelerate]')}") from exc
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

__all__ = ["ZeroAcceleratedOptimizer", "prepare"]

# [Note: zero under Accelerate]
# Accelerate wraps a model in DDP on more than one process and refuses DTensor parameters there, so the sharded
# model is handed over marked ``_is_accelerate_prepared`` (the flag Accelerate itself sets to avoid wrapping twice):
# it joins ``accelerator._models`` and is returned as it is. Accelerate's multi-process checkpoint assumes replicas:
# it calls ``state_dict()`` on every rank and writes rank 0's. For a sharded model that would be rank 0's shards
# alone, so a save pre-hook puts the full state dict (gathered on rank 0) in the model's place, and the optimizer
# wrapper's ``state_dict`` returns the full optimizer state in torch's layout (integer ids in the order of the
# parameter groups), as a replicated optimizer would. Loading reverses both: ``model.load_state_dict`` takes the
# full tensors (each rank keeps its rows) and the wrapper's ``load_state_dict`` maps the ids back to the sharded
# parameters. The checkpoint is therefore the one plain Accelerate writes in one process, at any world size.
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper over a zero-sharded optimizer: ``step`` and ``zero_grad`` as Accelerate's
    (skipped while gradients accumulate); ``state_dict`` and ``load_state_dict`` in the full, world-size-free layout
    a replicated optimizer has. Both are collective: every rank calls them, as ``save_state`` and ``load_state`` do."""

    zero_model: torch.nn.Module  # the sharded model (a ZeroModule and its own class)

    def state_dict(self) -> dict[str, Any]:
        full = get_optimizer_state_dict(self.zero_model, self.optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not full:  # not rank 0: cpu_offload gathers there only; the others write nothing
            return {}
        return _ids_from_names(full)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            raise ConfigError("ZeroAcceleratedOptimizer.load_state_dict takes an optimizer state dict with 'state' and "
                              f"'param_groups' (torch's layout, as optimizer.bin holds); got {type(state_dict).__name__}")
        names = _names_by_group(self.zero_model, self.optimizer)
        set_optimizer_state_dict(self.zero_model, self.optimizer, _names_from_ids(state_dict, names),
                                 options=StateDictOptions(full_state_dict=True))


def prepare(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *others: Any,
            config: ZeroConfig | None = None) -> tuple[Any, ...]:
    """Shard ``model`` and ``optimizer`` with :func:`zero_core.shard` and prepare them and ``others`` (dataloaders,
    schedulers) with ``accelerator``; returns them in the order given, as ``accelerator.prepare`` does.

    Call it once, on every rank, before the first step, with the optimizer already built over ``model``'s
    parameters (its groups and hyperparameters carry over). Precision is zero's (``config.precision``): an
    ``Accelerator(mixed_precision=...)`` is refused, because Accelerate's autocast and scaler would act on a model
    whose compute dtype zero sets.
    """
    if not isinstance(accelerator, Accelerator):
        raise ConfigError(f"prepare takes an accelerate.Accelerator first, got {type(accelerator).__name__}")
    if accelerator.distributed_type not in _SUPPORTED:
        raise ConfigError(f"zero_integrations.accelerate.prepare runs under plain data parallelism (accelerate launch "
                          f"with no FSDP, DeepSpeed or Megatron plugin); this Accelerator is set up for "
                          f"{accelerator.distributed_type.value}: drop that plugin, zero shards the model itself")
    if accelerator.mixed_precision != "no":
        raise ConfigError(f"Accelerator(mixed_precision={accelerator.mixed_precision!r}) would autocast a model whose "
                          "precision zero sets: create the Accelerator with mixed_precision='no' and pass "
                          "config=ZeroConfig(precision=Precision(compute='bf16')) (or 'fp16') to prepare")
    if isinstance(model, ZeroModule) or getattr(model, "_is_accelerate_prepared", False):
        raise ConfigError("prepare takes the plain model and its optimizer, before zero_core.shard or "
                          "accelerator.prepare; pass the model as it was built")
    if isinstance(optimizer, AcceleratedOptimizer):
        raise ConfigError("prepare takes the plain optimizer, not one accelerator.prepare returned")
    sharded, sharded_optimizer = zero_core.shard(model, optimizer, config=config)
    module = cast(torch.nn.Module, sharded)  # the model's own class too
    module._is_accelerate_prepared = True  # type: ignore[assignment]  # Accelerate leaves it unwrapped
    wrapped = ZeroAcceleratedOptimizer(sharded_optimizer, device_placement=False, scaler=None)
    wrapped.zero_model = module
    wrapped._is_accelerate_prepared = True  # joins accelerator._optimizers as it is
    accelerator.register_save_state_pre_hook(_save_full_weights(sharded))
    accelerator.register_load_state_pre_hook(_load_full_weights(sharded))
    if sharded.loss_scaler is not None:
        accelerator.backward = _scaled_backward(accelerator, sharded)
    prepared = accelerator.prepare(module, wrapped, *others)
    return prepared if isinstance(prepared, tuple) else (prepared,)


def _save_full_weights(model: ZeroModule) -> Any:
    def hook(models: list[Any], weights: list[dict[str, Any]], output_dir: str) -> None:
        for i, m in enumerate(models):
            if m is model and i < len(weights):
                weights[i] = model.full_state_dict(rank0_only=True)  # collective: the hook runs on every rank
    return hook


class _FullWeightsLoader:
    """What Accelerate's loader sees in place of the sharded model: no tensors of its own (so safetensors' check for
    shared storage has nothing to compare), and a ``load_state_dict`` that hands the file's full tensors to the
    model's own (each rank keeps its rows)."""

    def __init__(self, model: ZeroModule) -> None:
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True, **kwargs: Any) -> Any:
        return cast(torch.nn.Module, self.model).load_state_dict(state_dict, strict=strict, **kwargs)


def _load_full_weights(model: ZeroModule) -> Any:
    def hook(models: list[Any], input_dir: str) -> None:
        for i, m in enumerate(models):  # the list is load_state's own: the swap lasts this load only
            if m is model:
                models[i] = _FullWeightsLoader(model)
    return hook


def _scaled_backward(accelerator: Accelerator, model: ZeroModule) -> Any:
    def backward(loss: torch.Tensor, **kwargs: Any) -> None:
        model.backward(loss / accelerator.gradient_accumulation_steps, **kwargs)  # zero's fp16 loss scaler
    return backward


def _ids_from_names(full: dict[str, Any]) -> dict[str, Any]:
    """DCP's full optimizer state dict (keys: parameter names) in torch's layout (ids in group order)."""
    ids: dict[str, int] = {}
    groups = []
    for group in full["param_groups"]:
        params = []
        for name in group["params"]:
            ids.setdefault(name, len(ids))
            params.append(ids[name])
        groups.append({**group, "params": params})
    return {"state": {ids[name]: value for name, value in full["state"].items()}, "param_groups": groups}


def _names_by_group(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    by_id = {id(p): name for name, p in model.named_parameters()}
    try:
        return [[by_id[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    except KeyError:
        raise ConfigError("the optimizer holds a parameter that is not the model's: ZeroAcceleratedOptimizer loads "
                          "the state of the model's own parameters only") from None


def _names_from_ids(state_dict: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """torch's layout back to DCP's, by the position of each id in its group (the ids a save numbered in order)."""
    groups = state_dict["param_groups"]
    if [len(g["params"]) for g in groups] != [len(n) for n in names]:
        raise ConfigError(f"this optimizer state has groups of {[len(g['params']) for g in groups]} parameters, the "
                          f"optimizer {[len(n) for n in names]}: it was saved from another model or optimizer")
    mapping = {pid: name for group, group_names in zip(groups, names) for pid, name in zip(group["params"], group_names)}
    return {"state": {mapping[pid]: value for pid, value in state_dict["state"].items()},
            "param_groups": [{**g, "params": n} for g, n in zip(groups, names)]}
