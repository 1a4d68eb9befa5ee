"""The optimizer bridge: what the engine does around ``optimizer.step()`` and ``optimizer.zero_grad()``.

Mixed into :class:`~zero_core.Engine`. See [Note: step transactions] in ``zero_core._engine`` for how a
step that raises is closed, and [Note: one overflow check per step] for fp16.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from zero_core._accounting import engine_work
from zero_core._autograd import in_backward
from zero_core._devices import by_device
from zero_core._state import TrainingState
from zero_core.chunk import Chunk, to_local
from zero_core.errors import ZeroError

__all__ = ["OptimizerBridge", "ZeroGradHook"]


class ZeroGradHook:
    """Runs ``before()`` ahead of every ``optimizer.zero_grad()`` (torch's optimizers have no hook for it).

    The instance attribute shadows the class's method; ``remove()`` takes it away again."""

    def __init__(self, optimizer: torch.optim.Optimizer, before: Any) -> None:
        self._optimizer = optimizer
        original = optimizer.zero_grad

        @functools.wraps(original)
        def zero_grad(*args: Any, **kwargs: Any) -> Any:
            before(kwargs.get("set_to_none", args[0] if args else True))
            return original(*args, **kwargs)

        self._installed = zero_grad
        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]

    def remove(self) -> None:
        if self._optimizer.__dict__.get("zero_grad") is self._installed:
            del self._optimizer.__dict__["zero_grad"]


class OptimizerBridge:
    """The engine's optimizer hooks: settle and agree before a step, refresh kept buffers after it."""

    @engine_work
    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._in_substep:
            return
        if self.state is TrainingState.BACKWARD and in_backward():
            raise ZeroError("optimizer.step() was called during backward; call it after loss.backward() returns")
        self.settle()
        if not self.sync_gradients:
            raise ZeroError(
                "optimizer.step() was called inside model.no_sync(): this backward's gradients were not reduced. "
                "Run the last micro-batch's forward and backward outside no_sync(), then step"
            )
        if any(chunk.has_unreduced_gradients for chunk in self._reduce_order):
            raise ZeroError(
                "optimizer.step() after a backward inside model.no_sync(): the accumulated gradients were never "
                "reduced. Run the last micro-batch's forward and backward outside no_sync(), then step"
            )
        self._lockstep.begin("optimizer.step()", self.step_count)
        if self.scaler is not None:
            self._check_overflow()
        self._step_open = True  # before the policy's own early steps, which _abort_step must undo too
        self.placement.before_step(self.chunks)

    def _check_overflow(self) -> None:
        """See [Note: one overflow check per step]."""
        if not self.loss_scaled:
            raise ZeroError(
                "this step's gradients were not loss-scaled: with Precision(loss_scale=...) call "
                "model.backward(loss) instead of loss.backward()"
            )
        grads = [to_local(seg.param.grad) for c in self._reduce_order for seg in c.segments if seg.param.grad is not None]
        found = torch.zeros(1, dtype=torch.float32, device=self.device)
        for device, group in by_device(grads).items():
            found_here = torch.zeros(1, dtype=torch.float32, device=device)
            # torch's fused finite check (GradScaler's); an inv_scale of 1 leaves the gradients as they are
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_here, torch.ones(1, device=device))
            found += found_here.to(self.device)
        flag = torch.tensor([1 if found.item() > 0 else 0], dtype=torch.uint8)
        overflow = bool(self.comm.agree_any(flag)[0].item())
        if overflow:
            for chunk in self._reduce_order:
                for seg in chunk.segments:
                    seg.param.grad = None  # the optimizer skips parameters without a gradient
        self.scaler.update(overflow)

    @engine_work
    def step_chunks(self, chunks: Sequence[Chunk]) -> None:
        """Run the optimizer on these chunks' segments only, now (for placement policies, from ``before_step``).

        torch's optimizers skip parameters whose gradient is ``None``, so the other segments'
        gradients are set aside for the call. The stepped segments' gradients are set aside
        until the user's ``optimizer.step()`` has run, so it skips them, and then come back.
        """
        targets = {id(seg.param) for c in chunks for seg in c.segments}
        aside = [(seg.param, seg.param.grad) for c in self._reduce_order for seg in c.segments
                 if seg.param.grad is not None and id(seg.param) not in targets]
        for param, _ in aside:
            param.grad = None
        self._in_substep = True
        try:
            self.optimizer.step()
        finally:
            self._in_substep = False
            for param, grad in aside:
                param.grad = grad
        for chunk in chunks:
            for seg in chunk.segments:
                if seg.param.grad is not None:
                    self._stepped.append((seg.param, seg.param.grad))
                    seg.param.grad = None

    @engine_work
    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._in_substep:
            return
        self._step_open = False
        for param, grad in self._stepped:
            param.grad = grad
        self._stepped = []
        self.loss_scaled = False
        skipped = self.scaler is not None and self.scaler.last_step_skipped
        if not skipped:
            self._publish_kept_buffers()
        self._free_idle_buffers()
        self.placement.after_step(self.chunks)
        self._expected, self._last_expected = {}, {}  # graphs built before the step cannot be backwarded after it
        self._exposed = set()
        self.step_count += 1
        finished = self.comm.stats.end_step()
        self.hook.zero_after_step(engine=self, stats=self.comm.stats.summary(finished))

    def _publish_kept_buffers(self) -> None:
        """Refresh the full buffers stages 1 and 2 keep from the updated master shards (collective)."""
        if not self._refresh_after_step:
            return
        with torch.profiler.record_function("ZeRO::publish_parameters"):
            # one group at a time: each all-gather's receive buffer is free again before the next one takes it
            for group in self._refresh_after_step:
                for pending in group.publish_parameters(self.comm):
                    if pending is not None:
                        pending.wait()

    @engine_work
    def _abort_step(self) -> None:
        """``optimizer.step()`` raised after the engine prepared it (a hook, an optimizer error).

        What the optimizer already updated stays (as in one process); gradients set aside for
        a placement policy's early step come back, the kept full buffers are refreshed from the
        masters (so forward sees what the optimizer holds), and the placement policy puts
        everything back where it keeps it. The step is not counted."""
        self._step_open = False
        self._in_substep = False
        for param, grad in self._stepped:
            param.grad = grad
        self._stepped = []
        self._publish_kept_buffers()
        self._free_idle_buffers()
        self.placement.after_step(self.chunks)

    def discard_accumulation(self, set_to_none: bool = True) -> None:
        """``zero_grad()``: gradients a ``no_sync()`` window accumulated and never reduced are dropped, as in DDP.

        With ``set_to_none=False``, a parameter the window gave a gradient on this rank keeps a
        zero gradient, as its ``.grad`` would in one process (momentum then still acts on it)."""
        if self.state is TrainingState.BACKWARD and in_backward():
            raise ZeroError("zero_grad() was called during backward; call it before the forward or after the step")
        self.settle()
        for chunk in self.chunks:
            if not chunk.has_unreduced_gradients:
                continue
            if not set_to_none:
                for seg in chunk.segments:
                    if chunk.got_grad[seg.slot] and seg.param.grad is None and seg.param.requires_grad:
                        device = chunk.grad_device or seg.local.device  # where reduced gradients would land
                        seg.param.grad = chunk.wrap(seg.slot, torch.zeros_like(seg.local, device=device))
            chunk.discard_gradients()
