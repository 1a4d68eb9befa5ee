"""Tiers: where each part of each chunk lives, with byte-exact budgets, and the one call that moves a part.

[Note: chunk parts]
A chunk's model states come in three parts, each in its own tier at every moment:

- ``PARAMS``: the master shard (what gathers read and the optimizer updates);
- ``GRADS``: the reduced gradient shard (where the reduce-scatter's result is moved);
- ``OPTIM``: the optimizer states of the chunk's segments.

:meth:`Tiers.move` moves one part of one chunk to another tier, copying exactly its
bytes and charging its budget before anything changes, so a move that does not fit
fails with the state untouched. A part that leaves a tier drops its storage there: a
shard on the disk tier is the chunk's :func:`~zero_core.plugin.absent_shard` (one NaN
element, expanded) and optimizer states on disk are such stand-ins too, so any access
that a policy did not prepare fails or shows NaN instead of reading stale values.

A master shard that ``shard()`` made in host memory (the policy's ``initial_tier`` said HOST:
see [Note: shards made where they live] in ``zero_core.chunks.chunk``) is registered in the
host tier but charged nowhere until the policy's first placement of it: that move charges
the tier it goes to, with the budget's check, and copies nothing when it stays in the host
tier (to disk it is written from there). Until then it is *unplaced*, so the policy fills
the host in its own order, as if every shard started on the device.

On CUDA the host tier keeps a persistent pinned copy of each master shard that has been
on the host (ColossalAI's even-shard refactor): moving a shard up copies it and keeps the
copy; moving it down again copies only if the optimizer changed it on the device since
(the copy is *stale*); otherwise the device storage is just dropped.
"""

from __future__ import annotations

import enum
import inspect
import os
import shutil
from collections.abc import Sequence
from typing import Any

import torch

from zero_core.plugin import Chunk, MemoryTier, PlacementContext, absent_shard, copy_shard, get_logger, rewrap, to_local
from zero_offload._disk import DiskStore
from zero_offload.config import TierConfig, mib
from zero_offload.errors import DiskTierError, TierBudgetError

__all__ = ["Part", "Tiers"]

log = get_logger("offload")

DEVICE, HOST, DISK = MemoryTier.DEVICE, MemoryTier.HOST, MemoryTier.DISK


class Part(enum.Enum):
    """The parts of a chunk's model states that move independently. See [Note: chunk parts]."""

    #: The master parameter shard.
    PARAMS = "params"
    #: The reduced gradient shard.
    GRADS = "grads"
    #: The optimizer states of the chunk's segments.
    OPTIM = "optim"


def _mb(n: int | None) -> str:
    return "unlimited" if n is None else f"{n} bytes ({n / 2**20:.2f} MiB)"


