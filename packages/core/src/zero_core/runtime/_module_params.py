"""Which parameter objects the modules hold: the sharded ones between steps, the unsharded ones inside a step.

See [Note: parameter views] in ``zero_core.chunks.chunk`` for the two objects of each parameter and
[Note: parameters used outside their module] in ``zero_core.runtime._released`` for the stand-ins.
One object owns every write to ``module._parameters`` the engine makes, so "what does a module
hold now" has one answer (:attr:`ModuleParameters.unsharded`).
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import torch
from torch import nn

from zero_core.base._state import ChunkState
from zero_core.chunks.chunk import Chunk
from zero_core.runtime._released import ReleasedParameter

__all__ = ["ModuleParameters"]

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_PARAMETERS = operator.attrgetter("_parameters")
_STATE = operator.attrgetter("state")


class ModuleParameters:
    """Every place a parameter is registered (a tied one under several modules) and what it holds there."""

    def __init__(self, module: nn.Module, chunks: Sequence[Chunk],
                 gather_on_demand: Callable[[Chunk, int], nn.Parameter],
                 gradient_hook: Callable[[torch.Tensor], Callable[[torch.Tensor], None]]) -> None:
        self.chunks = tuple(chunks)
        # Makes the hook autograd calls after it accumulated an unsharded parameter's gradient (the engine's: one
        # per parameter, made once, see [Note: one call per gradient] in zero_core.runtime._engine).
        self._gradient_hook = gradient_hook
        self._grad_hooked: set[int] = set()
        self._handles: list[Any] = []
        # Unsharded parameter (by id) -> its chunk, its slot in the chunk, its (first) name.
        self.chunk_of: dict[int, Chunk] = {id(s.param): c for c in chunks for s in c.slots}
        self.slot_of: dict[int, int] = {id(s.param): i for c in chunks for i, s in enumerate(c.slots)}
        self.name_of: dict[int, str] = {id(s.param): s.name for c in chunks for s in c.slots}
        # (module, name, chunk, slot) for every registration, in modules() order.
        self.registrations: list[tuple[nn.Module, str, Chunk, int]] = []
        for m in module.modules():
            for pname, p in m._parameters.items():
                if p is not None and id(p) in self.chunk_of:
                    self.registrations.append((m, pname, self.chunk_of[id(p)], self.slot_of[id(p)]))
        self._by_chunk: dict[int, list[tuple[nn.Module, str, int]]] = {}
        for m, pname, chunk, i in self.registrations:
            self._by_chunk.setdefault(chunk.index, []).append((m, pname, i))
        # What the modules hold, inside forward and backward, for parameters of chunks not gathered.
        self._stand_ins = {(c.index, i): ReleasedParameter(gather_on_demand, c, i) for c in chunks if not c.persistent
                           for i in range(len(c.slots))}
        # Whether the modules hold the unsharded parameters (inside forward and backward) or the sharded ones.
        self.unsharded = True
        # Indices of the chunks whose real unsharded parameters the modules hold now (not stand-ins), while
        # ``unsharded``: a unit whose chunks are all here and gathered has nothing to register (see ``holds``).
        self._real: set[int] = {c.index for c in self.chunks if c.is_gathered}
        # True inside model.gathered_parameters(): the modules hold the context's full copies.
        self.full_copies = False
        # each chunk's segments when the registrations' columns were read, and the columns: see ``_columns``
        self._kept_columns: tuple[list[Any], tuple[Any, ...]] | None = None
        self._indices = frozenset(c.index for c in self.chunks)
        for chunk in self.chunks:
            for slot in chunk.slots:
                self._watch(slot.param)

    def _watch(self, param: torch.Tensor) -> None:
        """Watch ``param``'s gradient accumulation; a frozen one is watched once it is unfrozen."""
        if param.requires_grad and id(param) not in self._grad_hooked:
            self._grad_hooked.add(id(param))
            self._handles.append(param.register_post_accumulate_grad_hook(self._gradient_hook(param)))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def use_unsharded(self, *, stand_ins: bool = True) -> None:
        """Register the unsharded parameters in the modules (forward and backward run on them).

        Each takes its sharded parameter's ``requires_grad``, so freezing or unfreezing through
        ``model.parameters()`` between steps applies to the next forward; the ones that became
        trainable get their gradients watched. ``stand_ins=False`` registers every
        unsharded parameter whatever its chunk holds (``gathered_parameters`` points them at full
        copies of its own)."""
        if self.unsharded:
            return
        if (not stand_ins or all(map(operator.is_, map(_STATE, self.chunks), repeat(ChunkState.GATHERED)))) and \
                self._every_unsharded():  # every chunk real: see [Note: registrations as one C loop]
            self._real = set(self._indices)
            self.unsharded = True
            return
        real = {c.index for c in self.chunks if c.is_gathered or not stand_ins}  # asked once per chunk, not per name
        stand_in = self._stand_ins
        # one pass over the registrations (every slot has one, and a segment per slot once its chunk has sharded
        # parameters; a tied parameter's requires_grad is synced twice, the same): this runs before every forward
        for m, name, chunk, i in self.registrations:
            unsharded, segments = chunk.slots[i].param, chunk.segments
            if segments and unsharded.requires_grad != segments[i].param.requires_grad:
                unsharded.requires_grad_(segments[i].param.requires_grad)
                self._watch(unsharded)
            m._parameters[name] = unsharded if chunk.index in real else stand_in[(chunk.index, i)]
        self._real = real
        self.unsharded = True

    def _every_unsharded(self) -> bool:
        """Register every unsharded parameter (every chunk real), where each has its sharded parameter's
        ``requires_grad`` already (the usual: nothing was frozen or unfrozen since the last forward); False, with
        nothing done, otherwise.

        [Note: registrations as one C loop]
        ``use_unsharded`` and ``use_sharded`` run at every forward, once per registration (195 on the bench's
        48-block model, about 1.5 us each in a Python loop). Where every chunk's real parameters are registered
        (stages 1 and 2, a gathered stage 3) each is a plain ``dict`` write of the same objects, so both run as
        ``map`` calls over the registrations' columns (taken once per chunk segments, see ``_columns``): no Python
        bytecode per registration."""
        columns = self._columns()
        if columns is None:
            return False
        modules, names, unsharded, sharded = columns
        if list(map(_REQUIRES_GRAD, unsharded)) != list(map(_REQUIRES_GRAD, sharded)):
            return False
        deque(map(operator.setitem, map(_PARAMETERS, modules), names, unsharded), maxlen=0)
        return True

    def _columns(self) -> tuple[tuple[nn.Module, ...], tuple[str, ...], tuple[torch.Tensor, ...],
                                tuple[torch.Tensor, ...]] | None:
        """Each registration's module, name, unsharded and sharded parameter, as four tuples, read again only when a
        chunk's segments (made once per chunk) changed; None before every chunk has sharded parameters."""
        segments = [c.segments for c in self.chunks]
        kept = self._kept_columns
        if kept is not None and all(map(operator.is_, segments, kept[0])):
            return kept[1]
        if not all(segments):
            return None
        regs = self.registrations
        columns = (tuple(m for m, _, _, _ in regs), tuple(name for _, name, _, _ in regs),
                   tuple(chunk.slots[i].param for _, _, chunk, i in regs),
                   tuple(chunk.segments[i].param for _, _, chunk, i in regs))
        self._kept_columns = (segments, columns)
        return columns

    def use_sharded(self) -> None:
        """Register the sharded parameters in the modules: what the user and the optimizer see between steps."""
        if not self.unsharded:
            return
        columns = self._columns()
        if columns is not None:  # see [Note: registrations as one C loop]
            deque(map(operator.setitem, map(_PARAMETERS, columns[0]), columns[1], columns[3]), maxlen=0)
        else:
            for m, name, chunk, i in self.registrations:
                m._parameters[name] = chunk.segments[i].param
        self.unsharded = False

    def show(self, chunks: Sequence[Chunk]) -> None:
        """Inside forward and backward: register each chunk's real parameters if it is gathered, else stand-ins."""
        if not self.unsharded:
            return
        for chunk in chunks:
            gathered = chunk.is_gathered
            for m, name, i in self._by_chunk.get(chunk.index, ()):
                m._parameters[name] = chunk.slots[i].param if gathered else self._stand_ins[(chunk.index, i)]
            (self._real.add if gathered else self._real.discard)(chunk.index)

    def holds(self, chunks: Sequence[Chunk]) -> bool:
        """Whether every chunk is gathered (none in flight) and the modules hold its real parameters already (or
        the sharded ones, outside forward), so a unit's hook has nothing to gather or register."""
        gathered, real, unsharded = ChunkState.GATHERED, self._real, self.unsharded
        for chunk in chunks:  # a loop, not all(): this runs in every unit's hooks
            if chunk.state is not gathered or (unsharded and chunk.index not in real):
                return False
        return True

    def returned(self, tensors: Sequence[torch.Tensor]) -> set[int]:
        """Indices of the chunks whose unsharded parameters are among ``tensors`` (a module returned one)."""
        return {self.chunk_of[id(t)].index for t in tensors if id(t) in self.chunk_of}
