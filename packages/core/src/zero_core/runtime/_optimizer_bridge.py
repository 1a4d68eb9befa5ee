"""The optimizer bridge: what the engine does around ``optimizer.step()`` and ``optimizer.zero_grad()``.

The engine registers the optimizer's hooks and settles its own state around them; the
:class:`OptimizerBridge` owns what belongs to the step itself: the fp16 overflow check, the
segments a placement policy stepped early, and whether a step is open. It is built before the
placement policy, which receives its :meth:`OptimizerBridge.step_chunks`. See [Note: step
transactions] in ``zero_core.runtime._engine`` for how a step that raises is closed, and [Note: one
overflow check per step] for fp16.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from zero_core.base._accounting import engine_work
from zero_core.base._devices import by_device
from zero_core.base._trace import STEP_CHUNKS, traced
from zero_core.base.errors import ZeroError
from zero_core.chunks.chunk import Chunk, to_local
from zero_core.comm._agreement import any_rank
from zero_core.comm.backend import CommBackend
from zero_core.runtime._local_step import LocalStep
from zero_core.runtime._reducer import GradientReducer
from zero_core.runtime._scaler import LossScaler
from zero_core.runtime._whole_step import WholeTensorSteps

__all__ = ["OptimizerBridge", "ZeroGradHook"]


class ZeroGradHook:
    """Runs ahead of every ``optimizer.zero_grad()`` (torch's optimizers have no hook for it): settles the engine,
    then drops the gradients a ``no_sync()`` window accumulated and never reduced.

    The instance attribute shadows the class's method; ``remove()`` takes it away again."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, *, settle: Callable[[], None],
                 discard: Callable[..., None]) -> None:
        # ``discard(set_to_none=...)`` drops the no_sync() gradients this optimizer's zero_grad() clears (with
        # several optimizers, those of its own chunks: see [Note: several optimizers] in zero_core._shard)
        self._optimizer = optimizer
        self._settle, self._discard = settle, discard
        self._installed: Any = None
        if optimizer is None:  # run() alone: model.zero_grad() with several optimizers clears every chunk
            return
        original = optimizer.zero_grad

        @functools.wraps(original)
        def zero_grad(*args: Any, **kwargs: Any) -> Any:
            self.run(kwargs.get("set_to_none", args[0] if args else True))
            return original(*args, **kwargs)

        self._installed = zero_grad
        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]

    def run(self, set_to_none: bool = True) -> None:
        """What ``zero_grad(set_to_none)`` does to zero's state (``ZeroModule.zero_grad`` calls it too)."""
        self._settle()
        self._discard(set_to_none=set_to_none)

    def remove(self) -> None:
        if self._optimizer is not None and self._optimizer.__dict__.get("zero_grad") is self._installed:
            del self._optimizer.__dict__["zero_grad"]


