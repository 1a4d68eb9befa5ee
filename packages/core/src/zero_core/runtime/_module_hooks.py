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

from zero_core.chunks.chunk import Chunk
from zero_core.runtime._unit import Unit, UnitHost

__all__ = ["ModuleHooks", "untraced"]


def untraced(hook: Any) -> Any:
    """``hook`` run as plain Python even inside a compiled region. See [Note: torch.compile].

    A compiled module's ``_call_impl`` traces the forward hooks of the modules it calls. Zero's
    hooks communicate and swap the modules' parameters (``param.data = ...``, which dynamo would
    record as an in-place ``set_`` and autograd then rejects in backward); as FSDP2 does with its
    own hooks, they are excluded from tracing and run eagerly at a graph break."""
    import torch._dynamo  # lazily: zero_core's import stays light; DTensor's ops load it anyway once the model runs

    return torch._dynamo.disable(hook, recursive=True, reason="zero_core hooks gather and release parameters")


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
        # Per chunk index, the units that gather it (told when it is launched for reduction).
        self._units_of: dict[int, tuple[Unit, ...]] = {}
        self._handles: list[Any] = []
        # The compiled modules (held, so their ids stay theirs) the hooks were grouped by.
        self._compiled: tuple[nn.Module, ...] = ()

    def install(self) -> None:
        """Hook each unit; replaces the hooks installed before (a block compiled since then becomes one unit)."""
        self.remove()
        for triggers in self.triggers.values():
            triggers.clear()
        self._compiled = self._compiled_modules()
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
            self._handles.append(module.register_forward_hook(untraced(unit.after_forward)))
        self.units = tuple(built)
        units_of: dict[int, list[Unit]] = {}
        for unit in built:
            for chunk in unit.chunks:
                units_of.setdefault(chunk.index, []).append(unit)
        self._units_of = {index: tuple(units) for index, units in units_of.items()}

    def begin_forward(self) -> None:
        """The wrapped model's forward begins: no unit has run in it yet."""
        self._ran.clear()

    def units_idle(self) -> None:
        """The step's forward and backward are over (or undone): every unit is IDLE again."""
        for unit in self.units:
            unit.after_backward()

    def chunk_reduced(self, chunk: Chunk) -> None:
        """``chunk`` was launched for reduction in the running backward: tell the units that gather it."""
        for unit in self._units_of.get(chunk.index, ()):
            unit.chunk_reduced()

    def regroup_if_compiled(self) -> None:
        """A module was compiled (or a compiled one replaced) since the hooks were installed: install them again."""
        compiled = self._compiled_modules()
        if len(compiled) != len(self._compiled) or any(a is not b for a, b in zip(compiled, self._compiled)):
            self.install()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._compiled = ()
        self.units = ()
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
