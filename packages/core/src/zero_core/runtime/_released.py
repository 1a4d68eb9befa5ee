"""What a module holds, at stage 3 inside forward and backward, for a parameter whose chunk is not gathered.

[Note: parameters used outside their module]
The engine gathers a chunk when a module that registers one of its parameters starts
its forward. Code may read a parameter without calling its module: a parent calling
``F.linear(x, self.head.weight)``, a DETR-style ``self.query_embed.weight``, a module
that returns one of its parameters to its caller, a regulariser over
``self.parameters()``. While a chunk is not gathered, the modules hold a
:class:`ReleasedParameter` for each of its parameters: a tensor subclass with the
parameter's shape and dtype (on the meta device) that gathers the chunk the moment a
torch function reads its values, then runs the function on the real parameter.
Metadata (shape, dtype, device, ``requires_grad``) is answered without gathering. A
chunk used like this in a forward that builds a graph is gathered again when the
backward begins and kept until its gradients are reduced, because the autograd graph
saved the parameter itself and no module's backward hook would gather it in time.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from zero_core.base.errors import ZeroError

if TYPE_CHECKING:
    from collections.abc import Callable

    from zero_core.chunks.chunk import Chunk

__all__ = ["ReleasedParameter"]

# Read from the stand-in itself (a meta tensor of the right shape and dtype): no gather.
_SHAPE_AND_DTYPE = {
    torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.element_size,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.__len__,
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
    torch.Tensor.layout.__get__, torch.Tensor.is_leaf.__get__,  # type: ignore[attr-defined]
}
_REQUIRES_GRAD = torch.Tensor.requires_grad.__get__  # type: ignore[attr-defined]
# Answered from the real parameter's device.
_DEVICE = {torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.is_cpu.__get__,  # type: ignore[attr-defined]
           torch.Tensor.get_device}


class ReleasedParameter(nn.Parameter):
    """Stands for a stage-3 parameter whose chunk is not gathered. See [Note: parameters used outside their module]."""

    _zero_gather: Any
    _zero_chunk: Chunk
    _zero_slot: int

    def __new__(cls, gather: Callable[[Chunk, int], nn.Parameter], chunk: Chunk, slot: int) -> ReleasedParameter:
        """``gather(chunk, slot)`` gathers the chunk and returns the real parameter (a bound method of the
        engine's, held weakly: a stand-in kept past its engine must not keep the engine alive)."""
        param = chunk.slots[slot].param
        meta = torch.empty(chunk.slots[slot].shape, dtype=chunk.dtype, device="meta")
        stub = torch.Tensor._make_subclass(cls, meta, param.requires_grad)
        stub._zero_gather = weakref.WeakMethod(gather)
        stub._zero_chunk = chunk
        stub._zero_slot = slot
        return stub

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # built by __new__ alone
        pass

    def __repr__(self) -> str:  # type: ignore[override]  # Tensor.__repr__'s tensor_contents has no meaning here
        return f"ReleasedParameter({self._zero_chunk.slots[self._zero_slot].name!r}, chunk {self._zero_chunk.index} not gathered)"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ZeroError(f"{self!r} cannot be pickled or copied; read parameters between steps")

    def __deepcopy__(self, memo: Any) -> Any:
        raise ZeroError(f"{self!r} cannot be pickled or copied; read parameters between steps")

    def _real(self) -> nn.Parameter:
        gather = self._zero_gather()
        if gather is None:
            raise ZeroError(f"{self!r} outlived its zero engine (the model was closed or deleted); read the "
                            "parameters of a live sharded model")
        return gather(self._zero_chunk, self._zero_slot)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _SHAPE_AND_DTYPE and len(args) >= 1 and isinstance(args[0], ReleasedParameter):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is _REQUIRES_GRAD and len(args) == 1 and isinstance(args[0], ReleasedParameter):
            return args[0]._zero_chunk.slots[args[0]._zero_slot].param.requires_grad  # follows freezing
        if func in _DEVICE and len(args) == 1 and isinstance(args[0], ReleasedParameter):
            device = args[0]._zero_chunk.device
            return func(torch.empty(0, device=device))
        leaves, spec = tree_flatten((args, kwargs))
        leaves = [leaf._real() if isinstance(leaf, ReleasedParameter) else leaf for leaf in leaves]
        args, kwargs = tree_unflatten(leaves, spec)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
