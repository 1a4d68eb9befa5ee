"""``model.state_dict()`` and ``model.load_state_dict()`` on a sharded model, as in plain PyTorch.

Between steps the modules hold the sharded parameters, so ``nn.Module.state_dict`` already
returns the sharded DTensors under the plain model's keys, with no communication; these
hooks only refuse the cases where that would be wrong, and make loading write into the
master shards: DTensor values sharded like the parameters are copied locally, plain full
tensors are cut to this rank's rows first (no communication), and kept full buffers are
refreshed from the shards afterwards (collective: every rank loads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zero_core.base.errors import ZeroError
from zero_core.chunks._chunk_layout import dtensor

if TYPE_CHECKING:
    from zero_core.chunks.chunk import Chunk
    from zero_core.runtime._engine import Engine

__all__ = ["load_post_hook", "load_pre_hook", "param_keys", "state_dict_post_hook", "state_dict_pre_hook"]


def param_keys(engine: Engine) -> dict[str, tuple[Chunk, int]]:
    """Every state dict key of a parameter (tied ones under each name) -> its chunk and slot."""
    cached = getattr(engine, "_param_keys", None)
    if cached is not None:
        return cached
    where: dict[int, list[tuple[str, Chunk, int]]] = {id(m): [] for m, _, _, _ in engine.params.registrations}
    for m, name, chunk, i in engine.params.registrations:
        where[id(m)].append((name, chunk, i))
    keys: dict[str, tuple[Chunk, int]] = {}
    for prefix, m in engine.module.named_modules(remove_duplicate=False):
        for name, chunk, i in where.get(id(m), []):
            keys[f"{prefix}.{name}" if prefix else name] = (chunk, i)
    engine._param_keys = keys  # type: ignore[attr-defined]
    return keys


def _require_between_steps(engine: Engine, what: str) -> None:
    if engine.params.unsharded:
        raise ZeroError(
            f"model.{what}() was called inside forward or backward, while the modules hold the gathered parameters; "
            "call it between steps (after optimizer.step() or before the next forward)"
        )
    absent = [c.index for c in engine.chunks if not c.shard_in_memory]
    if absent:
        raise ZeroError(
            f"model.{what}() cannot reach parameters whose shards are on disk now (chunks {absent[:5]}, placed there by "
            f"the {engine.config.placement!r} placement policy); use zero_core.save_checkpoint / load_checkpoint, "
            "model.full_state_dict() or model.load_full_state_dict(), which stage disk shards in chunk by chunk"
        )


def state_dict_pre_hook(engine: Engine, module: nn.Module, prefix: str, keep_vars: bool) -> None:
    if engine.params.unsharded:
        _require_between_steps(engine, "state_dict")


def state_dict_post_hook(engine: Engine, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                         local_metadata: Any) -> None:
    if any(isinstance(v, nn.Parameter) for v in state_dict.values()):
        return  # keep_vars=True: the caller wants the objects (zero's own layout scans), not their values
    _require_between_steps(engine, "state_dict")
    for key, value in state_dict.items():  # values copy.deepcopy, pickle and torch.save accept (see dtensor())
        if isinstance(value, DTensor):
            state_dict[key] = dtensor(value._local_tensor, value._spec)


def load_pre_hook(engine: Engine, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any,
                  strict: bool, missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    if prefix:  # only the root's own call converts; children see the converted values
        return
    _require_between_steps(engine, "load_state_dict")
    engine.settle("load_state_dict", collective=True)  # collective: it refreshes the kept full buffers afterwards
    if local_metadata.get("assign_to_params_buffers", False):
        raise ZeroError(
            "model.load_state_dict(..., assign=True) would replace the sharded parameters the optimizer holds; "
            "load without assign=True (values are copied into the shards)"
        )
    keys = param_keys(engine)
    for key, value in list(state_dict.items()):
        found = keys.get(key)
        if found is None or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            continue
        chunk, i = found
        slot = chunk.slots[i]
        if tuple(value.shape) != tuple(slot.shape):
            continue  # torch reports the mismatch with the key's name
        local = slot.local_of(value.detach(), chunk.rank).contiguous()
        sharded = chunk.segments[i].param
        local = local.to(device=sharded.device if not isinstance(sharded, DTensor) else sharded._local_tensor.device)
        state_dict[key] = chunk.wrap(i, local)


def load_post_hook(engine: Engine, module: nn.Module, incompatible_keys: Any) -> None:
    from zero_core.checkpoint._state_keys import refresh_kept

    with torch.no_grad():
        for chunk in engine.chunks:
            refresh_kept(chunk, engine.comm)
        engine.residency.mark_refreshed()
