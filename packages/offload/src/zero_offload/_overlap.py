"""Host steps hidden behind the backward: each chunk's master shard steps on the host as soon as its gradient is down.

[Note: overlapped host steps]
With ``GeminiConfig(overlap_step=True)``, a chunk whose master shard, gradient and optimizer states
are all on the host steps *speculatively* during the backward, on one worker thread, as soon as its
reduced gradient has landed on the host (the policy looks at every compute point of the backward and
once more when it ends). ``optimizer.step()`` then waits for the steps still running and *validates*
each: a chunk whose gradients are exactly the tensors the backward handed over, unchanged (the
same tensors, with the same values: a clip's ``mul_`` changes them), keeps its step; the
user's step skips it and does only what remains. Anything else undoes the speculative step from a
copy taken just before it (master shard and optimizer states, restored bit for bit) and the chunk
steps normally. Undone are:

- a chunk whose gradient was changed or replaced between backward and step (clipping, unscaling,
  ``p.grad = ...``, ``zero_grad()``): it steps with the new gradient. The first time this happens
  the policy turns overlapping off for the rest of the run (a run that clips every step would only
  pay twice), with a warning;
- every chunk, when the step does not come: the next forward or backward begins first (a second
  backward accumulating into the same gradients, a skipped step), or the backward raised.

So the parameters and states the user sees at ``optimizer.step()`` are those of one-process
PyTorch, and a step that never comes leaves nothing stepped. Chunks step early only when the
gradients are exactly what the backward hands over: every trainable segment's ``.grad`` was
``None`` when the backward began (no accumulation into earlier gradients), this rank got a gradient
for each (so the ranks' agreement at hand-over cannot remove one), there is no loss scaler (its
overflow check needs every gradient before any step) and it is not the warm-up step (the trace
measures the step as it runs without overlap).

The copies cost 16 bytes per parameter for AdamW (shard, both moments and the gradient's values) of
the chunks stepped early, from their step until ``optimizer.step()``; they are charged to the host tier's budget, and
a chunk whose copy does not fit waits for ``optimizer.step()``. That, and the undo when the user
clips, is why the option is off by default.

The early step calls the optimizer's own ``step`` past its hooks (the user's step hooks run once,
at ``optimizer.step()``), with only that chunk's segments holding a gradient; a group that leaves
``foreach`` to torch steps with ``foreach=True`` as the engine's steps do (see [Note: foreach over
sharded parameters] in ``zero_core.runtime._optimizer_bridge``). The kernel is the user's choice:
``AdamW(fused=True)`` runs torch's fused CPU kernel, multi-threaded over torch's intra-op threads
(``torch.get_num_threads()``), which the worker shares with the backward.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from zero_core.plugin import Chunk, get_logger, to_local
from zero_offload._tiers import HOST, Part, Tiers

__all__ = ["HostStepOverlap"]

log = get_logger("offload")


def raw_step(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], Any] | None:
    """The optimizer class's ``step`` without torch's hook wrapper (``None`` if it is not wrapped as torch does)."""
    step: Any = type(optimizer).step
    wrapped = getattr(step, "__wrapped__", None)
    return wrapped if getattr(step, "hooked", False) and callable(wrapped) else None


class _Early:
    """One chunk's speculative step: the copies it undoes from, and the gradients it used."""

    def __init__(self, chunk: Chunk) -> None:
        self.chunk = chunk
        self.shard: torch.Tensor | None = None
        self.states: dict[int, dict[str, Any] | None] = {}
        # The gradients the backward handed over: (segment parameter, the .grad object, its version counter and its
        # local tensor's): a step keeps the early step only if each is still that object, unchanged.
        self.grads: list[tuple[torch.nn.Parameter, torch.Tensor, int, int]] | None = None
        # The gradient values the early step used, by segment parameter: what the step's gradients must still equal
        # (an in-place change through a DTensor gradient, such as torch's clip at several ranks, moves no version
        # counter, so the values are compared).
        self.values: dict[int, torch.Tensor] = {}
        self.backup_bytes = 0
        self.future: Future[None] | None = None


