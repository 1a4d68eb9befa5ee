"""The phases of a step, named for ``torch.profiler`` traces and for debug logs.

[Note: phase ranges]
Every phase of zero's work is one ``torch.profiler.record_function`` range with a fixed name in
one namespace, ``ZeRO::<phase>`` (as FSDP2's ``FSDP::pre_forward``, ``FSDP::all_gather``), so zero
shows up in a trace beside the model's ops and traces of different strategies line up; and, when
the ``zero.core.phase`` logger is enabled for DEBUG (``logging.getLogger("zero").setLevel(
logging.DEBUG)`` reaches it), each phase logs one line as it begins, naming its chunks. The names are
the constants below; ``docs/observability.md`` lists them for users, and a test checks that a
training step under the profiler opens each of them.

These ranges sit on the hot path: a 48-block model has about 290 units, each with a pre- and a
post-forward hook every step. ``record_function`` costs microseconds even with no profiler running
(two dispatcher calls), so a range is opened only while a profiler records on this thread, and a log
line is made only while the logger is enabled: with neither, :func:`phase` returns one shared no-op
context (no allocation, no formatting) after two flag reads, and :func:`traced` calls the function
straight through. There is one range per phase per unit, never one per parameter.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from zero_core.base._log import get_logger

__all__ = ["PHASES", "phase", "traced"]

#: Where each phase's debug line goes: a child of ``zero.core``, so it can be silenced alone
#: (``logging.getLogger("zero.core.phase").setLevel(logging.INFO)``) while the rest of zero logs at DEBUG.
logger = get_logger("core.phase")

# -- the names: a step, in order ----------------------------------------------------------------
ROOT_PRE_FORWARD = "ZeRO::root_pre_forward"  # the wrapped model's forward begins: lockstep round, unsharded params
PRE_FORWARD = "ZeRO::pre_forward"  # a unit's forward pre-hook that gathers its chunks
ALL_GATHER = "ZeRO::all_gather"  # the all-gathers of one gather (forward, backward, or on demand)
POST_FORWARD = "ZeRO::post_forward"  # a unit's forward hook: release (reshard) the chunks every user has run
ROOT_POST_FORWARD = "ZeRO::root_post_forward"  # the wrapped model's forward returned: release the rest
PRE_BACKWARD = "ZeRO::pre_backward"  # a backward begins, or reaches a unit's outputs and gathers its chunks again
REDUCE_SCATTER = "ZeRO::reduce_scatter"  # one chunk's gradient reduction issued
POST_BACKWARD = "ZeRO::post_backward"  # the backward ended: the rest of the reductions, their wait, handing gradients over
REDUCE_WAIT = "ZeRO::reduce_wait"  # waiting for every issued reduction to complete
PRE_STEP = "ZeRO::pre_step"  # before optimizer.step(): lockstep round, overflow check, a policy's early steps
STEP_CHUNKS = "ZeRO::step_chunks"  # a placement policy steps some chunks' segments early (from before_step)
POST_STEP = "ZeRO::post_step"  # after optimizer.step(): refresh kept full buffers with the new values
REFRESH_PARAMETERS = "ZeRO::refresh_parameters"  # stage 1 and 2: all-gather updated shards into the full buffers
REFRESH_GROUP_SHARDS = "ZeRO::refresh_group_shards"  # stage 3 inside a group of k ranks: refresh the 1/k copies
# -- outside a step -------------------------------------------------------------------------------
MATERIALIZE = "ZeRO::materialize"  # a lazily built model's initialisers replayed into its shards
CHECKPOINT_SAVE = "ZeRO::checkpoint_save"  # save_checkpoint (with async_=True: the blocking part, the staging)
CHECKPOINT_LOAD = "ZeRO::checkpoint_load"  # load_checkpoint
STATE_DICT_GATHER = "ZeRO::state_dict_gather"  # model.full_state_dict() / full_parameters(): chunks gathered whole
STATE_DICT_SAVE = "ZeRO::state_dict_save"  # save_full_state_dict: one file or a Hugging Face directory
STATE_DICT_LOAD = "ZeRO::state_dict_load"  # model.load_full_state_dict()

#: Every phase name, in the order above.
PHASES = (ROOT_PRE_FORWARD, PRE_FORWARD, ALL_GATHER, POST_FORWARD, ROOT_POST_FORWARD, PRE_BACKWARD, REDUCE_SCATTER,
          POST_BACKWARD, REDUCE_WAIT, PRE_STEP, STEP_CHUNKS, POST_STEP, REFRESH_PARAMETERS, REFRESH_GROUP_SHARDS,
          MATERIALIZE, CHECKPOINT_SAVE, CHECKPOINT_LOAD, STATE_DICT_GATHER, STATE_DICT_SAVE, STATE_DICT_LOAD)

# Whether a profiler records on this thread (kineto's torch.profiler.profile, the legacy profiler, emit_nvtx): one
# C++ flag read, a fraction of a microsecond.
_profiling = torch._C._autograd._profiler_enabled
_DEBUG = logging.DEBUG

F = TypeVar("F", bound=Callable[..., Any])


class _Off:
    """The context :func:`phase` returns while nobody watches: one shared instance, nothing to do."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_OFF = _Off()


