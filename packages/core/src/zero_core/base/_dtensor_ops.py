"""What torch's DTensor lacks for the idioms users apply to sharded parameters.

The sharded parameters are DTensors, and a fused optimizer step dispatches its kernel on
them. The fused SGD and Adagrad kernels are elementwise over lists of tensors exactly like
fused Adam (torch registers those with the same pointwise rule), so they run on each
rank's local pieces; registering them keeps ``SGD(fused=True)`` and ``Adagrad(fused=True)``
working on sharded parameters, as they do in one process.

[Note: torch's clip over several meshes]
``torch.nn.utils.clip_grad_norm_`` (and ``get_total_norm``) takes each gradient's norm with
``torch._foreach_norm`` and stacks the norms into one tensor. With module meshes the norms are
DTensors on different meshes, and DTensor refuses ops whose operands span meshes
("All operands in aten.stack.default must have the same mesh"). So a stack of one-element
DTensors on several meshes (the per-tensor norms) returns the plain stack of their global
values: the norms of each mesh and placement are
reduced together, one collective per group, in operand order (identical on every rank), and
the result is an ordinary tensor. torch then multiplies every gradient by a one-element plain
tensor, which DTensor takes as replicated on each gradient's own mesh: the clip is the one
process's; a ``_foreach_mul_`` over gradients of several meshes (the clip's foreach path) runs once per
mesh. Every other stack and ``_foreach_mul_`` goes through DTensor's own dispatch unchanged.

[Note: a round before torch's clip]
torch's clip all-reduces the gradient norms on the DTensors' mesh, a group of zero's own (see
[Note: torch's collectives on a group of their own] in ``zero_core._shard``). A rank that skips the
clip goes on to ``optimizer.step()``, whose lockstep round runs on the engine's group: the two
collectives never pair, and each rank would wait out the timeout, the clipping one inside torch's
all-reduce with a backend's ``RuntimeError``. So the same stack that sees every norm first (a stack of
one-element DTensors with a partial placement, on a mesh an engine registered with
:func:`register_mesh_round`) begins with a lockstep round, "torch.nn.utils.clip_grad_norm_", when its
engine is between steps. Then a rank that skips the clip meets it with its step's round, and every
rank raises ``RanksOutOfStepError`` at once naming both. The round is one more two-word all-reduce
per clip, counted with zero's traffic; torch's own all-reduce of the norms is not zero's and is not
counted. With ``static_graph=True`` there is no round: a rank skipping the clip then waits out
``collective_timeout_s`` (a ``RuntimeError`` from the backend inside torch's all-reduce on the
clipping rank, ``CollectiveTimeoutError`` on the others).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["register_cross_mesh_stack", "register_fused_optimizer_ops", "register_mesh_round",
           "register_torch_collective_rounds"]

# The round an engine runs before torch's collectives over its DTensors' meshes, by the mesh object's id; weak, so a
# closed engine's meshes (and ids reused by later ones) find nothing. See [Note: a round before torch's clip].
_rounds: dict[int, tuple[weakref.ref[Any], list[weakref.WeakMethod[Callable[[str], None]]]]] = {}


def register_mesh_round(meshes: Iterable[Any], round_: Callable[[str], None]) -> None:
    """Torch's norm stacks over DTensors on ``meshes`` begin with ``round_(what)`` (a bound method of an engine).

    Models sharded over the same ranks share a mesh: the latest engine still open runs the round."""
    for mesh in meshes:
        if mesh is None:
            continue
        found = _rounds.get(id(mesh))
        if found is None or found[0]() is not mesh:
            found = _rounds[id(mesh)] = (weakref.ref(mesh), [])
        found[1].append(weakref.WeakMethod(round_))


def _round_of(mesh: Any) -> Callable[[str], None] | None:
    found = _rounds.get(id(mesh))
    if found is None or found[0]() is not mesh:
        return None
    # a bound method's engine: a closed one runs no more rounds
    found[1][:] = [m for m in found[1]
                   if (bound := m()) is not None and not getattr(getattr(bound, "__self__", None), "_closed", False)]
    return found[1][-1]() if found[1] else None


def _rounds_before(tensors: list[Any]) -> list[Callable[[str], None]]:
    """The rounds to run before stacking ``tensors``: one per engine whose mesh holds a partial one-element DTensor."""
    from torch.distributed.tensor import DTensor

    found: list[Callable[[str], None]] = []
    for t in tensors:
        if not isinstance(t, DTensor) or t.numel() != 1 or not any(p.is_partial() for p in t.placements):
            continue
        round_ = _round_of(t.device_mesh)
        if round_ is not None and round_ not in found:
            found.append(round_)
    return found

_done = False
_stack_done = False


def register_fused_optimizer_ops() -> None:
    """Register the missing rules once (idempotent; a torch that lacks the helper keeps its own behaviour)."""
    global _done
    if _done:
        return
    _done = True
    try:
        from torch.distributed.tensor._ops import _pointwise_ops
        from torch.distributed.tensor._ops._pointwise_ops import _register_single_dim_pointwise
    except ImportError:  # a torch without the helper: fused SGD/Adagrad then fail with DTensor's own message
        return
    aten = torch.ops.aten
    for name in ("_fused_sgd_", "_fused_sgd", "_fused_adagrad_", "_fused_adagrad"):
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if op not in _pointwise_ops.pointwise_ops:
                _register_single_dim_pointwise(op)


def register_torch_collective_rounds() -> None:
    """See [Note: a round before torch's clip]. Idempotent; the handler is the cross-mesh stack's."""
    register_cross_mesh_stack()


def register_cross_mesh_stack() -> None:
    """See [Note: torch's clip over several meshes] and [Note: a round before torch's clip]. Idempotent; a torch
    without the handler table keeps its error (and runs no round)."""
    global _stack_done
    if _stack_done:
        return
    _stack_done = True
    from torch.distributed.tensor import DTensor

    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    aten = torch.ops.aten
    ops = (aten.stack.default, aten._foreach_mul_.Tensor)
    if not isinstance(handlers, dict) or any(op in handlers for op in ops):
        return

    def own_dispatch(op: Any, handler: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        del handlers[op]  # DTensor's own dispatch, for this call
        try:
            return op(*args, **kwargs)
        finally:
            handlers[op] = handler

    def by_mesh(tensors: list[Any]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault(id(t.device_mesh) if isinstance(t, DTensor) else 0, []).append(i)
        return groups

    def stack(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tensors = list(args[0])
        for round_ in _rounds_before(tensors):
            round_("torch.nn.utils.clip_grad_norm_ (a stack of gradient norms)")
        if len(by_mesh(tensors)) < 2 or any(t.numel() != 1 for t in tensors):
            return own_dispatch(op_call, stack, args, kwargs)
        return _stack_global_values(tensors, *args[1:], **kwargs)

    def foreach_mul_(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # the clip's scale: a one-element tensor times gradients of every mesh, applied per mesh
        tensors = list(args[0])
        groups = by_mesh(tensors)
        if len(groups) < 2:
            return own_dispatch(op_call, foreach_mul_, args, kwargs)
        for indices in groups.values():
            own_dispatch(op_call, foreach_mul_, ([tensors[i] for i in indices], *args[1:]), kwargs)
        return None

    handlers[aten.stack.default] = stack
    handlers[aten._foreach_mul_.Tensor] = foreach_mul_


def _stack_global_values(tensors: list[Any], dim: int = 0) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    values: list[torch.Tensor | None] = [None if isinstance(t, DTensor) else t for t in tensors]
    groups: dict[tuple[int, Any], list[int]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, DTensor):
            groups.setdefault((id(t.device_mesh), tuple(t.placements)), []).append(i)
    for indices in groups.values():  # in operand order: the same collectives on every rank
        first = tensors[indices[0]]
        local = torch.stack([tensors[i].to_local().reshape(()) for i in indices])
        full = DTensor.from_local(local, first.device_mesh, first.placements, run_check=False).full_tensor()
        for j, i in enumerate(indices):
            values[i] = full[j].reshape(tensors[i].shape)
    device = values[0].device  # type: ignore[union-attr]
    return torch.stack([v.to(device) for v in values], dim)  # type: ignore[union-attr]