class OptimizerBridge:
    """The step's own state: an fp16 overflow check, early steps of a placement policy, an open step.

    With several optimizers (see [Note: several optimizers] in ``zero_core._shard``) each step is one
    optimizer's: :meth:`begin` names it, and ``optimizer`` and ``whole`` are that one's until the next."""

    def __init__(self, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], *,
                 reducer: GradientReducer, comm: CommBackend, device: torch.device, scaler: LossScaler | None,
                 wholes: Sequence[WholeTensorSteps | None] | None = None,
                 chunks: Sequence[Sequence[Chunk]] | None = None) -> None:
        self.optimizers = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
        # Each optimizer's whole-tensor owners and stand-ins (see [Note: whole-tensor optimizer steps]); None:
        # element-wise. And the chunks its parameters are in (every chunk, with one optimizer).
        self.wholes = tuple(wholes) if wholes is not None else (None,) * len(self.optimizers)
        self.chunks_of = tuple(tuple(c) for c in chunks) if chunks is not None else None
        # The optimizer stepping now (or last), and its whole-tensor steps.
        self.optimizer = self.optimizers[0]
        self.whole = self.wholes[0]
        self._reducer = reducer  # its order is the trainable chunks, whose segments get gradients
        self._comm = comm
        self._device = device
        self.scaler = scaler
        # Set by ZeroModule.backward: the losses of this step were scaled by the scaler.
        self.loss_scaled = False
        # The optimizers that stepped since this backward's overflow check (None: no check since the last
        # backward). See [Note: one overflow check per step].
        self._checked: set[int] | None = None
        # Segments a placement policy already stepped in this optimizer step (see step_chunks), with their
        # gradients, which the user's own step must skip and which come back after it.
        self._stepped: list[tuple[nn.Parameter, torch.Tensor]] = []
        # Inside step_chunks' own optimizer.step(): the engine's step hooks let it through.
        self.in_substep = False
        # Between begin() and end(): still set later means the step raised (the engine's settle undoes it).
        self.step_open = False
        # Param groups whose foreach=None this step turned into True (see [Note: foreach over sharded parameters]).
        self._foreach_set: list[dict[str, Any]] = []
        # Each optimizer's swap to local tensors (see [Note: the step on local tensors]), once the engine hooked it;
        # the one open in this step.
        self._local_steps: dict[int, LocalStep] = {}
        self._local: LocalStep | None = None

    @property
    def loss_scale(self) -> float:
        """What this step's losses were multiplied by (1 without a loss scaler)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def index_of(self, optimizer: torch.optim.Optimizer) -> int:
        return next(i for i, o in enumerate(self.optimizers) if o is optimizer)

    def chunks_stepped_by(self, optimizer: torch.optim.Optimizer) -> Sequence[Chunk] | None:
        """The chunks ``optimizer``'s step changes (``None``: every chunk, with one optimizer)."""
        return None if self.chunks_of is None or len(self.optimizers) == 1 else self.chunks_of[self.index_of(optimizer)]

    def chunks_cleared_by(self, optimizer: torch.optim.Optimizer, chunks: Sequence[Chunk]) -> Sequence[Chunk] | None:
        """The chunks whose no_sync() gradients ``optimizer.zero_grad()`` drops: its own and those of parameters in
        no optimizer (``None``: every chunk, with one optimizer)."""
        if self.chunks_of is None or len(self.optimizers) == 1:
            return None
        others = {c.index for i, mine in enumerate(self.chunks_of) if self.optimizers[i] is not optimizer for c in mine}
        return [c for c in chunks if c.index not in others]

    def hooked(self, optimizer: torch.optim.Optimizer, *, pre_hook: int, post_hook: int) -> None:
        """The engine registered its step hooks on ``optimizer`` with these ids (the window the local step needs)."""
        self._local_steps[id(optimizer)] = LocalStep(optimizer, pre_hook=pre_hook, post_hook=post_hook)

    def remove(self) -> None:
        """The engine closes: the optimizers' step wrappers go."""
        for local in self._local_steps.values():
            local.remove()

    def step_locally(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Last in the step's pre-hook, after the placement policy's early steps: the step's body runs on the
        parameters' local tensors where it may (see [Note: the step on local tensors])."""
        local = self._local_steps.get(id(self.optimizer))
        if self.whole is None and local is not None and local.begin(args, kwargs):
            self._local = local

    def backward_began(self) -> None:
        """A backward began: the next step checks its gradients for an overflow again."""
        self._checked = None

    def begin(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """The user's ``optimizer.step()`` begins (the engine settled and agreed first)."""
        if optimizer is not None:
            i = self.index_of(optimizer)
            self.optimizer, self.whole = self.optimizers[i], self.wholes[i]
        if self.scaler is not None:
            # Once per backward: a second optimizer stepping the same gradients takes the first one's verdict
            # (an overflow dropped every gradient, and the scale moves once), while an optimizer stepping
            # twice without a backward between is refused as before.
            if self._checked is None or id(self.optimizer) in self._checked:
                self._check_overflow()
                self._checked = set()
            self._checked.add(id(self.optimizer))
        self.step_open = True  # before the policy's own early steps, which abort() must undo too
        # [Note: foreach over sharded parameters]
        # torch picks its foreach implementation by default on CUDA only, and steps CPU parameters one
        # tensor at a time. The segments are DTensors, each of whose ops costs a Python dispatch, while a
        # foreach op over a list of them costs one: on 48 thin blocks (580 tensors) the per-tensor AdamW
        # step is a third of a stage-3 step. So a group that leaves foreach to torch (None, not fused)
        # steps with foreach here, the same update, and reads None again once the step is over. It still
        # pays where the body runs on the local tensors (see [Note: the step on local tensors] in
        # zero_core.runtime._local_step): one kernel call per list instead of one per tensor.
        self._foreach_set = [g for g in self.optimizer.param_groups
                             if "foreach" in g and g["foreach"] is None and not g.get("fused")]
        for group in self._foreach_set:
            group["foreach"] = True
        if self.whole is not None:
            self.whole.begin()  # after the overflow check, which may have dropped every gradient

    def _check_overflow(self) -> None:
        """See [Note: one overflow check per step]."""
        assert self.scaler is not None  # begin() checks only with a loss scaler
        if not self.loss_scaled:
            raise ZeroError(
                "this step's gradients were not loss-scaled: with Precision(loss_scale=...) call "
                "model.backward(loss) instead of loss.backward()"
            )
        grads = [to_local(seg.param.grad) for c in self._reducer.order for seg in c.segments if seg.param.grad is not None]
        found = torch.zeros(1, dtype=torch.float32, device=self._device)
        for device, group in by_device(grads).items():
            found_here = torch.zeros(1, dtype=torch.float32, device=device)
            # torch's fused finite check (GradScaler's); an inv_scale of 1 leaves the gradients as they are
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_here, torch.ones(1, device=device))
            found += found_here.to(self._device)
        flag = torch.tensor([1 if found.item() > 0 else 0], dtype=torch.uint8)
        overflow = bool(any_rank(self._comm, flag)[0].item())
        if overflow:
            for chunk in self._reducer.order:
                for seg in chunk.segments:
                    seg.param.grad = None  # the optimizer skips parameters without a gradient
        self.scaler.update(overflow)

    @traced(STEP_CHUNKS)
    @engine_work
    def step_chunks(self, chunks: Sequence[Chunk]) -> None:
        """Run the optimizer on these chunks' segments only, now (for placement policies, from ``before_step``).

        torch's optimizers skip parameters whose gradient is ``None``, so the other segments'
        gradients are set aside for the call. The stepped segments' gradients are set aside
        until the user's ``optimizer.step()`` has run, so it skips them, and then come back.
        """
        targets = {id(seg.param) for c in chunks for seg in c.segments}
        aside = [(seg.param, seg.param.grad) for c in self._reducer.order for seg in c.segments
                 if seg.param.grad is not None and id(seg.param) not in targets]
        for param, _ in aside:
            param.grad = None
        self.in_substep = True
        try:
            self.optimizer.step()
        finally:
            self.in_substep = False
            for param, grad in aside:
                param.grad = grad
        for chunk in chunks:
            for seg in chunk.segments:
                if seg.param.grad is not None:
                    self._stepped.append((seg.param, seg.param.grad))
                    seg.param.grad = None

    def end(self) -> bool:
        """The user's ``optimizer.step()`` returned: early-stepped gradients come back. Whether the step was
        skipped (an fp16 overflow)."""
        if self.whole is not None:
            self.whole.end()  # the new values reach every rank's shard before the engine refreshes the kept buffers from them
        self.abort()
        self.loss_scaled = False
        return self.scaler is not None and self.scaler.last_step_skipped

    def abort(self) -> None:
        """Close the step, whether it returned or raised: gradients set aside for early steps come back."""
        self.step_open = False
        self.in_substep = False
        if self._local is not None:  # first: the groups and states the rest of the close reads are the DTensors
            self._local.end()
            self._local = None
        if self.whole is not None:
            self.whole.abort()
        for param, grad in self._stepped:
            param.grad = grad
        self._stepped = []
        for group in self._foreach_set:
            group["foreach"] = None
        self._foreach_set = []
