"""The base of policies that place chunk parts in tiers: budgets, disk reads for gathers, the tiered step."""

from __future__ import annotations

import shutil
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from zero_core import ZeroConfig
from zero_core.plugin import Chunk, MemoryTier, PlacementContext, PlacementPolicy, TrainingState, rewrap
from zero_offload._disk_step import step_from_disk
from zero_offload._tiers import DEVICE, DISK, HOST, Part, Tiers
from zero_offload.config import TierConfig
from zero_offload.errors import DiskTierError, TierBudgetError

__all__ = ["TieredPolicy"]


class TieredPolicy(PlacementPolicy):
    """A placement policy over device, host and disk tiers; subclasses decide, this class moves.

    Subclasses implement :meth:`place` (the first placement) and may override the engine's
    hooks to move parts during a step with ``self.tiers.move(chunk, part, tier)``. This
    class makes a disk-resident shard readable before any gather and drops it after, and
    runs the optimizer step where the states are (see :meth:`before_step`).

    Attributes:
        config_class: The options dataclass ``ZeroConfig.placement_options`` is turned into.
        tiers: The :class:`~zero_offload.Tiers` (budgets, accounting, moves), after setup.
    """

    config_class: ClassVar[type[TierConfig]] = TierConfig

    def __init__(self, options: TierConfig | None = None) -> None:
        self.options = options if options is not None else self.config_class()
        self.chunks: list[Chunk] = []
        # Chunks whose parameters were moved for a step, and the tier they return to after it.
        self._home: dict[int, MemoryTier] = {}

    @classmethod
    def from_config(cls, config: ZeroConfig) -> TieredPolicy:
        return cls(cls.config_class.from_options(config.placement_options))

    def setup(self, context: PlacementContext) -> None:
        super().setup(context)
        self.tiers = Tiers(self.options, context)
        # optimizer.state_dict() and load_state_dict() must see real values, never the disk tier's stand-ins
        optimizer = context.optimizer
        self._hooks = [optimizer.register_state_dict_post_hook(self._states_from_disk),
                       optimizer.register_load_state_dict_post_hook(self._states_loaded)]

    def _states_from_disk(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Put the values of disk-resident states into the returned dict, read into fresh tensors.

        The optimizer's own entries, the tiers and the files stay as they are; the memory the
        values take is the caller's (saved and dropped chunk by chunk, it need not fit the host budget).
        """
        on_disk = [c for c in self.chunks if self.tiers.tier(c, Part.OPTIM) is DISK]
        if not on_disk:
            return state_dict
        # torch's state_dict numbers parameters across groups in order, and shares each one's state dict with the optimizer
        number = {id(p): n for n, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
        packed = dict(state_dict["state"])
        for chunk in on_disk:
            for param, key, value in self.tiers.read_optim(chunk):
                entry = packed[number[id(param)]] = dict(packed[number[id(param)]])
                entry[key] = value
        return {**state_dict, "state": packed}

    def _states_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """torch put the loaded states on each parameter's device: move each chunk's to its tier."""
        for chunk in self.chunks:
            self._settle_states(chunk)

    def _settle_states(self, chunk: Chunk) -> None:
        """Freshly loaded states of ``chunk`` (in memory, on its segments' device) go to their tier."""
        tiers = self.tiers
        if not tiers.optim_bytes(chunk):
            return
        tier = tiers.tier(chunk, Part.OPTIM)
        if tier is DISK:  # the loaded values replaced the stand-ins: write them out
            if any(value.numel() > 1 and value.stride(0) == 0 for *_, value in tiers.states(chunk)):
                return  # still the stand-ins (only the parameters were loaded): the files are current
            tiers.relabel(chunk, Part.OPTIM, HOST)
            tiers.move(chunk, Part.OPTIM, DISK)
            return
        device = tiers.location(tier)
        for _, state, key, value in tiers.states(chunk):
            if value.device != device:
                state[key] = rewrap(state[key], value.to(device))

    def optimizer_states(self, chunk: Chunk) -> dict[int, dict[str, Any]]:
        """The chunk's states, disk-resident ones read into fresh host tensors (the tier stays as it is)."""
        states = super().optimizer_states(chunk)
        if self.tiers.tier(chunk, Part.OPTIM) is DISK:
            states = {key: dict(value) for key, value in states.items()}
            for param, key, value in self.tiers.read_optim(chunk):
                states[id(param)][key] = value
        return states

    def attach(self, chunks: Sequence[Chunk]) -> None:
        self.chunks = list(chunks)
        self.tiers.register(self.chunks)
        self.place(self.chunks)
        self.tiers.settle_unplaced(self.chunks)

    @abstractmethod
    def place(self, chunks: Sequence[Chunk]) -> None:
        """Put every chunk's parts in their first tiers (all start on the device, but master shards made in host
        memory as :meth:`initial_tier` asked: see [Note: chunk parts])."""

    def tier_of(self, chunk: Chunk) -> MemoryTier:
        return self.tiers.tier(chunk, Part.PARAMS)

    def place_offloaded(self, chunks: Sequence[Chunk], *, params: MemoryTier | Sequence[MemoryTier]) -> None:
        """Gradients and optimizer states of ``chunks`` to the host; past the host budget, the excess to disk.

        ``params`` is where each master shard lives between uses (HOST, or DEVICE to keep it
        up and move it down only to step). The host is filled in order of how often a part
        is read: gradients (they must stay in memory), then host shards (read by every
        gather), then optimizer states (read once per step); what does not fit goes to disk.
        """
        tiers = self.tiers
        wanted = [params] * len(chunks) if isinstance(params, MemoryTier) else list(params)
        # Room left for what is read from disk for a while: two gather groups' shards (one computing,
        # one prefetched) and one chunk's shard and optimizer states while it steps.
        groups = [[self.chunks[i] for i in g] for g in self.context.gather_groups]
        reserve = 0
        if tiers.disk is not None:
            reserve = 2 * max((sum(c.shard_bytes for c in g) for g in groups), default=0)
            files = max((tiers.nbytes(c, Part.PARAMS) + tiers.nbytes(c, Part.OPTIM) for c in chunks), default=0)
            reserve += files
            grads = sum(tiers.nbytes(c, Part.GRADS) for c in chunks)
            if not tiers.fits(HOST, grads + reserve):
                raise TierBudgetError(
                    f"the host tier's budget ({tiers.budget[HOST]} bytes) cannot hold the offloaded gradients ({grads} bytes) "
                    f"plus room to read two gather groups and step one chunk from disk ({reserve} bytes); raise "
                    f"host_budget_mb to at least {(grads + reserve) / 2**20:.3f} or use smaller chunks"
                )
            # Where the host has room, also one chunk's files read ahead and one's written behind while a chunk
            # steps ([Note: the disk tier's pipeline]); below that the disk step runs without overlap.
            if tiers.fits(HOST, grads + reserve + 2 * files):
                reserve += 2 * files
        for chunk in chunks:
            tiers.move(chunk, Part.GRADS, HOST)
        for chunk, tier in zip(chunks, wanted):
            if tier is HOST and tiers.disk is not None and not tiers.fits(HOST, tiers.nbytes(chunk, Part.PARAMS) + reserve):
                tier = DISK
            tiers.move(chunk, Part.PARAMS, tier)
        for chunk in chunks:
            fits = tiers.fits(HOST, tiers.nbytes(chunk, Part.OPTIM) + reserve)
            tiers.move(chunk, Part.OPTIM, HOST if fits or tiers.disk is None else DISK)

    # -- gathers read disk-resident shards from host memory ---------------------------------
    def before_gather(self, chunks: Sequence[Chunk]) -> None:
        for chunk in chunks:
            if self.tiers.tier(chunk, Part.PARAMS) is DISK:
                self.tiers.stage_in(chunk)

    def after_release(self, chunks: Sequence[Chunk]) -> None:
        for chunk in chunks:
            # a kept-gathered chunk is never gathered again: its shard was read in for a save or a full read
            if not chunk.is_gathered or chunk.persistent:
                self.tiers.stage_out(chunk)

    def after_load(self, chunks: Sequence[Chunk]) -> None:
        """Loaded values replaced the shards and states: files and kept host copies are stale; a shard read in
        from disk goes back, and loaded states go to their tier."""
        for chunk in chunks:
            self.tiers.mark_updated(chunk)
            self.tiers.write_staged(chunk)
            self._settle_states(chunk)

    def on_transition(self, state: TrainingState) -> None:
        if state is TrainingState.IDLE or state is TrainingState.FORWARD:
            # shards read only to serve another rank's gather were never gathered here, so never released
            for chunk in self.chunks:
                if chunk.index in self.tiers.staged and not chunk.is_gathered:
                    self.tiers.stage_out(chunk)

    # -- the step runs where the optimizer states are -----------------------------------------
    def after_backward(self, chunks: Sequence[Chunk]) -> None:
        """Bring each trainable shard to its gradients' tier: a segment's gradient must sit with its parameter."""
        for chunk in chunks:
            if not chunk.requires_grad:
                continue
            params, grads = self.tiers.tier(chunk, Part.PARAMS), self.tiers.tier(chunk, Part.GRADS)
            if params is not DISK and params is not grads:
                self._home.setdefault(chunk.index, params)
                self.tiers.move(chunk, Part.PARAMS, grads)

    def before_step(self, chunks: Sequence[Chunk]) -> None:
        """Step each chunk where its optimizer states are.

        Chunks whose states are on the device step together, then those on the host,
        each batch in one call of the user's optimizer (torch's fused and foreach kernels
        run on whole batches); chunks whose states are on disk step one at a time: states
        and shard read into host memory (read ahead while the chunk before steps), stepped,
        written back (behind, while the next steps), dropped. The user's
        ``optimizer.step()`` then has nothing left to do.
        """
        tiers = self.tiers
        trainable = [c for c in chunks if c.requires_grad]
        if all(tiers.tier(c, p) is DEVICE for c in trainable for p in Part):
            for chunk in trainable:  # the user's step does it all, in one call, on the device
                tiers.mark_updated(chunk)
            return
        batches: dict[MemoryTier, list[Chunk]] = {DEVICE: [], HOST: [], DISK: []}
        for chunk in trainable:
            batches[tiers.tier(chunk, Part.OPTIM)].append(chunk)
        self._check_disk_space(trainable)
        for tier in (DEVICE, HOST):
            batch = batches[tier]
            if batch:
                for chunk in batch:
                    self._params_to(chunk, tier)
                self.context.step_chunks(batch)
                for chunk in batch:
                    self._stepped(chunk)
        if batches[DISK]:  # one at a time, files read ahead and written behind: [Note: the disk tier's pipeline]
            step_from_disk(tiers, batches[DISK], shard_to_host=lambda chunk: self._params_to(chunk, HOST),
                           step=self.context.step_chunks, stepped=self._stepped, home=self._home)

    def _check_disk_space(self, chunks: Sequence[Chunk]) -> None:
        """Fail before anything is stepped if the disk cannot take this step's write-backs (a step is all or nothing)."""
        tiers = self.tiers
        if tiers.disk is None:
            return
        files = [tiers.nbytes(c, part) for c in chunks for part in (Part.PARAMS, Part.OPTIM) if tiers.tier(c, part) is DISK]
        writes = sum(files)
        # each file is written beside the old one, then renamed over it: the largest one needs its size free
        largest = max(files, default=0)
        free = shutil.disk_usage(tiers.disk.directory).free
        full = bool(writes) and free < largest
        comm = self.context.comm
        if comm.world_size > 1:  # every rank fails, or none: a rank that stepped alone would leave the others waiting
            full = comm.agree_any(torch.tensor([full], dtype=torch.uint8))[0].item() > 0
        if full:
            raise DiskTierError(
                f"the disk tier ({tiers.disk.directory}) is full on this or another rank: {free} bytes free here, this "
                f"step writes back {writes} bytes, {largest} at once. No rank stepped and every file is intact; free "
                "space there or point TierConfig(disk_dir=...) at a larger disk, then step again."
            )

    def _params_to(self, chunk: Chunk, tier: MemoryTier) -> None:
        current = self.tiers.tier(chunk, Part.PARAMS)
        if current is not tier:
            self._home.setdefault(chunk.index, current)
            self.tiers.move(chunk, Part.PARAMS, tier)

    def _stepped(self, chunk: Chunk) -> None:
        tiers = self.tiers
        tiers.mark_updated(chunk)
        actual = tiers.optim_bytes(chunk)
        if actual != tiers.nbytes(chunk, Part.OPTIM):
            tiers.resize(chunk, Part.OPTIM, actual)
        home = self._home.get(chunk.index)
        if home is DISK:  # written back at once: at most one chunk's shard read in at a time
            if chunk.persistent:  # a kept full buffer is refreshed from the shard after the step: do it now
                with torch.no_grad():
                    chunk.refresh_own_slice()
            del self._home[chunk.index]
            tiers.move(chunk, Part.PARAMS, DISK)

    def after_step(self, chunks: Sequence[Chunk]) -> None:
        """Shards moved for the step go home (kept full buffers have been refreshed from them by now)."""
        home, self._home = self._home, {}
        for chunk in chunks:
            tier = home.get(chunk.index)
            if tier is not None:
                self.tiers.move(chunk, Part.PARAMS, tier)

    def close(self) -> None:
        """Remove the disk tier's files (the run's working set, not a checkpoint: take full_parameters() or
        optimizer.state_dict() before closing) and the optimizer hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.tiers.disk is not None:
            self.tiers.disk.close()

    # -- inspection ---------------------------------------------------------------------------
    def device_bytes(self) -> int:
        """Model data on the device tier now: the engine's buffers plus the shards, gradients and states placed there."""
        return self.context.device_bytes() + self.tiers.device_state_bytes(self.chunks)

    def report(self) -> dict[str, Any]:
        return {"policy": self.name, **self.tiers.report()}
