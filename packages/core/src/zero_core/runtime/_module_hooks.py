"""The forward hooks of each unit of gather and release. See [Note: torch.compile] in ``zero_core.runtime._engine``.

A unit is a module that registers parameters, or the outermost compiled module above it, which
then gathers and releases the chunks of all of them. The engine owns one :class:`ModuleHooks`
and gives it itself as the units' host; this object decides which modules are units, with which
chunks, builds a :class:`~zero_core.runtime._unit.Unit` for each and wires its forward hooks to
the unit's methods (see [Note: the unit of gather and release] in ``zero_core.runtime._unit``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from torch import nn

from zero_core.base._state import UnitState
from zero_core.chunks.chunk import Chunk
from zero_core.runtime._unit import Unit, UnitHost

__all__ = ["ModuleHooks", "untraced"]


_REASON = "zero_core hooks gather and release parameters"


def untraced(hook: Any) -> Any:
    """``hook`` run as plain Python even inside a compiled region. See [Note: torch.compile].

    A compiled module's ``_call_impl`` traces the forward hooks of the modules it calls. Zero's
    hooks communicate and swap the modules' parameters (``param.data = ...``, which dynamo would
    record as an in-place ``set_`` and autograd then rejects in backward); as FSDP2 does with its
    own hooks, they are excluded from tracing and run eagerly at a graph break.

    [Note: hooks dynamo skips without a wrapper]
    ``torch._dynamo.disable(hook, recursive=True)`` wraps the hook in a function that switches
    dynamo's frame evaluation off and on around every call: about six Python calls per hook, two
    hooks per unit, 385 calls a step on a 48-block model, paid whether or not anything is compiled.
    The same effect is had once per function: its code object is marked for dynamo's frame
    evaluation to skip it and everything it calls (``set_code_exec_strategy`` with SKIP for the frame
    and recursively, what the wrapper's switch does per call), and the function carries the
    ``_torchdynamo_disable`` mark that makes a trace that reaches it break the graph and call it
    eagerly, as it does for the wrapper. A bound method's function is marked (every unit shares
    it); where torch lacks the API, the wrapper is used."""
    function = getattr(hook, "__func__", None)
    if function is not None and _skip_in_dynamo(function):
        return hook
    import torch._dynamo  # lazily: zero_core's import stays light; DTensor's ops load it anyway once the model runs

    return torch._dynamo.disable(hook, recursive=True, reason=_REASON)


def _skip_in_dynamo(function: Any) -> bool:
    """Mark ``function`` for dynamo to skip, with what it calls; whether torch has the means (see
    [Note: hooks dynamo skips without a wrapper])."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:  # pragma: no cover - another torch
        return False
    # applied at every install (cheap): a dynamo reset may forget the strategies of codes it has seen
    set_code_exec_strategy(function.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    function._torchdynamo_disable = True
    function._torchdynamo_disable_msg = _REASON
    return True


class ModuleHooks:
    """Which modules are units that gather which chunks, the units, and the forward hooks that run them."""

    def __init__(self, root: nn.Module, registrations: Sequence[tuple[nn.Module, str, Chunk, int]],
                 chunks: Sequence[Chunk], host: UnitHost) -> None:
        self._root = root
        self._registrations = registrations
        self._host = host
        # Per chunk index, the ids of the units whose forward gathers it: a forward releases it once all ran.
        self.triggers: dict[int, set[int]] = {c.index: set() for c in chunks}
        # Per chunk index, the units that ran in the current forward since it was last released (the units hold it).
        self._ran: dict[int, set[int]] = {}
        self.units: tuple[Unit, ...] = ()
        # The units without a forward hook (see [Note: kept units] in zero_core.runtime._unit), moved here instead.
        self._kept: tuple[Unit, ...] = ()
        # Per chunk index, the units that gather it (told when it is launched for reduction).
        self._units_of: dict[int, tuple[Unit, ...]] = {}
        self._handles: list[Any] = []
        # The compiled modules (held, so their ids stay theirs) the hooks were grouped by.
        self._compiled: tuple[nn.Module, ...] = ()
        # What regroup_if_compiled compares: see there.
        self._snapshot: list[tuple[dict[str, Any], Any, dict[str, Any], dict[str, Any]]] = []

    def install(self) -> None:
        """Hook each unit; replaces the hooks installed before (a block compiled since then becomes one unit)."""
        self.remove()
        for triggers in self.triggers.values():
            triggers.clear()
        self._compiled = self._compiled_modules()
        self._snapshot = self._take_snapshot()
        owners = self._units(self._compiled)
        by_unit: dict[int, tuple[nn.Module, dict[int, Chunk]]] = {}
        for m, _, chunk, _ in self._registrations:
            owner = owners.get(id(m), m)
            by_unit.setdefault(id(owner), (owner, {}))[1][id(chunk)] = chunk
        built: list[Unit] = []
        for module, chunks in by_unit.values():
            ordered = tuple(sorted(chunks.values(), key=lambda c: c.index))
            for chunk in ordered:
                self.triggers[chunk.index].add(id(module))
            unit = Unit(module, ordered, self._host, self.triggers, self._ran)
            built.append(unit)
            self._handles.append(module.register_forward_pre_hook(untraced(unit.before_forward)))
            if not unit.kept:  # see [Note: kept units] in zero_core.runtime._unit
                self._handles.append(module.register_forward_hook(untraced(unit.after_forward)))
        self.units = tuple(built)
        self._kept = tuple(u for u in built if u.kept)
        units_of: dict[int, list[Unit]] = {}
        for unit in built:
            for chunk in unit.chunks:
                units_of.setdefault(chunk.index, []).append(unit)
        self._units_of = {index: tuple(units) for index, units in units_of.items()}

    def begin_forward(self) -> None:
        """The wrapped model's forward begins: no unit has run in it yet."""
        self._ran.clear()

    def forward_returned(self) -> None:
        """The wrapped model's forward returned: each kept unit that ran in it is AFTER_FORWARD, as its forward hook
        would have made it (see [Note: kept units] in ``zero_core.runtime._unit``)."""
        forward, after = UnitState.FORWARD, UnitState.AFTER_FORWARD
        for unit in self._kept:  # attribute reads only: this runs at every forward
            if unit.state is forward:
                unit.state = after

    def backward_began(self) -> None:
        """A backward began: each kept unit whose forward returned is BACKWARD (see [Note: kept units])."""
        after, backward = UnitState.AFTER_FORWARD, UnitState.BACKWARD
        for unit in self._kept:
            if unit.state is after:
                unit.state = backward

    def units_idle(self) -> None:
        """The step's forward and backward are over (or undone): every unit is IDLE again."""
        for unit in self.units:
            unit.after_backward()

    def chunk_reduced(self, chunk: Chunk) -> None:
        """``chunk`` was launched for reduction in the running backward: tell the units that gather it."""
        for unit in self._units_of.get(chunk.index, ()):
            unit.chunk_reduced()

    def regroup_if_compiled(self) -> None:
        """A module was compiled (or a compiled one replaced) since the hooks were installed: install them again.

        Asked at every root forward, so it compares a snapshot taken at install instead of walking
        ``modules()`` (a generator call per module): a module compiled in place (``nn.Module.compile()``)
        has its ``_compiled_call_impl`` set, and a compiled module put in a parent's place
        (``parent.block = torch.compile(block)``) changes that parent's children."""
        for attributes, compiled_call, children, kept in self._snapshot:
            # operators only, no calls: this runs over every module at every root forward
            if children != kept or ("_compiled_call_impl" in attributes
                                    and attributes["_compiled_call_impl"] is not compiled_call):
                compiled = self._compiled_modules()
                if len(compiled) != len(self._compiled) or any(a is not b for a, b in zip(compiled, self._compiled)):
                    self.install()
                else:
                    self._snapshot = self._take_snapshot()
                return

    def _take_snapshot(self) -> list[tuple[dict[str, Any], Any, dict[str, Any], dict[str, Any]]]:
        """Each module below the root (the root included): its attributes, its compiled call (None unless compiled
        in place), its children and a copy of them (modules compare by identity)."""
        return [(m.__dict__, m.__dict__.get("_compiled_call_impl"), m._modules, dict(m._modules))
                for m in self._root.modules()]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._compiled = ()
        self.units = ()
        self._kept = ()
        self._units_of = {}

    def _compiled_modules(self) -> tuple[nn.Module, ...]:
        """The modules below the root that are compiled, in ``modules()`` order."""
        # OptimizedModule exists only once dynamo is loaded: never import it from here
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        optimized = getattr(eval_frame, "OptimizedModule", None)
        return tuple(m for m in self._root.modules() if m is not self._root and (
            getattr(m, "_compiled_call_impl", None) is not None or (optimized is not None and isinstance(m, optimized))))

    def _units(self, compiled: tuple[nn.Module, ...]) -> dict[int, nn.Module]:
        """Each module below a compiled one (by id) -> its outermost compiled ancestor, which runs the hooks."""
        units: dict[int, nn.Module] = {}
        if not compiled:
            return units
        compiled_ids = {id(m) for m in compiled}
        seen: set[int] = set()
        stack: list[tuple[nn.Module, nn.Module | None]] = [(self._root, None)]
        while stack:
            module, unit = stack.pop()
            for child in module.children():
                if id(child) in seen:
                    continue  # a module reached twice belongs to the first place it was found
                seen.add(id(child))
                child_unit = unit if unit is not None else (child if id(child) in compiled_ids else None)
                if child_unit is not None:
                    units[id(child)] = child_unit
                stack.append((child, child_unit))
        return units
