"""One unit of gather and release: a module that registers parameters, or the compiled block above such modules.

[Note: the unit of gather and release]
FSDP2 keeps one object per ``fully_shard`` call (``FSDPParamGroup``) that gathers, reshards and reduces its
parameters. Zero's unit is the module whose forward needs a set of chunks (see [Note: when chunks are gathered
and released] and [Note: torch.compile] in ``zero_core.runtime._engine``), and a :class:`Unit` is its runtime
object: its chunks, its :class:`~zero_core.base._state.UnitState`, and one method per moment of a step at which
its torch hooks fire: :meth:`Unit.before_forward` (its forward pre-hook), :meth:`Unit.after_forward` (its forward
hook), :meth:`Unit.before_backward` (the first gradient at its outputs), :meth:`Unit.chunk_reduced` (one of its
chunks launched for reduction; the last makes it AFTER_BACKWARD, and its ``.grad`` are set as the reductions land)
and :meth:`Unit.after_backward` (the backward's one end). What is not the unit's alone stays with
the objects that see across units, because a chunk is shared by every unit whose parameters it holds (a GPT-2
block's six modules share one chunk under the chunk strategy): a gradient arrives per parameter and is reduced
per gather group, in one order across groups (``GradientReducer``); a chunk is released after forward when every
unit that needs it has run (the triggers of ``ModuleHooks``); the end of a backward, and of the step after it,
release and hand over every chunk at once (``Engine._end_backward``, ``Residency.after_step``). A unit moves its
chunks only through the engine's ``Residency`` (see [Note: who moves a chunk]).
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import torch
from torch import nn

from zero_core.base._accounting import engine_work
from zero_core.base._state import TrainingState, UnitState
from zero_core.base._trace import POST_FORWARD, PRE_BACKWARD, PRE_FORWARD, traced
from zero_core.base.errors import ZeroError
from zero_core.chunks.chunk import Chunk
from zero_core.runtime._autograd import in_backward, on_first_gradient, tensors_of
from zero_core.runtime._backward import BackwardPass
from zero_core.runtime._module_params import ModuleParameters
from zero_core.runtime._reducer import GradientReducer
from zero_core.runtime._residency import Residency

__all__ = ["Unit", "UnitHost"]


class UnitHost(Protocol):
    """What a unit reads of the engine that runs it (the engine; a protocol, so this module needs no import of it)."""

    state: TrainingState
    params: ModuleParameters
    residency: Residency
    reducer: GradientReducer

    @property
    def backward_pass(self) -> BackwardPass | None: ...

    @property
    def computes_watched(self) -> bool: ...

    def enter_backward(self) -> None: ...

    def expose(self, chunk_indices: set[int]) -> None: ...


class Unit:
    """One module (or compiled block) that gathers its chunks before its forward and releases them after."""

    __slots__ = ("_before_own_backward", "_host", "_keeps_grads", "_params", "_ran", "_released", "_triggers", "_watched",
                 "chunks", "kept", "module", "module_id", "state")

    def __init__(self, module: nn.Module, chunks: tuple[Chunk, ...], host: UnitHost,
                 triggers: dict[int, set[int]], ran: dict[int, set[int]]) -> None:
        self.module = module
        self.module_id = id(module)
        self.chunks = chunks  # in index order
        self.state = UnitState.IDLE
        self._host = host
        self._params = host.params
        # See [Note: a unit whose chunks are ready] below.
        self._watched = host.computes_watched
        # Per chunk index, the units that gather it (shared with ModuleHooks), and those that ran in this forward
        # since it was last released (cleared when a root forward begins).
        self._triggers = triggers
        self._ran = ran
        # Its chunks a forward may release: a kept chunk (``persistent``, fixed when the chunk is built: stages 1 and 2,
        # stage 3 at one rank) is never released, so its forward needs no bookkeeping of which units ran (this runs
        # for every unit in every forward; at stage 2 it is every chunk).
        self._released = tuple(c for c in chunks if not c.persistent)
        # Whether a chunk of it keeps its gradient buffer for the run (stage 1), which its backward prepares.
        self._keeps_grads = any(c.stage == 1 for c in chunks)
        # What its outputs' first gradient calls in each backward: made once, not per forward.
        self._before_own_backward = functools.partial(self.before_backward, chunks)
        # See [Note: kept units].
        self.kept = not self._released and not self._keeps_grads and not self._watched

    # [Note: kept units]
    # A unit whose chunks are all kept (stage 2, stage 3 at one rank: nothing to release after its forward or to
    # gather for its backward), none of them keeping a gradient buffer its backward prepares (stage 1), under a
    # placement policy that does not watch every compute, has nothing to do after its forward or when the backward
    # reaches its outputs but change its state. So it gets no forward hook and no hook at its outputs (the hook a
    # forward registers on each unit's outputs, and the call it makes in backward, were about 6% of a 48-block
    # step at one rank): ModuleHooks moves every kept unit that ran to AFTER_FORWARD when the wrapped model's
    # forward returns, and to BACKWARD when a backward begins (the engine's begin, from the root's outputs or the
    # first gradient). Its forward pre-hook stays: it marks the unit FORWARD, and refuses a call of the module
    # outside the wrapped model's forward, where the modules hold the sharded parameters.

    def ready(self, chunks: tuple[Chunk, ...]) -> bool:
        """[Note: a unit whose chunks are ready]
        Every module that registers parameters is a unit with hooks (580 tensors in 48 thin blocks make
        about 290 units), while a chunk holds the parameters of many units: the first unit of a chunk
        gathers it and registers its real parameters in every module that holds them, and the hooks of the
        others find nothing to do. Gathering, the placement policy's ``before_compute`` and registering
        cost about 70 us per call in Python, 40 ms of a 48-block stage-3 step; so a unit whose chunks are
        all gathered (none in flight) and registered returns at once, unless the placement policy watches
        every compute (it overrides ``before_compute``, as Gemini's trace does). What the scheduler does
        is unchanged: it acts only on chunks not gathered or still in flight."""
        return not self._watched and self._params.holds(chunks)

    # -- the moments of a step -------------------------------------------------------------------
    def before_forward(self, module: nn.Module, args: Any) -> None:
        """Its forward pre-hook: gather its chunks (also for a recomputation in backward)."""
        # self.ready(), inlined: this runs for every unit in every forward
        if self._host.state is TrainingState.FORWARD and not self._watched and self._params.holds(self.chunks):
            self.state = UnitState.FORWARD
            return
        self._gather_for_forward(self.chunks, module)
        self.state = UnitState.FORWARD

    @traced(PRE_FORWARD, chunks="chunks")  # apart from the return above: a unit with nothing to do opens no range
    def _gather_for_forward(self, chunks: tuple[Chunk, ...], module: nn.Module) -> None:
        host = self._host
        if host.state in (TrainingState.IDLE, TrainingState.BACKWARD_PENDING):
            if not in_backward():
                raise ZeroError(
                    f"{type(module).__name__} ran outside the wrapped model's forward, but its parameters are "
                    "sharded; call the model returned by zero_core.shard, not one of its submodules"
                )
            host.enter_backward()  # activation checkpointing recomputes before any other backward hook
        if host.state is TrainingState.BACKWARD:
            self._params.use_unsharded()  # a recomputation reads the modules' parameters
        host.residency.gather(chunks, backward=host.state is TrainingState.BACKWARD)

    @traced(POST_FORWARD, chunks="self.chunks")
    def after_forward(self, module: nn.Module, args: Any, outputs: Any) -> None:
        """Its forward hook: release (reshard) each chunk every unit that needs it has run, and hook its outputs
        for its backward."""
        host = self._host
        if host.state is not TrainingState.FORWARD:
            return  # recomputation under activation checkpointing: keep gathered for the backward
        self.state = UnitState.AFTER_FORWARD
        chunks = self.chunks
        outs = tensors_of(outputs)
        graph = torch.is_grad_enabled()
        returned: set[int] = set()
        chunk_of = self._params.chunk_of
        for t in outs:  # returned() only when one of them is a parameter (rare): this runs for every unit
            if id(t) in chunk_of:
                returned = self._params.returned(outs)
                break
        released = self._released
        if returned:  # a module returned one of its parameters: its caller reads it after this hook
            if graph:
                host.expose(returned)
            chunks = tuple(c for c in chunks if c.index not in returned)
            released = tuple(c for c in released if c.index not in returned)
        triggers, ran_by_chunk, me = self._triggers, self._ran, self.module_id
        for chunk in released:
            ran = ran_by_chunk.get(chunk.index)
            if ran is None:
                ran = ran_by_chunk[chunk.index] = set()
            ran.add(me)
            if ran >= triggers[chunk.index]:
                ran_by_chunk[chunk.index] = set()
                host.residency.release_after_forward([chunk], for_backward=graph)
        if graph:
            # Not on leaves (a module that returns one of its parameters): a hook on a leaf stays for good,
            # one more every step.
            tensors = [t for t in outs if t.requires_grad and t.grad_fn is not None]
            if tensors:
                on_first_gradient(tensors, self._before_own_backward if chunks is self.chunks
                                  else functools.partial(self.before_backward, chunks))

    def before_backward(self, chunks: tuple[Chunk, ...], *_: Any) -> None:
        """The first gradient reached its outputs: gather ``chunks`` again for its backward (its own, less those of
        parameters its module returned, which the backward's start gathers)."""
        # a unit whose chunks are ready in a running backward (see [Note: a unit whose chunks are ready]) has nothing
        # to do but change its state: no wrappers, no range (this runs for every unit in every backward)
        if self._host.state is TrainingState.BACKWARD and not self._keeps_grads and \
                (not chunks or (not self._watched and self._params.holds(chunks))):
            self.state = UnitState.BACKWARD
            return
        self._gather_for_backward(chunks)

    @traced(PRE_BACKWARD, chunks="chunks")
    @engine_work
    def _gather_for_backward(self, chunks: tuple[Chunk, ...]) -> None:
        host = self._host
        if host.state is not TrainingState.BACKWARD:
            host.enter_backward()
        self.state = UnitState.BACKWARD
        if not chunks:
            return
        if not self.ready(chunks):
            host.residency.gather(chunks, backward=True)
        backward = host.backward_pass
        if backward is None or not backward.accumulates:
            return
        for chunk in chunks:
            if chunk.stage == 1 and not host.reducer.is_reduced(chunk):  # kept anyway
                chunk.grads.prepare()  # stages 2 and 3: see [Note: gradient buffers on arrival]

    def chunk_reduced(self) -> None:
        """One of its chunks was launched for reduction: once all are (asked of the reducer), its backward is over
        (AFTER_BACKWARD): every gradient of its parameters is in, and each lands in its ``.grad`` with its
        reduction (see [Note: gradients handed over as they land] in ``zero_core.chunks._chunk_grads``)."""
        if self.state is UnitState.AFTER_BACKWARD:
            return
        if len(self.chunks) > 1:  # a loop, not all(): this runs for each unit of every chunk reduced
            is_reduced = self._host.reducer.is_reduced
            for chunk in self.chunks:
                if chunk.requires_grad and not is_reduced(chunk):
                    return
        self.state = UnitState.AFTER_BACKWARD

    def after_backward(self) -> None:
        """The backward ended (finished or undone): the unit is IDLE until its next forward."""
        self.state = UnitState.IDLE

    def __repr__(self) -> str:
        return f"Unit({type(self.module).__name__}, chunks={[c.index for c in self.chunks]}, {self.state.value})"
