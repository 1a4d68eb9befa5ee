"""The module users train: a thin wrapper whose forward brackets the engine's step state."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from zero_core._engine import Engine
from zero_core._full_state import full_state_dict, load_full_state_dict
from zero_core._scaler import LossScaler
from zero_core.comm import CommStats
from zero_core.errors import ZeroError

__all__ = ["ZeroModule"]


class ZeroModule(nn.Module):
    """The model returned by :func:`zero_core.shard`.

    Call it like the original model. Its parameters are the original parameter objects,
    whose storage is only valid while their chunk is gathered (inside forward and
    backward); use :meth:`full_parameters` to read them between steps.
    """

    def __init__(self, module: nn.Module, engine: Engine) -> None:
        super().__init__()
        self.module = module
        self.engine = engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        compute = self.engine.config.precision.compute
        if compute is not None:  # the model runs in the compute dtype: floating inputs follow its parameters
            args, kwargs = tree_map(functools.partial(_cast_floating, compute), (args, kwargs))
        self.engine.pre_forward_root()
        try:
            outputs = self.module(*args, **kwargs)
        except BaseException:
            self.engine.abort_forward()
            raise
        self.engine.post_forward_root(outputs)
        return outputs

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)``, with the loss scaled when the precision has a loss scale.

        Works for every precision, so one training loop serves all; required with
        ``Precision(loss_scale=...)`` (fp16), where ``optimizer.step()`` refuses gradients
        of an unscaled backward. The gradients the optimizer and
        :func:`~zero_core.clip_grad_norm_` see are unscaled.
        """
        scaler = self.engine.scaler
        if scaler is None:
            loss.backward(**kwargs)
            return
        self.engine.loss_scaled = True
        # Scaled in fp32: a 16-bit loss times 2**16 would overflow before backward starts.
        (loss.float() * scaler.scale).backward(**kwargs)

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The running loss scale (fp16), or ``None`` without one."""
        return self.engine.scaler

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over micro-batches without communicating (DDP's ``no_sync``).

        Backwards inside the context add into full-size, unsharded gradient buffers
        (one compute-dtype element per parameter per rank, 4 bytes in fp32, on top of the
        sharded states; stage 1 already keeps that buffer) and skip
        the reduce-scatter; the first backward outside the context reduces the sum. The
        parameter all-gathers still run on every micro-batch. Stepping the optimizer inside
        the context, or before a backward outside it, raises :class:`ZeroError`.
        """
        previous = self.engine.sync_gradients
        self.engine.sync_gradients = False
        try:
            yield
        finally:
            self.engine.sync_gradients = previous

    def close(self) -> None:
        """Detach zero from the model: remove its hooks and stop its helper thread.

        Call it before ``torch.distributed.destroy_process_group()``; the model cannot
        train afterwards.
        """
        self.engine.close()

    @property
    def comm_stats(self) -> CommStats:
        """Collective calls and bytes this rank sent, per step. See :class:`zero_core.CommStats`."""
        return self.engine.comm.stats

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameter shards, gradient shards and optimizer states this rank holds now."""
        return self.engine.model_state_bytes()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, on the CPU. Collective: call on every rank."""
        return self.engine.full_parameters()

    def full_state_dict(self, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The plain model's state dict, whole, on the CPU, in master precision. Collective.

        Keys and shapes are those of the unwrapped model (loadable with
        ``load_state_dict(strict=True)``; tied parameters appear under each name). Chunks are
        gathered one at a time; with ``rank0_only`` (default) only rank 0 keeps the values and
        the other ranks get ``{}``. To write a file without holding the model on rank 0, use
        :func:`zero_core.save_full_state_dict` with a ``.safetensors`` path.
        """
        return full_state_dict(self.engine, rank0_only=rank0_only)

    def load_full_state_dict(self, source: Any, *, strict: bool = True) -> None:
        """Load a plain (unsharded) state dict into the shards. Collective.

        ``source`` is a mapping of tensors or a path to a ``.safetensors``, ``.pt``/``.bin`` file
        or ``*.index.json``; each rank reads only the part of each parameter its shards hold.
        Missing, unexpected and mis-shaped keys raise :class:`~zero_core.CheckpointError` on
        every rank before anything changes (``strict=False`` allows missing and unexpected).
        """
        load_full_state_dict(self.engine, source, strict=strict)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        raise ZeroError(
            "ZeroModule.state_dict() would return views of freed parameter storage; use model.full_state_dict() "
            "(collective, the plain model's keys), zero_core.save_full_state_dict(model, path) or "
            "zero_core.save_checkpoint(model, optimizer, directory)"
        )

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        raise ZeroError(
            "use model.load_full_state_dict(state_dict_or_path) (collective), zero_core.load_checkpoint(model, optimizer, "
            "directory), or shard(..., load_from=...)"
        )


def _cast_floating(dtype: torch.dtype, value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value
