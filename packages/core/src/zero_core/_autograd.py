"""What the engine asks of the autograd engine: graph walks and whether a backward is running."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from zero_core.errors import GradientLostError

__all__ = ["in_backward", "reachable_params", "tensors_of"]


def tensors_of(obj: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(obj)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread now."""
    return torch._C._current_graph_task_id() != -1


def reachable_params(outputs: Sequence[torch.Tensor]) -> set[int]:
    """Ids of the leaf tensors whose gradient the autograd graph of ``outputs`` can reach."""
    found: set[int] = set()
    seen: set[Any] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ == "CheckpointFunctionBackward":
            raise GradientLostError(
                "the model uses reentrant activation checkpointing, which hides parameters from the autograd "
                "graph until backward, so their gradients would be lost; use the non-reentrant form: "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or for a HuggingFace model "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={\"use_reentrant\": False}) "
                "(activation_checkpointing_enable({\"use_reentrant\": False}) in transformers 5)"
            )
        variable = getattr(fn, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found