def optimizer_bytes_per_element(optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> list[float]:
    """Bytes of (non-scalar) optimizer state per parameter element, per param group, measured on a probe.

    Runs one step of a fresh optimizer of the same class and hyperparameters on an
    8-element parameter. Optimizers whose states do not scale with the parameter, or
    that cannot be probed, are assumed to keep two states per element, like Adam.
    """
    result = []
    accepted = set(inspect.signature(type(optimizer).__init__).parameters)
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k in accepted and k != "params"}
        try:
            probe = torch.nn.Parameter(torch.zeros(8, dtype=dtype))
            opt = type(optimizer)([probe], **hyper)
            probe.grad = torch.ones_like(probe)
            opt.step()
            nbytes = sum(v.numel() * v.element_size() for v in opt.state[probe].values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
            result.append(nbytes / 8)
        except Exception as e:  # an optimizer that needs a closure or other arguments
            log.info("zero-offload: could not probe %s's state size (%s); assuming two states per element",
                     type(optimizer).__name__, e)
            result.append(2.0 * torch.empty(0, dtype=dtype).element_size())
    return result


class Tiers:
    """Budgets, accounting and moves of every chunk's parts. See [Note: chunk parts]."""

    def __init__(self, config: TierConfig, context: PlacementContext) -> None:
        self.device = context.device
        self.host = torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.optimizer = context.optimizer
        # The host default is a share of RAM per rank: every rank on the machine draws from the same memory.
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.budget: dict[MemoryTier, int | None] = {
            DEVICE: self._device_budget(config),
            HOST: mib(config.host_budget_mb) if config.host_budget_mb is not None else int(config.host_budget_fraction * ram / local_ranks),
            DISK: None,
        }
        device_budget = self.budget[DEVICE]
        if device_budget is not None and context.comm.world_size > 1:
            # decisions taken from the budget (prefetch, the minimum check) decide which collectives run: the
            # smallest rank's budget is every rank's
            self.budget[DEVICE] = context.comm.agree_min(device_budget)
        self.disk: DiskStore | None = None
        if config.disk_dir is not None:
            self.disk = DiskStore(config.disk_dir, rank=context.comm.rank)
            free = shutil.disk_usage(self.disk.directory).free
            self.budget[DISK] = mib(config.disk_budget_mb) if config.disk_budget_mb is not None else free
        # Bytes placed in each tier (reserved for gradients before they exist), and the most ever placed.
        self.used: dict[MemoryTier, int] = {t: 0 for t in MemoryTier}
        self.peak: dict[MemoryTier, int] = {t: 0 for t in MemoryTier}
        self.where: dict[int, dict[Part, MemoryTier]] = {}
        self.size: dict[tuple[int, Part], int] = {}
        # CUDA only: persistent pinned host copies of master shards, and those the device copy has outdated.
        self.host_copy: dict[int, torch.Tensor] = {}
        self.host_stale: set[int] = set()
        # Chunks whose parameter file on disk matches the shard in memory (no write needed to evict).
        self.disk_fresh: set[int] = set()
        # Chunks whose parameters live on disk but are in host memory for a while (read for a gather).
        self.staged: set[int] = set()
        # Chunks whose master shard shard() made in host memory and the policy has not placed yet (charged nowhere).
        self.unplaced: set[int] = set()
        self._made_to_disk = False
        self.moves = {part: 0 for part in Part}
        self.bytes_moved = {part: 0 for part in Part}
        self._bpe: list[float] = []

    def _device_budget(self, config: TierConfig) -> int | None:
        if config.device_budget_mb is not None:
            return mib(config.device_budget_mb)
        if self.cuda:
            # free memory plus what this process's allocator already holds (its chunks among it), minus the margin
            free, total = torch.cuda.mem_get_info(self.device)
            return max(0, int(free + torch.cuda.memory_reserved(self.device) - config.device_margin * total))
        return None

    # -- registration ----------------------------------------------------------------
    def register(self, chunks: Sequence[Chunk]) -> None:
        """Record every chunk's parts where packing left them: on the device, or a master shard made in host memory
        (``chunk.tier`` HOST), unplaced. See [Note: chunk parts]."""
        dtypes = {c.master_dtype for c in chunks}
        bpe = {d: optimizer_bytes_per_element(self.optimizer, d) for d in dtypes if d.is_floating_point}
        for chunk in chunks:
            i = chunk.index
            self.where[i] = {part: DEVICE for part in Part}
            self.size[(i, Part.PARAMS)] = chunk.shard_bytes
            self.size[(i, Part.GRADS)] = chunk.shard_bytes if chunk.requires_grad else 0
            elements = sum(seg.numel for seg in chunk.segments if seg.param.requires_grad)
            per = bpe[chunk.master_dtype][chunk.param_group] if chunk.master_dtype in bpe and chunk.param_group is not None else 0.0
            self.size[(i, Part.OPTIM)] = int(per * elements)
            if chunk.tier is HOST:
                self.where[i][Part.PARAMS] = HOST
                self.unplaced.add(i)
            for part in Part:
                if self.where[i][part] is DEVICE:
                    self._charge(DEVICE, self.size[(i, part)], check=False)
            chunk.tier = self.where[i][Part.PARAMS]

    def settle_unplaced(self, chunks: Sequence[Chunk]) -> None:
        """After the policy's first placement: charge the host tier for the shards made there that it left there
        without a move; on CUDA, give back the pinned memory of those it wrote to disk (torch's pinned allocator
        keeps freed blocks for reuse, which the disk tier's few read buffers would not use up)."""
        for chunk in chunks:
            if chunk.index in self.unplaced:
                self.move(chunk, Part.PARAMS, HOST)
        if self._made_to_disk and self.cuda:
            empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
            if empty is not None:
                empty()
        self._made_to_disk = False

    def nbytes(self, chunk: Chunk, part: Part | None = None) -> int:
        if part is None:
            return sum(self.size[(chunk.index, p)] for p in Part)
        return self.size[(chunk.index, part)]

    def tier(self, chunk: Chunk, part: Part) -> MemoryTier:
        return self.where[chunk.index][part]

    def location(self, tier: MemoryTier) -> torch.device:
        if tier is DISK:
            raise DiskTierError("the disk tier has no torch device; ask for the host or device tier")
        return self.device if tier is DEVICE else self.host

    # -- accounting -------------------------------------------------------------------
    def room(self, tier: MemoryTier) -> int | None:
        budget = self.budget[tier]
        return None if budget is None else budget - self.used[tier]

    def fits(self, tier: MemoryTier, nbytes: int) -> bool:
        room = self.room(tier)
        return room is None or nbytes <= room

    def _charge(self, tier: MemoryTier, nbytes: int, *, check: bool = True, what: str = "") -> None:
        if check and tier is not DEVICE and not self.fits(tier, nbytes):
            host_hint = ("raise TierConfig.host_budget_mb (past it, the policy already spills to disk)" if self.disk is not None
                         else "raise TierConfig.host_budget_mb, or set disk_dir so the excess goes to disk")
            hint = {HOST: host_hint, DISK: "raise TierConfig.disk_budget_mb or free space in disk_dir"}[tier]
            raise TierBudgetError(
                f"the {tier.value} tier cannot hold {what} ({nbytes} bytes): {self.used[tier]} bytes of its "
                f"{_mb(self.budget[tier])} budget are in use. {hint[0].upper()}{hint[1:]}."
            )
        self.used[tier] += nbytes
        self.peak[tier] = max(self.peak[tier], self.used[tier])

    def _discharge(self, tier: MemoryTier, nbytes: int) -> None:
        self.used[tier] -= nbytes

    def resize(self, chunk: Chunk, part: Part, nbytes: int) -> None:
        """Correct a part's size once it is known (optimizer states exist only after the first step)."""
        key = (chunk.index, part)
        tier = self.where[chunk.index][part]
        self._discharge(tier, self.size[key])
        self.size[key] = nbytes
        self._charge(tier, nbytes, check=False)

    def relabel(self, chunk: Chunk, part: Part, tier: MemoryTier) -> None:
        """Record that ``part`` already is in ``tier`` (something else put it there), moving its accounting."""
        src = self.where[chunk.index][part]
        nbytes = self.size[(chunk.index, part)]
        self._discharge(src, nbytes)
        self._charge(tier, nbytes, check=False)
        self.where[chunk.index][part] = tier

    # -- moves ------------------------------------------------------------------------
    def move(self, chunk: Chunk, part: Part, tier: MemoryTier) -> None:
        """Move ``part`` of ``chunk`` to ``tier``, bytes exact; a move that does not fit changes nothing."""
        src = self.where[chunk.index][part]
        unplaced = part is Part.PARAMS and chunk.index in self.unplaced
        if src is tier and not unplaced:
            return
        if part is Part.GRADS and tier is DISK:
            raise TierBudgetError("gradients stay in memory (clipping and the overflow check read them); "
                                  "place Part.GRADS on the device or host tier")
        if tier is DISK and self.disk is None:
            raise TierBudgetError(
                f"chunk {chunk.index}'s {part.value} must go to the disk tier, which is not configured; "
                "set TierConfig(disk_dir=...) or raise the host budget"
            )
        nbytes = self.size[(chunk.index, part)]
        # a shard going down to its kept pinned copy needs no new host memory (the copy is charged already)
        kept = part is Part.PARAMS and tier is HOST and chunk.index in self.host_copy
        self._charge(tier, nbytes, check=not kept, what=f"chunk {chunk.index}'s {part.value}")
        if unplaced and tier is src:  # made in host memory and placed there: charged now, nothing to copy
            self.unplaced.discard(chunk.index)
            chunk.tier = tier
            return
        try:
            {Part.PARAMS: self._move_params, Part.GRADS: self._move_grads, Part.OPTIM: self._move_optim}[part](chunk, src, tier)
        except BaseException:
            self._discharge(tier, nbytes)
            raise
        if unplaced:  # it was charged nowhere
            self.unplaced.discard(chunk.index)
            self._made_to_disk |= tier is DISK
        else:
            self._discharge(src, nbytes)
        if src is DISK and self.disk is not None:  # the file is out of date from now on: free its space
            self.disk.delete(f"{'params' if part is Part.PARAMS else 'optim'}-{chunk.index}")
            if part is Part.PARAMS:
                self.disk_fresh.discard(chunk.index)
        self.where[chunk.index][part] = tier
        self.moves[part] += 1
        self.bytes_moved[part] += nbytes
        if part is Part.PARAMS:
            chunk.tier = tier

    def _host_buffer(self, chunk: Chunk) -> torch.Tensor:
        return torch.empty(chunk.shard_size, dtype=chunk.master_dtype, device=self.host, pin_memory=self.cuda)

    @torch.no_grad()
    def _move_params(self, chunk: Chunk, src: MemoryTier, dst: MemoryTier) -> None:
        i = chunk.index
        if dst is DISK:
            if i not in self.disk_fresh:
                assert self.disk is not None
                self.disk.write(f"params-{i}", [chunk.shard])
                self.disk_fresh.add(i)
            self._drop_host_copy(i)
            self.staged.discard(i)
            chunk.replace_shard(absent_shard(chunk))
            return
        host: torch.Tensor | None
        if src is DISK and i not in self.staged:
            assert self.disk is not None
            host = self._host_buffer(chunk)
            self.disk.read(f"params-{i}", [host])
        else:
            host = chunk.shard if src is HOST or src is DISK else None
        if i in self.staged:  # the staged copy becomes the shard: its staging charge ends here
            self.staged.discard(i)
            self._discharge(HOST, chunk.shard_bytes)
        if dst is HOST:
            if host is None:  # from the device
                if self.cuda:
                    copy = self.host_copy.pop(i, None)
                    if copy is not None:
                        self._discharge(HOST, chunk.shard_bytes)  # the kept copy's bytes now count as the shard's
                    if copy is None:
                        copy = self._host_buffer(chunk)
                        copy_shard(chunk, copy, chunk.shard)
                    elif i in self.host_stale:  # written back only when the device copy changed
                        copy_shard(chunk, copy, chunk.shard)
                    self.host_stale.discard(i)
                    host = copy
                else:
                    host = chunk.shard.clone()
            chunk.replace_shard(host)
            return
        # to the device
        shard = torch.empty(chunk.shard_size, dtype=chunk.master_dtype, device=self.device)
        if self.cuda:  # on the copy stream, from pinned memory
            copy_shard(chunk, shard, host if host is not None else chunk.shard)
        else:
            shard.copy_(host if host is not None else chunk.shard, non_blocking=True)
        if self.cuda and host is not None:
            self.host_copy[i] = host  # kept, pinned: moving back down is free until the optimizer changes the shard
            self.host_stale.discard(i)
            self._charge(HOST, chunk.shard_bytes, check=False)
        chunk.replace_shard(shard)

    def drop_host_copy(self, index: int) -> None:
        """Free the kept pinned host copy of a shard that will live on the device (CUDA only)."""
        self._drop_host_copy(index)

    def _drop_host_copy(self, index: int) -> None:
        if self.host_copy.pop(index, None) is not None:
            self._discharge(HOST, self.size[(index, Part.PARAMS)])
        self.host_stale.discard(index)

    def _move_grads(self, chunk: Chunk, src: MemoryTier, dst: MemoryTier) -> None:
        device = self.location(dst)
        chunk.grads.move_reduced(device)
        for seg in chunk.segments:
            if seg.param.grad is not None and seg.param.grad.device != device:
                seg.param.grad = seg.param.grad.to(device)

    def states(self, chunk: Chunk) -> list[tuple[torch.nn.Parameter, dict[str, Any], str, torch.Tensor]]:
        """``(segment parameter, its state dict, key, local value)`` for each per-element optimizer state of the chunk.

        Step counts are left out: they stay in memory in every tier (a zero-dimensional
        parameter's moments are per-element states all the same).
        The value is this rank's local tensor (a DTensor state's); write a moved one back
        with ``zero_core.plugin.rewrap``, so the state stays a DTensor like its parameter.
        """
        return [(seg.param, state, key, to_local(value)) for seg in chunk.segments
                for state in (self.optimizer.state.get(seg.param),) if state
                for key, value in state.items()
                if isinstance(value, torch.Tensor) and value.shape == seg.param.shape and key != "step"]

    def read_optim(self, chunk: Chunk) -> list[tuple[Any, str, torch.Tensor]]:
        """Disk-resident optimizer states read into fresh host tensors, leaving the tier as it is.

        Returns ``(segment parameter, state key, value)`` for each state the file holds.
        """
        assert self.disk is not None and self.where[chunk.index][Part.OPTIM] is DISK
        found = self.states(chunk)
        fresh = [torch.empty(v.shape, dtype=v.dtype) for *_, v in found]
        if found:
            self.disk.read(f"optim-{chunk.index}", fresh)
        return [(param, key, value) for (param, _, key, _), value in zip(found, fresh)]

    def optim_bytes(self, chunk: Chunk) -> int:
        """The optimizer states' actual bytes (0 before the first step)."""
        return sum(v.numel() * v.element_size() for *_, v in self.states(chunk))

    @torch.no_grad()
    def _move_optim(self, chunk: Chunk, src: MemoryTier, dst: MemoryTier) -> None:
        states = [(state, key, value) for _, state, key, value in self.states(chunk)]
        if not states:
            return  # created by the first step, where the parameters are; the policy settles them then
        name = f"optim-{chunk.index}"
        if dst is DISK:
            assert self.disk is not None
            self.disk.write(name, [v for _, _, v in states])
            for state, key, value in states:
                fill = float("nan") if value.is_floating_point() else 0
                state[key] = rewrap(state[key], torch.full((1,), fill, dtype=value.dtype).expand(value.shape))
            return
        device = self.location(dst)
        if src is DISK:
            assert self.disk is not None
            loaded = [torch.empty(v.shape, dtype=v.dtype, device=self.host, pin_memory=self.cuda and dst is DEVICE)
                      for _, _, v in states]
            self.disk.read(name, loaded)
            for (state, key, _), value in zip(states, loaded):
                state[key] = rewrap(state[key], value.to(device, non_blocking=True))
        else:
            for state, key, value in states:
                # asynchronous only upwards: a host tensor from an asynchronous download is not ready when returned
                state[key] = rewrap(state[key], value.to(device, non_blocking=device.type == "cuda"))
        group = self.optimizer.param_groups[chunk.param_group] if chunk.param_group is not None else {}
        if group.get("fused") or group.get("capturable"):
            # fused and capturable kernels keep step counts on the parameter's device; the others on the CPU
            for seg in chunk.segments:
                for key, value in (self.optimizer.state.get(seg.param) or {}).items():
                    if isinstance(value, torch.Tensor) and key == "step" and value.device != device:
                        self.optimizer.state[seg.param][key] = value.to(device)

    # -- disk-resident shards read for a while ----------------------------------------------
    def stage_in(self, chunk: Chunk) -> None:
        """Read a disk-resident shard into host memory (for a gather or a checkpoint); it stays on the disk tier."""
        i = chunk.index
        if self.where[i][Part.PARAMS] is not DISK or i in self.staged:
            return
        assert self.disk is not None
        self._charge(HOST, chunk.shard_bytes, what=f"chunk {i}'s parameters read from disk")
        host = self._host_buffer(chunk)
        try:
            self.disk.read(f"params-{i}", [host])
        except DiskTierError:
            self._discharge(HOST, chunk.shard_bytes)
            raise
        chunk.replace_shard(host)
        self.staged.add(i)

    def stage_out(self, chunk: Chunk) -> None:
        """Drop a staged shard's host memory (the file on disk is current: gathers do not change shards)."""
        i = chunk.index
        if i not in self.staged:
            return
        self.staged.discard(i)
        chunk.replace_shard(absent_shard(chunk))
        self._discharge(HOST, chunk.shard_bytes)

    def write_staged(self, chunk: Chunk) -> None:
        """Write a staged (read-in) disk shard that was changed in place back to its file, then drop it from memory."""
        i = chunk.index
        if i not in self.staged:
            return
        assert self.disk is not None
        self.disk.write(f"params-{i}", [chunk.shard])
        self.disk_fresh.add(i)
        self.stage_out(chunk)

    def mark_updated(self, chunk: Chunk) -> None:
        """The optimizer changed the master shard where it is: other copies are stale."""
        self.disk_fresh.discard(chunk.index)
        if self.where[chunk.index][Part.PARAMS] is DEVICE:
            self.host_stale.add(chunk.index)

    # -- inspection ---------------------------------------------------------------------
    def device_state_bytes(self, chunks: Sequence[Chunk]) -> int:
        """Actual bytes of master shards, gradients and optimizer states on the device tier now."""
        total = 0
        for chunk in chunks:
            where = self.where[chunk.index]
            if where[Part.PARAMS] is DEVICE:  # a shard that is a view of a kept full buffer: the engine left it out
                total += chunk.shard_bytes
            if where[Part.GRADS] is DEVICE:
                seen = {}
                for seg in chunk.segments:
                    if seg.param.grad is not None:
                        storage = to_local(seg.param.grad).untyped_storage()
                        seen[storage.data_ptr()] = storage.nbytes()
                for piece in chunk.grads.reduced or ():
                    seen[piece.untyped_storage().data_ptr()] = piece.untyped_storage().nbytes()
                total += sum(seen.values())
            if where[Part.OPTIM] is DEVICE:
                total += self.optim_bytes(chunk)
        return total

    def report(self) -> dict[str, Any]:
        """Bytes placed per tier (and their peaks), budgets, moves and disk traffic."""
        return {
            "used": {t.value: self.used[t] for t in MemoryTier},
            "peak": {t.value: self.peak[t] for t in MemoryTier},
            "budget": {t.value: self.budget[t] for t in MemoryTier},
            "moves": {p.value: self.moves[p] for p in Part},
            "bytes_moved": {p.value: self.bytes_moved[p] for p in Part},
            "disk_bytes_written": self.disk.bytes_written if self.disk else 0,
            "disk_bytes_read": self.disk.bytes_read if self.disk else 0,
        }
