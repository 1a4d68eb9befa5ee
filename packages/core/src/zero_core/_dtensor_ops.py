"""DTensor sharding rules for torch's fused optimizer kernels that torch registers only for Adam and AdamW.

The sharded parameters are DTensors, and a fused optimizer step dispatches its kernel on
them. The fused SGD and Adagrad kernels are elementwise over lists of tensors exactly like
fused Adam (torch registers those with the same pointwise rule), so they run on each
rank's local pieces; registering them keeps ``SGD(fused=True)`` and ``Adagrad(fused=True)``
working on sharded parameters, as they do in one process.
"""

from __future__ import annotations

import torch

__all__ = ["register_fused_optimizer_ops"]

_done = False


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
