"""What the engine asks of the autograd engine: graph walks and whether a backward is running."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from zero_core.base.errors import GradientLostError

__all__ = ["in_backward", "on_first_gradient", "reachable_params", "tensors_of"]


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj`` (a module's outputs: any pytree).

    A tensor, or a flat tuple or list of them, is answered without ``tree_flatten``: every unit's forward hook
    asks this of its outputs, and the general walk costs about 15 us a call in Python (a third of the engine's
    forward on a deep, thin model)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if type(obj) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in obj):
        return list(obj)
    leaves, _ = tree_flatten(obj)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread now."""
    return torch._C._current_graph_task_id() != -1


class _FirstGradient:
    """Calls ``fn(grads)`` before the first of its nodes runs in each backward (autograd graph task)."""

    __slots__ = ("_fn", "_ran")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        # graph task -> the call that claimed it
        self._ran: dict[int, object] = {}

    def __call__(self, grads: Any) -> None:
        # A CUDA backward runs nodes on one thread per device: the first call of a task claims it with one atomic
        # dict operation (setdefault on an int key runs no Python code, so no other thread runs inside it), which
        # needs no lock (this runs at every unit's outputs in every backward).
        claim = object()
        if self._ran.setdefault(torch._C._current_graph_task_id(), claim) is not claim:
            return
        self._fn(grads)


def on_first_gradient(tensors: Sequence[torch.Tensor], fn: Callable[..., Any]) -> None:
    """Call ``fn`` once per backward, before the first of ``tensors``' gradients is used: what
    ``torch.autograd.graph.register_multi_grad_hook(tensors, fn, mode="any")`` does, as a pre-hook on each
    tensor's autograd node (a C++ call) instead of a tensor hook (torch's Python wrapper, a handle, and a
    ``functools.wraps`` of ``fn`` each time), which the engine would pay on every unit's outputs in every forward.
    A node's pre-hook runs when its outputs' gradients are in, before it computes, as their tensor hooks do;
    the hooks live as long as the graph does."""
    hook = _FirstGradient(fn)
    if len(tensors) == 1:  # most modules return one tensor: no set to build
        node = tensors[0].grad_fn
        if node is not None and tensors[0].requires_grad:
            node.register_prehook(hook)
        return
    nodes = {t.grad_fn for t in tensors if t.requires_grad and t.grad_fn is not None}
    for node in nodes:
        node.register_prehook(hook)


def reachable_params(outputs: Sequence[torch.Tensor]) -> set[int]:
    """Ids of the leaf tensors whose gradient the autograd graph of ``outputs`` can reach."""
    found: set[int] = set()
    # Any: the node classes carry their own attributes (AccumulateGrad's variable) that torch's Node type does not declare
    stack: list[Any] = list({t.grad_fn for t in outputs if t.grad_fn is not None})
    seen: set[Any] = set(stack)
    # [Note: the reachable-parameters walk]
    # This walk runs after every forward that builds a graph, over every node of it (about 700 on a 48-block model,
    # a third of them a parameter's AccumulateGrad). Every node is pushed once (marked when pushed, not when popped);
    # a leaf's AccumulateGrad (which holds its leaf and has no next functions) is taken where it is met, never
    # pushed, marked or popped; and a node's kind is told by its type, not by its name, except for the one Python
    # node this walk refuses (reentrant checkpointing), whose type is named once per walk at most per type.
    accumulate = _ACCUMULATE_GRAD
    plain = _PLAIN_NODE_TYPES
    while stack:
        fn = stack.pop()
        kind = type(fn)
        if kind is accumulate:  # an output that is itself a parameter's node: only where the caller passed one
            found.add(id(fn.variable))
            continue
        if kind not in plain:
            if kind.__name__ == "CheckpointFunctionBackward":
                raise GradientLostError(
                    "the model uses reentrant activation checkpointing, which hides parameters from the autograd "
                    "graph until backward, so their gradients would be lost; use the non-reentrant form: "
                    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or for a HuggingFace model "
                    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={\"use_reentrant\": False}) "
                    "(activation_checkpointing_enable({\"use_reentrant\": False}) in transformers 5)"
                )
            plain.add(kind)
        for next_fn, _ in fn.next_functions:
            if next_fn is None:
                continue
            if type(next_fn) is accumulate:
                found.add(id(next_fn.variable))
            elif next_fn not in seen:
                seen.add(next_fn)
                stack.append(next_fn)
    return found


# The C++ node that accumulates a leaf's gradient, and the node types met so far that are not reentrant checkpointing
# (a set that only grows: one entry per kind of operation, see [Note: the reachable-parameters walk]).
_ACCUMULATE_GRAD: Any = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]  # not in the stubs
_PLAIN_NODE_TYPES: set[type] = set()