class HostStepOverlap:
    """Speculative host steps during the backward, validated at ``optimizer.step()``. See [Note: overlapped host steps]."""

    def __init__(self, optimizer: torch.optim.Optimizer, tiers: Tiers, *, record_events: bool = False) -> None:
        self.optimizer = optimizer
        self.tiers = tiers
        self.step_fn = raw_step(optimizer)
        self.enabled = self.step_fn is not None
        if not self.enabled:
            log.warning("zero-offload gemini: overlap_step is off: %s.step is not wrapped as torch wraps an "
                        "optimizer's step, so it cannot be called past its hooks", type(optimizer).__name__)
        self._pool: ThreadPoolExecutor | None = None
        self.open = False  # this backward may step chunks early
        self.early: dict[int, _Early] = {}  # stepped (or stepping) early, not yet committed
        self.committed: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # gradients set aside from the user's step
        # Over the run: chunk steps kept, undone, and the host seconds they took (for the report).
        self.kept = 0
        self.undone = 0
        self.step_seconds = 0.0
        self.stepped_elements = 0
        self.record_events = record_events
        self.events: list[tuple[str, int, int]] = []  # (what, chunk index or -1, perf_counter_ns)
        self._lock = threading.Lock()

    def event(self, what: str, index: int = -1) -> None:
        if self.record_events:
            with self._lock:
                self.events.append((what, index, time.perf_counter_ns()))

    # -- the backward ---------------------------------------------------------------------------
    def begin_backward(self, chunks: Sequence[Chunk], *, allowed: bool) -> None:
        """A backward begins: what an earlier one stepped early is undone (no step came between them); this one
        steps chunks early if ``allowed`` and no trainable gradient is set (nothing accumulates into them)."""
        self.undo_all("a second backward began before optimizer.step()")
        self.committed = []  # set aside by a step that raised: those gradients are gone, as the step's own are
        self.open = self.enabled and allowed and all(
            seg.param.grad is None for c in chunks if c.requires_grad for seg in c.segments)

    def poll(self, chunks: Sequence[Chunk], eligible: Callable[[Chunk], bool]) -> None:
        """Submit the host step of every chunk whose reduced gradient has landed."""
        if not self.open:
            return
        for chunk in chunks:
            if chunk.index in self.early or not chunk.requires_grad or chunk.grads.reduced is None:
                continue
            if chunk.is_gathered or chunk.persistent or not eligible(chunk):
                continue
            got = chunk.grads.got
            if not all(got[seg.slot] for seg in chunk.segments if seg.param.requires_grad):
                continue  # the ranks' agreement at hand-over decides these: the step waits for it
            entry = _Early(chunk)
            entry.backup_bytes = self.tiers.nbytes(chunk, Part.PARAMS) + self.tiers.nbytes(chunk, Part.GRADS) + max(
                self.tiers.nbytes(chunk, Part.OPTIM), self.tiers.optim_bytes(chunk))
            if not self.tiers.fits(HOST, entry.backup_bytes):
                continue  # no room for the copy to undo from: it steps at optimizer.step()
            self.tiers._charge(HOST, entry.backup_bytes, check=False)
            self.early[chunk.index] = entry
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-host-step")
            self.event("submit", chunk.index)
            entry.future = self._pool.submit(self._step, entry, list(chunk.grads.reduced))

    @torch.no_grad()
    def _step(self, entry: _Early, reduced: list[torch.Tensor]) -> None:
        """On the worker: copy, then step ``entry.chunk`` alone with the gradient the hand-over will give it."""
        chunk = entry.chunk
        self.event("begin", chunk.index)
        optimizer, state = self.optimizer, self.optimizer.state
        entry.shard = chunk.shard.clone()
        for seg in chunk.segments:
            found = state.get(seg.param)
            entry.states[id(seg.param)] = None if not found else {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in found.items()}
        layout = chunk.layout
        segments = [seg for seg in chunk.segments if seg.param.requires_grad]
        for seg in segments:  # exactly what GradientReducer.hand_over will set (see ChunkGradients.hand_over)
            shape = layout.slots[seg.slot].local_shape(layout.rank)
            piece = reduced[seg.slot][: shape.numel()].view(shape)
            entry.values[id(seg.param)] = piece.clone()
            seg.param.grad = chunk.wrap(seg.slot, piece)
        groups = [g for g in optimizer.param_groups if g.get("foreach", False) is None and not g.get("fused")]
        for group in groups:
            group["foreach"] = True
        began = time.perf_counter()  # the step alone: the copies above are the price of undoing it
        try:
            assert self.step_fn is not None
            self.step_fn(optimizer)
        finally:
            for group in groups:
                group["foreach"] = None
            for seg in segments:
                seg.param.grad = None
        self.step_seconds += time.perf_counter() - began
        self.stepped_elements += sum(seg.local.numel() for seg in segments)
        self.event("end", chunk.index)

    def wait(self) -> None:
        """Wait for every early step submitted; one that failed is undone (with every other) and re-raised."""
        error: BaseException | None = None
        for entry in list(self.early.values()):
            if entry.future is not None:
                try:
                    entry.future.result()
                except BaseException as e:  # noqa: BLE001 - re-raised below, after the undo
                    error = error or e
        if error is not None:
            self.undo_all("an early host step failed")
            self.open = False
            raise error

    def handed_over(self) -> None:
        """The backward handed the gradients over (its end's transition to IDLE): remember them as they are now."""
        for entry in self.early.values():
            if entry.grads is None:
                entry.grads = [(seg.param, seg.param.grad, seg.param.grad._version, to_local(seg.param.grad)._version)
                               for seg in entry.chunk.segments if seg.param.grad is not None]

    # -- the step ---------------------------------------------------------------------------------
    def commit(self) -> tuple[list[Chunk], list[Chunk]]:
        """``optimizer.step()`` begins: the early steps whose gradients are as the backward left them are kept
        (their gradients are set aside from the user's step until :meth:`restore_grads`); the others undone.
        Returns (kept, undone) chunks."""
        self.wait()
        self.open = False
        kept: list[_Early] = []
        undone: list[_Early] = []
        for entry in self.early.values():
            # the same objects, not changed in place through the parameter's gradient or its local tensor
            valid = entry.grads is not None and all(
                param.grad is grad and grad._version == version and to_local(grad)._version == local
                and torch.equal(to_local(grad), entry.values[id(param)])
                for param, grad, version, local in entry.grads)
            (kept if valid else undone).append(entry)
        for entry in undone:
            self._undo(entry)
        for entry in kept:
            self._release(entry)
            for seg in entry.chunk.segments:
                if seg.param.grad is not None:
                    self.committed.append((seg.param, seg.param.grad))
                    seg.param.grad = None
        self.early = {}
        self.kept += len(kept)
        return [e.chunk for e in kept], [e.chunk for e in undone]

    def restore_grads(self) -> None:
        """After the user's step: the gradients of chunks kept from early steps come back (as after any step)."""
        for param, grad in self.committed:
            param.grad = grad
        self.committed = []

    def undo_all(self, why: str) -> None:
        if not self.early:
            return
        self.wait_quietly()
        log.info("zero-offload gemini: %d early host step(s) undone: %s", len(self.early), why)
        for entry in self.early.values():
            self._undo(entry)
        self.early = {}

    def wait_quietly(self) -> None:
        for entry in self.early.values():
            if entry.future is not None:
                try:
                    entry.future.result()
                except BaseException:  # noqa: BLE001, S110 - the step is undone from its copy whatever it did
                    pass

    @torch.no_grad()
    def _undo(self, entry: _Early) -> None:
        chunk, state = entry.chunk, self.optimizer.state
        if entry.shard is not None:  # taken before the step began: what the shard was
            chunk.shard.copy_(entry.shard)
            for seg in chunk.segments:
                before = entry.states.get(id(seg.param))
                if before is None:
                    state.pop(seg.param, None)
                    continue
                now = state[seg.param]
                for key, value in before.items():
                    current = now.get(key)
                    if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor) and current.shape == value.shape:
                        current.copy_(value)
                    else:
                        now[key] = value
                for key in set(now) - set(before):
                    del now[key]
        self.event("undo", chunk.index)
        self.undone += 1
        self._release(entry)

    def _release(self, entry: _Early) -> None:
        entry.shard, entry.states, entry.values = None, {}, {}
        self.tiers._discharge(HOST, entry.backup_bytes)

    def close(self) -> None:
        self.undo_all("the engine was closed")
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def report(self) -> dict[str, Any]:
        return {"kept": self.kept, "undone": self.undone, "seconds": self.step_seconds,
                "elements": self.stepped_elements,
                "ns_per_element": 1e9 * self.step_seconds / self.stepped_elements if self.stepped_elements else None}
