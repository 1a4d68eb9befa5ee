"""Whole-tensor optimizer steps: each sharded parameter is stepped whole, on one owner rank.

[Note: whole-tensor optimizer steps]
An element-wise optimizer (Adam, SGD) steps each rank's piece of a parameter and gets what one
process gets. An optimizer whose update of a parameter reads the whole tensor does not: Muon
orthogonalises each matrix's update (Newton-Schulz over ``G @ G.T``), Adafactor factors the
second moment into row and column statistics, LAMB scales by whole-tensor norms. On pieces
they train another model, silently. So with such an optimizer (``ZeroConfig.optimizer_updates``
``"whole"``, which ``"auto"`` picks for the ones zero knows) every sharded parameter has one
*owner* rank, fixed at ``shard()`` (the largest parameters first, each to the rank with the
fewest elements so far: balanced to within one parameter), and a step is:

1. one tagged agreement on which parameters have gradients (a rank that disagrees raises
   :class:`~zero_core.RanksOutOfStepError` on every rank instead of exchanging mismatched sizes);
2. two all-to-alls: every rank sends each owner its pieces of the owner's parameters, the
   master values and the reduced gradients (each rank sends its share of the shard once);
3. the user's ``optimizer.step()`` body runs on whole plain tensors: the engine swaps, for this
   call only, each owned parameter in its param group for a whole stand-in carrying the full
   gradient, moves the parameter's optimizer state onto the stand-in, and drops the parameters
   other ranks own from the groups. The update is the optimizer's own, on the tensors one
   process would give it;
4. one all-to-all back: the owner sends each rank its piece of the new values, which land in the
   master shard (kept full buffers at stages 1/2 are refreshed after the step, as always).

A parameter's optimizer state lives whole on its owner only (Muon's momentum, Adafactor's row and
column statistics): balanced, like sharded states, but by parameters rather than by elements.
Traffic per step, counted as :attr:`~zero_core.plugin.CollectiveKind.ALL_TO_ALL`: three all-to-alls of
this rank's padded pieces of the stepped parameters (values, gradients, values back), in the
widest dtype among them, which is lossless for every floating dtype narrower than it. Zero-size
(replicated) parameters are whole on every rank and are stepped in place, as before.

Placement policies that keep shards off the device or step chunks early, and meshes with
replicas or module meshes, are refused at ``shard()`` with this mode (see ``check_whole_step``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zero_core.base.errors import RanksOutOfStepError, ZeroError
from zero_core.chunks._collectives import exchange_pieces
from zero_core.chunks._slots import ParamSlot, to_local
from zero_core.chunks.chunk import Chunk
from zero_core.comm._agreement import any_rank
from zero_core.comm.backend import CommBackend

__all__ = ["WholeTensorSteps", "assign_owners", "guard_unregistered_optimizers"]

# [Note: a whole-tensor optimizer zero was not given]
# zero steps a whole-tensor optimizer whole only when it was passed to shard(): only those optimizers' steps are
# hooked. Another one over the sharded parameters (built after shard(), FSDP2's recipe, or a second optimizer)
# would step each rank's pieces and train another model, silently. And any optimizer built before shard() but not
# passed to it (the Muon recipe's AdamW over the embeddings, norms and biases) holds the parameter objects shard()
# replaced: empty at stage 3, never given a gradient, so they never move, silently, whatever the optimizer's kind.
# A process-wide step pre-hook, registered once by the first shard(), refuses both at the call, naming the fix. Its
# verdict per optimizer is cached with what it was reached on (the param groups' lists and lengths, and how many
# shard() calls there have been), so a step costs a membership test and that key; the parameters are scanned
# only when the groups change.
# every engine's sharded parameters, by id, each to the chunk that holds it (a tensor's == is elementwise, so no
# weak set can hold them; and a weak reference to a parameter would make torch.utils.swap_tensors refuse it, which
# moving a DTensor parameter's shard to another device does)
_SHARDED: dict[int, weakref.ref[Chunk]] = {}
# the parameters shard() replaced (each chunk's slot parameters, which the modules hold only inside a forward), by
# id, each to its chunk and slot: held the same way, without a reference to the parameter
_REPLACED: dict[int, tuple[weakref.ref[Chunk], int]] = {}
_REGISTERED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # the optimizers passed to shard()
# each other optimizer that stepped: (what its verdict was reached on, the error it raises or None)
_VERDICTS: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[Any, str | None]] = weakref.WeakKeyDictionary()
_shards = 0  # shard() calls so far: a verdict reached before the last one is reached again
_guard: Any = None


@dataclass(frozen=True, slots=True)
class _Entry:
    """One sharded parameter the optimizer steps whole."""

    name: str
    param: nn.Parameter  # the sharded parameter: the optimizer's key and the model's entry
    slot: ParamSlot
    owner: int


def guard_unregistered_optimizers(optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
                                  chunks: Sequence[Chunk],
                                  is_whole: Callable[[torch.optim.Optimizer], str | None]) -> None:
    """Remember ``optimizers`` (the ones shard() hooks), the sharded parameters of ``chunks`` (their engine's) and the
    parameters they replaced, and install the process-wide guard of [Note: a whole-tensor optimizer zero was not
    given] once. ``is_whole`` names what a whole-tensor optimizer reads (``None`` for any other)."""
    global _guard, _shards
    for optimizer in (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else optimizers:
        _REGISTERED.add(optimizer)
    for dead in [key for key, ref in _SHARDED.items() if ref() is None]:
        del _SHARDED[dead]
    for dead in [key for key, (ref, _) in _REPLACED.items() if ref() is None]:
        del _REPLACED[dead]
    _SHARDED.update({id(seg.param): weakref.ref(chunk) for chunk in chunks for seg in chunk.segments})
    _REPLACED.update({id(slot.param): (weakref.ref(chunk), i) for chunk in chunks for i, slot in enumerate(chunk.slots)})
    _shards += 1
    if _guard is not None:
        return

    def refuse(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if opt in _REGISTERED:
            return
        key = (_shards, tuple((id(group["params"]), len(group["params"])) for group in opt.param_groups))
        cached = _VERDICTS.get(opt)
        if cached is None or cached[0] != key:
            cached = (key, _verdict(opt, is_whole))
            _VERDICTS[opt] = cached
        if cached[1] is not None:
            raise ZeroError(cached[1])

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _guard = register_optimizer_step_pre_hook(refuse)


def _verdict(opt: torch.optim.Optimizer, is_whole: Callable[[torch.optim.Optimizer], str | None]) -> str | None:
    """Why ``opt`` (not passed to shard()) must not step, or ``None``."""
    params = [p for group in opt.param_groups for p in group["params"]]
    replaced = next((name for p in params if (name := _replaced_name(p)) is not None), None)
    if replaced is not None:
        return (
            f"{type(opt).__name__} holds parameter {replaced!r} (and maybe more) as it was before zero_core.shard "
            "replaced it: that object is empty or stale and never gets a gradient, so this optimizer would train "
            "nothing. Build every optimizer the loop steps before shard() and pass it to shard() together: "
            "shard(model, (opt_a, opt_b)) (it returns them re-pointed, in the same tuple)")
    reads = is_whole(opt)
    if reads is not None and any(_is_sharded(p) for p in params):
        return (
            f"{type(opt).__name__} {reads}, and it steps parameters sharded by zero without having been passed to "
            "zero_core.shard: each rank would step its pieces and train another model. Build the optimizer before "
            "shard() and pass it there (zero then steps each parameter whole on one rank; several optimizers go "
            "together: shard(model, (opt_a, opt_b))), and step that one")
    return None


def _replaced_name(param: torch.Tensor) -> str | None:
    """The name of the parameter ``param`` was before shard() replaced it, if it was one."""
    found = _REPLACED.get(id(param))
    chunk = found[0]() if found is not None else None
    if chunk is None or chunk.slots[found[1]].param is not param:  # type: ignore[index]
        return None
    return chunk.slots[found[1]].name  # type: ignore[index]


def _is_sharded(param: torch.Tensor) -> bool:
    ref = _SHARDED.get(id(param))
    chunk = ref() if ref is not None else None
    return chunk is not None and any(seg.param is param for seg in chunk.segments)


def assign_owners(numels: Sequence[int], world_size: int) -> list[int]:
    """The owner rank of each parameter: largest first, each to the least-loaded rank (lowest on ties).

    Deterministic from the sizes alone, so every rank computes the same owners."""
    load = [0] * world_size
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += numels[i]
    return owners


class WholeTensorSteps:
    """What the engine does around ``optimizer.step()`` for a whole-tensor optimizer. See the module's Note."""

    def __init__(self, optimizer: torch.optim.Optimizer, chunks: Sequence[Chunk], *, comm: CommBackend,
                 device: torch.device) -> None:
        self.optimizer = optimizer
        self._comm = comm
        self._device = device
        self.rank, self.world_size = comm.rank, comm.world_size
        found = [(slot, seg.param) for chunk in chunks for seg in chunk.segments
                 if not (slot := chunk.slots[seg.slot]).replicated]
        owners = assign_owners([slot.numel for slot, _ in found], self.world_size)
        self.entries = tuple(_Entry(slot.name, param, slot, owner) for (slot, param), owner in zip(found, owners))
        self._by_param = {id(e.param): e for e in self.entries}
        # Between begin() and end()/abort(): the groups' own lists, and each stand-in with its parameter.
        self._saved_groups: list[list[torch.Tensor]] | None = None
        self._stand_ins: list[tuple[_Entry, torch.Tensor]] = []
        self._live: list[_Entry] = []
        self._dtype = torch.float32

    def owner_of(self, param: torch.Tensor) -> int | None:
        """The rank that steps ``param`` and holds its optimizer state (``None``: every rank, in place)."""
        entry = self._by_param.get(id(param))
        return None if entry is None else entry.owner

    def owns(self, param: torch.Tensor) -> bool:
        owner = self.owner_of(param)
        return owner is None or owner == self.rank

    @property
    def active(self) -> bool:
        return self._saved_groups is not None

    # -- the step -------------------------------------------------------------------------
    def begin(self) -> None:
        """Before the step's body: bring each owned parameter and its gradient whole, and swap them in."""
        assert self._saved_groups is None, "a whole-tensor step is already open"
        live = self._agree_live()
        self._live = live
        if not live:  # nothing to step whole (an fp16 overflow dropped every gradient): agreed on every rank
            self._saved_groups = [group["params"] for group in self.optimizer.param_groups]
            return
        splits = self._splits(live)
        dtype = self._dtype = self._wire_dtype(live)
        values = self._to_owners(live, splits, dtype, lambda e: to_local(e.param))
        grads = self._to_owners(live, splits, dtype, lambda e: to_local(e.param.grad))
        state = self.optimizer.state
        stand_ins: dict[int, torch.Tensor] = {}
        at = 0
        width = splits[self.rank]
        for entry in live:
            if entry.owner != self.rank:
                continue
            slot = entry.slot
            whole = torch.empty(slot.shape, dtype=entry.param.dtype, device=self._device)
            whole.copy_(slot.whole(values.view(self.world_size, width)[:, at:at + slot.piece]))
            assert entry.param.grad is not None  # _agree_live keeps only the parameters with a gradient
            grad = torch.empty(slot.shape, dtype=entry.param.grad.dtype, device=self._device)
            grad.copy_(slot.whole(grads.view(self.world_size, width)[:, at:at + slot.piece]))
            whole.grad = grad
            at += slot.piece
            if entry.param in state:
                state[whole] = state.pop(entry.param)
            stand_ins[id(entry.param)] = whole
            self._stand_ins.append((entry, whole))
        live_ids = {id(e.param) for e in live}
        self._saved_groups = [group["params"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            # a live parameter another rank owns leaves the group for this call; the rest stay (no gradient:
            # skipped by the optimizer as in one process; replicated: stepped in place on every rank)
            group["params"] = [stand_ins.get(id(p), p) for p in group["params"]
                               if id(p) not in live_ids or id(p) in stand_ins]

    def end(self) -> None:
        """After the step's body: the groups and states come back, and each rank's piece of the new values."""
        if self._saved_groups is None:
            return
        stand_ins = self._stand_ins
        self._restore()
        live, self._live = self._live, []
        if not live:
            return
        splits = self._splits(live)
        width = splits[self.rank]
        dtype = self._dtype
        send = torch.zeros(self.world_size, width, dtype=dtype, device=self._device)
        at = 0
        with torch.no_grad():
            for entry, whole in stand_ins:
                slot = entry.slot
                send[:, at:at + slot.piece] = slot.pieces_of(whole.detach().to(dtype), self.world_size)
                at += slot.piece
            received = torch.empty(sum(splits), dtype=dtype, device=self._device)
            exchange_pieces(received, send.view(-1), self._comm, output_splits=splits,
                            input_splits=[width] * self.world_size)
            at = 0
            for entry in self._by_owner(live):
                local = to_local(entry.param)
                local.view(-1).copy_(received[at:at + local.numel()])
                at += entry.slot.piece

    def abort(self) -> None:
        """The step's body raised: the groups and states come back; the parameters keep their values."""
        if self._saved_groups is not None:
            self._restore()
        self._live = []

    # -- helpers ----------------------------------------------------------------------------
    def _restore(self) -> None:
        state = self.optimizer.state
        for entry, whole in self._stand_ins:
            if whole in state:
                state[entry.param] = state.pop(whole)
        for group, params in zip(self.optimizer.param_groups, self._saved_groups or []):
            group["params"] = params
        self._saved_groups = None
        self._stand_ins = []

    def _agree_live(self) -> list[_Entry]:
        """The parameters with a gradient, agreed by every rank (see the Note, step 1)."""
        has = [e.param.grad is not None for e in self.entries]
        if self.world_size > 1 and self.entries:
            flags = torch.tensor(has + [not h for h in has], dtype=torch.uint8)
            agreed = any_rank(self._comm, flags).to(torch.bool)
            n = len(has)
            split = [e.name for i, e in enumerate(self.entries) if agreed[i] and agreed[n + i]]
            if split:
                raise RanksOutOfStepError(
                    f"optimizer.step(): parameter(s) {', '.join(split[:3])} have a gradient on some ranks and none on "
                    "others, so the ranks would step different parameters. Set or clear .grad the same way on "
                    "every rank (the reduced gradients always agree)")
        return [e for e, h in zip(self.entries, has) if h]

    def _by_owner(self, live: Sequence[_Entry]) -> list[_Entry]:
        return sorted(live, key=lambda e: e.owner)  # stable: each owner's parameters in plan order

    def _splits(self, live: Sequence[_Entry]) -> list[int]:
        splits = [0] * self.world_size
        for entry in live:
            splits[entry.owner] += entry.slot.piece
        return splits

    def _wire_dtype(self, live: Sequence[_Entry]) -> torch.dtype:
        dtype = torch.float32
        for entry in live:
            dtype = torch.promote_types(dtype, entry.param.dtype)
            if entry.param.grad is not None:
                dtype = torch.promote_types(dtype, entry.param.grad.dtype)
        return dtype

    def _to_owners(self, live: Sequence[_Entry], splits: list[int], dtype: torch.dtype,
                   local_of: object) -> torch.Tensor:
        """Each owner receives every rank's padded piece of its parameters: ``(world_size, splits[rank])``."""
        send = torch.zeros(sum(splits), dtype=dtype, device=self._device)
        at = 0
        for entry in self._by_owner(live):
            local = local_of(entry)  # type: ignore[operator]
            send[at:at + local.numel()] = local.reshape(-1)
            at += entry.slot.piece
        received = torch.empty(self.world_size * splits[self.rank], dtype=dtype, device=self._device)
        exchange_pieces(received, send, self._comm, output_splits=[splits[self.rank]] * self.world_size,
                        input_splits=splits)
        return received