def _describe(detail: Any) -> str:
    """What a debug line says after the phase's name: a chunk or chunks by index, anything else as ``str``."""
    if detail is None:
        return ""
    if isinstance(getattr(detail, "index", None), int):
        return f" chunk {detail.index}"
    if isinstance(detail, (tuple, list)):
        indices = [getattr(item, "index", None) for item in detail]
        if all(isinstance(i, int) for i in indices):
            return f" chunks {indices}"
    return f" {detail}"


class _On:
    """One phase while a profiler records or the logger is enabled: a range and/or a debug line."""

    __slots__ = ("_detail", "_name", "_range")

    def __init__(self, name: str, detail: Any, profiling: bool) -> None:
        self._name = name
        self._detail = detail
        self._range: Any = torch.profiler.record_function(name) if profiling else None

    def __enter__(self) -> None:
        if logger.isEnabledFor(_DEBUG):
            logger.debug("%s%s", self._name, _describe(self._detail))
        if self._range is not None:
            self._range.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._range is not None:
            self._range.__exit__(*exc)


def phase(name: str, detail: Any = None) -> _On | _Off:
    """A context for phase ``name`` (one of :data:`PHASES`): a profiler range and a debug line naming
    ``detail`` (the chunks, usually), or nothing at all while neither a profiler nor the logger watches.

    ``detail`` is only read when the line is logged: pass what the call site already holds, never a
    string built for the purpose."""
    profiling = _profiling()
    if not profiling and not logger.isEnabledFor(_DEBUG):
        return _OFF
    return _On(name, detail, profiling)


def traced(name: str, *, chunks: str | None = None) -> Callable[[F], F]:
    """Decorate a function whose every call is phase ``name``: :func:`phase` around the whole call, whose
    debug line names the call's argument called ``chunks`` (when given: that parameter's name), or, for
    ``"self.NAME"``, that attribute of a method's object (a unit's hooks, whose chunks are its own)."""

    def decorate(function: F) -> F:
        # where the argument sits when it may be passed by position (signature() follows functools.wraps); a
        # keyword-only one after *args is never args[i]
        parameters = list(inspect.signature(function).parameters.values())
        by_position = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        position = by_position.index(chunks) if chunks in by_position else sys.maxsize
        attribute = chunks[len("self."):] if chunks is not None and chunks.startswith("self.") else None

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            profiling = _profiling()
            if not profiling and not logger.isEnabledFor(_DEBUG):
                return function(*args, **kwargs)
            detail = None
            if attribute is not None:
                detail = getattr(args[0], attribute)
            elif chunks is not None:
                detail = args[position] if position < len(args) else kwargs.get(chunks)
            with _On(name, detail, profiling):
                return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
