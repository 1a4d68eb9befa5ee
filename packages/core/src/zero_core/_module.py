"""The module users train: a thin wrapper whose forward brackets the engine's step state."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.utils._pytree import tree_map

from zero_core.base.errors import ConfigError, ZeroError
from zero_core.checkpoint._full_state import full_state_dict, load_full_state_dict
from zero_core.comm.backend import CommStats
from zero_core.interfaces._inspection import full_parameters, memory_by_kind, model_state_bytes
from zero_core.runtime._engine import Engine
from zero_core.runtime._scaler import LossScaler

__all__ = ["ZeroModule", "adopt"]


class ZeroModule:
    """What the model :func:`zero_core.shard` returns is, besides its own class.

    :func:`zero_core.shard` keeps the model object and its class (``isinstance(model,
    MyModel)`` holds, ``model.config`` and every attribute work, as with FSDP2's
    ``fully_shard``): it swaps in a subclass of both the model's class and this one.
    Between steps every parameter is a sharded ``nn.Parameter`` (a DTensor with
    ``Shard(0)`` over the data-parallel ranks, the original global shape), the very
    object the optimizer steps, so ``model.zero_grad()``, ``torch.nn.utils.clip_grad_norm_``,
    ``model.state_dict()`` and ``torch.distributed.checkpoint`` work as in plain PyTorch.
    Inside forward and backward the modules hold ordinary full parameters. See
    [Note: parameter views] in ``zero_core.chunks.chunk``.
    """

    _zero_engine: Engine

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Only true while dynamo traces this call, i.e. under torch.compile(model). A plain raise here would
            # make dynamo fall back to running the frame eagerly, silently; a disabled function runs (and raises)
            # at the graph break. (torch._dynamo is loaded whenever something is compiling.)
            torch._dynamo.disable(_refuse_whole_model_compile, reason="zero refuses whole-model compile")(self)
        engine = self._zero_engine
        compute = cast("torch.dtype | None", engine.config.precision.compute)  # Precision made a name a dtype
        if compute is not None:  # the model runs in the compute dtype: floating inputs follow its parameters
            args, kwargs = tree_map(functools.partial(_cast_floating, compute), (args, kwargs))
        engine.pre_forward_root()
        try:
            outputs = super().__call__(*args, **kwargs)  # type: ignore[misc]
        except BaseException as error:
            engine.abort_forward(error)
            raise
        engine.post_forward_root(outputs)
        return outputs

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """Refused: the copy would share the engine (its hooks, process groups and chunk buffers) with this model."""
        raise ZeroError(
            f"copy.deepcopy of a sharded {type(self).__name__} is not supported (torch.optim.swa_utils.AveragedModel "
            "deep-copies too): its engine's hooks, process groups and buffers cannot be duplicated. Copy the weights "
            "instead: copy.deepcopy(model.state_dict()) (this rank's shards), model.full_state_dict() (whole tensors), "
            "or, for an EMA, clones of the parameters updated with torch._foreach_lerp_ (see the idioms table in the "
            "concepts guide)")

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Refused: compile each block instead. See [Note: torch.compile] in ``zero_core.runtime._engine``."""
        raise ZeroError(_WHOLE_MODEL_COMPILE.format(how=f"{type(self).__name__}.compile()"))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``; gradients a ``no_sync()`` window accumulated are discarded too, as with DDP."""
        self._zero_engine.zero_grad_hook.run(set_to_none)
        super().zero_grad(set_to_none)  # type: ignore[misc]

    @property
    def engine(self) -> Engine:
        """The runtime that drives this model's chunks."""
        return self._zero_engine

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)``, with the loss scaled when the precision has a loss scale.

        Works for every precision, so one training loop serves all; required with
        ``Precision(loss_scale=...)`` (fp16), where ``optimizer.step()`` refuses gradients
        of an unscaled backward. The gradients the optimizer and
        :func:`~zero_core.clip_grad_norm_` see are unscaled.
        """
        scaler = self._zero_engine.bridge.scaler
        if scaler is None:
            loss.backward(**kwargs)
            return
        self._zero_engine.bridge.loss_scaled = True
        # Scaled in fp32: a 16-bit loss times 2**16 would overflow before backward starts.
        (loss.float() * scaler.scale).backward(**kwargs)

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The running loss scale (fp16), or ``None`` without one."""
        return self._zero_engine.bridge.scaler

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
        engine = self._zero_engine
        previous = engine.reducer.sync
        engine.reducer.sync = False
        try:
            yield
        finally:
            engine.reducer.sync = previous

    @contextlib.contextmanager
    def gathered_parameters(self, *, writable: bool = False) -> Iterator[None]:
        """Hold every parameter whole, in master precision, inside the context. Collective.

        Inside, the modules hold plain full parameters (``model.lm_head.weight`` is the whole
        matrix on every rank) for inspection or re-initialisation (DeepSpeed's
        ``GatheredParameters``, FSDP1's ``summon_full_params``). With ``writable=True``,
        what the code inside writes is copied back to the master shards on exit (each rank
        keeps its own rows, so every rank must write the same values), and the kept full
        buffers are refreshed. Every rank holds the whole model at once: for a model that
        does not fit, read it chunk by chunk with :meth:`full_state_dict`. Call between
        steps; calling the model inside the context raises :class:`ZeroError` (its forward
        would replace the context's copies): run it after the context exits.
        """
        from zero_core.checkpoint._gathered import gathered_parameters

        with gathered_parameters(self._zero_engine, writable=writable):
            yield

    def stream_full_parameters(self, *, bucket_mb: float = 512, dtype: torch.dtype | None = None,
                               device: str | torch.device = "cpu",
                               rank: int | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Every parameter, whole, in buckets of ``(name, tensor)`` of at most ``bucket_mb`` MiB. Collective.

        For weight syncs (to an inference engine, an evaluator, a second copy of the model)
        between steps: at most one bucket of finished tensors and one gathered chunk exist at a
        time, where ``gathered_parameters()`` holds the whole model. A parameter larger than
        the bucket comes alone. Every rank iterates to the end (each chunk is gathered
        collectively); with ``rank=r`` only rank r gets the tensors and the others get as many
        empty buckets. The tensors are fresh copies the caller may keep, in ``dtype``
        (``None``: the master dtype, the parameters' own) on ``device`` (``"cpu"``,
        ``"device"`` for the compute device, or a ``torch.device``). A tied parameter comes
        once, under its first name; buffers are not included. Do not run the model until the
        loop ends. See [Note: streaming full weights].
        """
        import math

        from zero_core.checkpoint._streaming import stream_full_parameters

        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not math.isfinite(bucket_mb) \
                or bucket_mb <= 0:
            raise ConfigError(f"stream_full_parameters(bucket_mb=...) must be a positive number of MiB, got {bucket_mb!r}")
        return stream_full_parameters(self._zero_engine, bucket_bytes=max(1, int(bucket_mb * 2**20)), dtype=dtype,
                                      device=device, rank=rank)

    def close(self) -> None:
        """Detach zero from the model: remove its hooks and stop its helper thread.

        Call it before ``torch.distributed.destroy_process_group()``; the model cannot
        train afterwards. A checkpoint still being written in the background
        (``save_checkpoint(..., async_=True)``) completes first, and its failure is raised.
        """
        from zero_core.checkpoint._async_save import finish_pending_save

        try:
            finish_pending_save(self._zero_engine)
        finally:
            self._zero_engine.close()

    @property
    def comm_stats(self) -> CommStats:
        """Collective calls, bytes this rank sent and measured time, per step and kind. See :class:`zero_core.CommStats`.

        ``print(model.comm_stats.table())`` shows the last step with latency and bandwidth.
        """
        return self._zero_engine.comm.stats

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameter shards, gradient shards and optimizer states this rank holds now."""
        engine = self._zero_engine
        return model_state_bytes(engine.chunks, engine.optimizers)

    def memory_by_kind(self) -> dict[str, int]:
        """Every byte zero holds on this rank now, by kind: the model states and the working buffers
        (gathered chunks, gradient buffers in flight, idle pooled buffers), each storage once."""
        engine = self._zero_engine
        return memory_by_kind(engine.chunks, engine.optimizers)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, on the CPU. Collective: call on every rank."""
        engine = self._zero_engine
        engine.settle("reading the full parameters", collective=True)
        return full_parameters(engine.chunks, placement=engine.placement, comm=engine.comm)

    def full_state_dict(self, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The plain model's state dict, whole, on the CPU, in master precision. Collective.

        Keys and shapes are those of the unwrapped model (loadable with
        ``load_state_dict(strict=True)``; tied parameters appear under each name). Chunks are
        gathered one at a time; with ``rank0_only`` (default) only rank 0 keeps the values and
        the other ranks get ``{}``. To write a file without holding the model on rank 0, use
        :func:`zero_core.save_full_state_dict` with a ``.safetensors`` path.
        """
        return full_state_dict(self._zero_engine, rank0_only=rank0_only)

    def load_full_state_dict(self, source: Any, *, strict: bool = True) -> None:
        """Load a plain (unsharded) state dict into the shards. Collective.

        ``source`` is a mapping of tensors or a path to a ``.safetensors``, ``.pt``/``.bin`` file
        or ``*.index.json``; each rank reads only the part of each parameter its shards hold.
        Missing, unexpected and mis-shaped keys raise :class:`~zero_core.CheckpointError` on
        every rank before anything changes (``strict=False`` allows missing and unexpected).
        """
        load_full_state_dict(self._zero_engine, source, strict=strict)


_WHOLE_MODEL_COMPILE = (
    "{how} compiles the model zero_core.shard returned as one region, but zero gathers and releases parameters "
    "in hooks on the modules that own them, which cannot run inside a compiled graph: every such module would split "
    "the graph (a graph break per hook) and the root's own step bookkeeping cannot be traced at all. Compile each "
    "block instead, before or after shard(): `for block in model.transformer.h: block.compile()` (or "
    "`model.model.layers` for Llama-style models)"
)


def _refuse_whole_model_compile(model: nn.Module) -> None:
    raise ZeroError(_WHOLE_MODEL_COMPILE.format(how=f"torch.compile({type(model).__name__})"))


_CLASSES: dict[tuple[type, bool], type] = {}


def adopt(model: nn.Module, engine: Engine) -> ZeroModule:
    """Turn ``model`` into a :class:`ZeroModule` in place: a subclass of its own class and ZeroModule.

    ``model.module`` returns the model itself (the DDP idiom ``model.module.state_dict()``),
    unless the model has its own attribute of that name.
    """
    cls = type(model)
    add_module = not hasattr(model, "module")
    key = (cls, add_module)
    if key not in _CLASSES:
        # _zero_plain_class: what exports name as the architecture (from_pretrained knows the plain class)
        attrs: dict[str, Any] = {"__module__": cls.__module__, "__doc__": cls.__doc__, "_zero_plain_class": cls}
        if add_module:
            attrs["module"] = property(lambda self: self, doc="The model itself (DDP's ``model.module`` idiom).")
        _CLASSES[key] = type(f"Zero{cls.__name__}", (ZeroModule, cls), attrs)
    model.__dict__["_zero_engine"] = engine  # not through nn.Module.__setattr__: the engine is no submodule
    model.__class__ = _CLASSES[key]
    _install_state_dict_hooks(model, engine)
    return model  # type: ignore[return-value]


def _install_state_dict_hooks(model: nn.Module, engine: Engine) -> None:
    """``state_dict`` and ``load_state_dict`` on the sharded parameters, as FSDP2 does them.

    Saving returns the sharded DTensors (no communication). Loading accepts DTensors
    sharded the same way or plain full tensors (each rank keeps its own rows), writes
    into the master shards, and refreshes the kept full buffers (collective)."""
    from zero_core.checkpoint._state_dict import load_post_hook, load_pre_hook, state_dict_post_hook, state_dict_pre_hook

    model.register_state_dict_pre_hook(functools.partial(state_dict_pre_hook, engine))
    model.register_state_dict_post_hook(functools.partial(state_dict_post_hook, engine))
    model.register_load_state_dict_pre_hook(functools.partial(load_pre_hook, engine))
    model.register_load_state_dict_post_hook(functools.partial(load_post_hook, engine))


def _cast_floating(dtype: torch.dtype, value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value
