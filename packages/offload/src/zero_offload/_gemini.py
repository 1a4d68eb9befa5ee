"""The ``gemini`` policy: placement from a traced warm-up step, with Belady eviction and a budgeted prefetch.

[Note: gemini's decisions]
Step 0 is the warm-up: every master shard, gradient and optimizer state is on the host
(or on disk past the host budget), nothing is prefetched, and the tracer records, for
each compute point ``k`` of the step (a module about to compute with some chunks), the
chunks it uses, the engine's device bytes it needs, and the peak non-model bytes of the
period that follows (:class:`~zero_offload.MemoryTracer`).

Before the warm-up's optimizer step the policy plans, with one MAX all-reduce so that
every rank plans from the same peak:

1. ``need`` = the largest ``work[k] + non_model[k]`` of any rank, plus room for two gradient
   buffers held by reductions in flight. A device budget below it
   cannot run the step: :class:`~zero_offload.DeviceBudgetError` says how much is needed.
2. Prefetch is allowed (on every rank alike) if the headroom ``budget - need`` holds one
   more gather group; that group's bytes are then reserved.
3. ``margin_ratio`` of the remaining headroom goes to whole chunks (shard, gradients and
   optimizer states, in plan order): they step on the device.

With ``offload_activations="auto"`` the warm-up runs with the saved activations of every block of
the model's ``nn.ModuleList`` s on the host and counts each block's bytes. Before step 1 above, the
plan keeps the last blocks' activations on the device while ``need`` plus their bytes fits the
budget (the first blocks' wait longest for their backward); if that changes the blocks, the next
step is traced again, as the warm-up, and the plan made from it: exact figures, not the estimate.

From step 1 on, at each compute point the policy may keep master shards on the device
between the forward and the backward (a *cache*): it evicts cached shards, the one used
furthest in the future first (Belady), until the cache fits in what the budget leaves
after the period's measured non-model peak, the engine's buffers, this point's gather
and (on CUDA) the warm-up's fragmentation; then it caches this point's shards if they fit. Cached shards go back to the host
when the backward ends (the optimizer steps there).

With ``overlap_step`` a chunk that steps on the host may step during the backward instead (see
[Note: overlapped host steps] in ``zero_offload._overlap``); a cached shard whose gradient is down
then goes back to the host at once.

Forwards under ``torch.no_grad()`` (evaluation between steps) are not part of a step:
they are neither traced nor compared, and cache nothing.

If a step's compute points stop matching the warm-up's (a dynamic graph), the trace no
longer predicts anything: the policy logs it once and from then on caches nothing and
assumes the largest non-model peak of the warm-up at every point.

[Note: a step past its trace]
The plan is exact for the step it measured: ``need`` is the smallest budget it accepts,
and at that budget every step like the warm-up stays within it (the CPU tests audit
every operator). A later step can outgrow the trace (a bigger batch, longer sequences).
When the policy *watches* (``GeminiConfig.watch``: on with CUDA, where it reads the
allocator's figures; on the CPU it counts storages, as the warm-up did), it samples the
non-model peak of each period of every step and compares it with the plan's figure:

1. at the first period past its figure (on CUDA, by more than the allocator's rounding
   of the model's blocks) the step is *over*: from the next compute point
   on, every cached shard not in use goes back to the host and nothing is cached for
   the rest of the step, which gives the activations the cache's room;
2. before the optimizer step, ranks agree (one flag, MAX) whether any was over; if so,
   each period's figure becomes the larger of the plan's and this step's, and the plan is
   made again from them: ``need``, prefetch and the chunks pinned in the margin (chunks
   that no longer fit go back to the host before they step). A new ``need`` above the
   budget raises :class:`~zero_offload.DeviceBudgetError` naming it, before anything
   steps. Figures only grow, so a run that alternates batch sizes re-plans once.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch

from zero_core import ConfigError
from zero_core.plugin import Chunk, MemoryTier, TrainingState, get_logger
from zero_offload._activations import ActivationOffload
from zero_offload._base import TieredPolicy
from zero_offload._overlap import HostStepOverlap
from zero_offload._tiers import DEVICE, HOST, Part
from zero_offload._tracer import MemoryTracer
from zero_offload.config import GeminiConfig
from zero_offload.errors import DeviceBudgetError

__all__ = ["GeminiPolicy"]

log = get_logger("offload")

_INF = 1 << 62


def _mib(n: int) -> str:
    return f"{n} bytes, {n / 2**20:.3f} MiB"


class GeminiPolicy(TieredPolicy):
    """Chunks on the device as the budget allows, from the memory trace of a warm-up step. See [Note: gemini's decisions]."""

    name = "gemini"
    config_class = GeminiConfig
    options: GeminiConfig

    def __init__(self, options: GeminiConfig | None = None) -> None:
        super().__init__(options)
        self.allow_prefetch = False  # decided after the warm-up, identically on every rank
        self.step_index = 0
        # The step that traces (0: the warm-up; one more after offload_activations="auto" chose blocks).
        self.trace_step = 0
        # offload_activations="auto": the blocks chosen (by name), and each candidate's measured saved bytes.
        self.planned_activations: list[str] = []
        self.activation_bytes: dict[str, int] = {}
        self.in_step = False
        self.diverged = False
        self.divergence: str | None = None
        # The warm-up's compute points: (backward, chunk indices), engine bytes needed, non-model peak after.
        self.events: list[tuple[bool, tuple[int, ...]]] = []
        self.work: list[int] = []
        self.non_model: list[int] = []
        self._uses: dict[int, list[int]] = {}
        self._event = 0
        self.need = 0
        self.prefetch_reserve = 0
        self.pinned: set[int] = set()
        self.pinned_bytes = 0
        self.cached: set[int] = set()
        # Shards cached on the device at a compute point, and cached shards evicted to make room, over the run.
        self.promotions = 0
        self.evictions = 0
        # Largest device total (model data + non-model) seen at any operator, when trace_every_step is on.
        self.audit_max = 0
        self.audit_points = 0
        # The watch of later steps (see [Note: a step past its trace]): this step's period peaks, whether one went
        # past the plan's figure, and how many re-plans that caused over the run.
        self._observed: list[int] = []
        self._over = False
        self._over_evictions = 0
        self._rounding = 0  # set by place(): see there
        self.replans = 0
        # One entry per re-plan: the step, cached shards it sent back once over, need and pinned chunks before and after.
        self.replanned: list[dict[str, int]] = []
        # Installed by place() when GeminiConfig.offload_activations names module classes.
        self.activations: ActivationOffload | None = None
        # Installed by place() with GeminiConfig.overlap_step: see [Note: overlapped host steps].
        self.overlap: HostStepOverlap | None = None
        self._backward_open = False  # a backward began and its after_backward has not come yet

    # -- setup ------------------------------------------------------------------------
    def initial_tier(self, chunk: Chunk) -> MemoryTier:
        """Host memory: :meth:`place` puts every master shard there (or, past the host budget, on disk), so
        ``shard()`` makes it there and never holds the model's shards on the device (see [Note: shards made
        where they live] in ``zero_core.chunks.chunk``)."""
        return HOST

    def place(self, chunks: Sequence[Chunk]) -> None:
        budget = self.tiers.budget[DEVICE]
        if budget is None:
            raise ConfigError(
                "the gemini policy needs a device budget on a machine without CUDA (the CPU is both device and "
                "host there); set placement_options={'device_budget_mb': ...}"
            )
        self.group_bytes = [sum(self._gather_cost(chunks[i], backward=True) for i in g) for g in self.context.gather_groups]
        # Reductions in flight hold their gradient buffers until the collective completes, and a backward that
        # outpaces them takes fresh ones: room for two more, whenever they come.
        # One rank reduces nothing: its gradient buffer becomes the gradient at once, and no reduction holds it.
        alone = all(c.world_size == 1 and c.replicas == 1 for c in chunks)
        self.inflight_reserve = 0 if alone else 2 * max(
            (c.full_bytes for c in chunks if c.requires_grad and not c.persistent), default=0)
        floor = max(self.group_bytes, default=0)
        if budget < floor:
            raise DeviceBudgetError(
                f"the device budget ({_mib(budget)}) is below one gather group's buffers and gradient buffers "
                f"({_mib(floor)}), before any activation; the device needs at least that plus the non-model peak "
                f"the warm-up step will measure. Raise device_budget_mb above {floor / 2**20!r} (the warm-up's "
                "refusal then names the exact figure) or use smaller chunks (ChunkPolicy(chunk_size=...)).",
                needed=floor,
            )
        self.place_offloaded(chunks, params=HOST)
        # On CUDA the allocator rounds every block up to 512 bytes, and model data is counted at its exact size: a
        # later step whose cache holds shards the warm-up did not shows their rounding as non-model bytes. An excess
        # within that much (each chunk's shard, full buffer, gradient buffer and states, rounded) is no excess.
        self._rounding = 4 * 512 * len(chunks) if self.context.device.type == "cuda" else 0
        self.tracer = MemoryTracer(self.context.device, on_op=self._audit if self.options.trace_every_step else None)
        self.activations = self._offload_activations()
        if self.options.overlap_step:
            if self.context.config.precision.loss_scale is not None:
                raise ConfigError(
                    "GeminiConfig.overlap_step cannot be used with Precision(loss_scale=...): the overflow check "
                    "reads every gradient before any chunk may step. Remove overlap_step (or the loss scaler).")
            self.overlap = HostStepOverlap(self.context.optimizer, self.tiers)

    def _offload_activations(self) -> ActivationOffload | None:
        """Install activation offload on the modules of the classes ``offload_activations`` names (before the warm-up:
        the trace measures the step as it will run); with ``"auto"``, measure the blocks' saved bytes instead."""
        names = self.options.offload_activations
        if not names:
            return None
        model = self.context.model
        if model is None:
            raise ConfigError("GeminiConfig.offload_activations needs the model: this policy was set up without one")
        if names == "auto":
            blocks = [m for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst
                      if any(True for _ in m.parameters())]
            return ActivationOffload(blocks, measure=True, simulate_host=not self.tracer.cuda) if blocks else None
        chosen = [m for m in model.modules() if type(m).__name__ in names]
        found = {type(m).__name__ for m in chosen}
        missing = [n for n in names if n not in found]
        if missing:
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"GeminiConfig.offload_activations names {missing}, which no module of the model is; its module "
                f"classes are {classes}."
            )
        return ActivationOffload(chosen)

    def keep_gathered_alone(self) -> bool:
        """No: on one rank too a chunk takes device memory only while a module computes with it (the budget is
        for what the trace measured, not for the whole model kept gathered)."""
        return False

    @staticmethod
    def _gather_cost(chunk: Chunk, *, backward: bool) -> int:
        """Device bytes gathering ``chunk`` adds: its full buffer, and in backward its gradient buffer."""
        if chunk.persistent:
            return 0
        cost = chunk.full_bytes
        if backward and chunk.requires_grad:
            cost += chunk.full_bytes
        return cost

    # -- the step's phases ---------------------------------------------------------------
    @property
    def warming_up(self) -> bool:
        """Whether this step is traced (the warm-up, or the step after offload_activations="auto" chose blocks)."""
        return self.step_index == self.trace_step

    @property
    def watching(self) -> bool:
        """Whether later steps are measured against the plan. See [Note: a step past its trace]."""
        if self.options.trace_every_step:
            return True
        return self.tracer.cuda if self.options.watch is None else self.options.watch

    def on_transition(self, state: TrainingState) -> None:
        super().on_transition(state)
        overlap = self.overlap
        if overlap is not None:  # see [Note: overlapped host steps]
            if state is TrainingState.BACKWARD:
                self._backward_open = True
                overlap.begin_backward(self.chunks, allowed=not self.warming_up and not self.options.trace_every_step)
            elif state is TrainingState.FORWARD:
                overlap.undo_all("a forward began before optimizer.step()")
            elif state is TrainingState.IDLE and self._backward_open:  # it ended without after_backward: it raised
                self._backward_open = False
                overlap.open = False
                overlap.undo_all("the backward raised")
            elif state is TrainingState.IDLE:
                overlap.handed_over()
        if state is TrainingState.FORWARD and not self.in_step and torch.is_grad_enabled():
            self.in_step = True
            self._event = 0
            self._observed = []
            self._over = False
            self._over_evictions = 0
            if self.warming_up or self.watching:
                self.tracer.start(self.device_bytes())
                self.tracer.sample(self.device_bytes())

    def before_compute(self, chunks: Sequence[Chunk], *, backward: bool) -> None:
        if not self.in_step:
            return  # inference (a forward under torch.no_grad()): not part of the training step's trace
        k, self._event = self._event, self._event + 1
        key = (backward, tuple(c.index for c in chunks))
        need = sum(self._gather_cost(c, backward=backward) for c in chunks
                   if not c.is_gathered or (backward and c.requires_grad and not c.grads.unreduced))
        if self.warming_up:
            if k > 0:
                self.non_model.append(self.tracer.sample(self.device_bytes()))
            self.events.append(key)
            self.work.append(self.device_bytes() + need)
            return
        if self.options.trace_every_step:
            self._audit()
        if self.watching and k > 0:
            self._observe(self.tracer.sample(self.device_bytes(), synchronize=False))
        if not self.diverged and (k >= len(self.events) or self.events[k] != key):
            expected = self.events[k] if k < len(self.events) else "nothing"
            self._diverge(f"compute point {k} of step {self.step_index} used {key}, the warm-up trace had {expected}")
        self._make_room(k, chunks, need)
        if backward and self.overlap is not None and self.overlap.open:
            self.overlap.poll(self.chunks, self._steps_on_host)

    def _planned(self, period: int) -> int:
        """The plan's non-model figure for a period of this step (the largest one once the graph diverged)."""
        if self.diverged or period >= len(self.non_model):
            return max(self.non_model, default=0)
        return self.non_model[period]

    def _observe(self, peak: int) -> None:
        """Record the non-model peak of the period that just ended; past the plan's figure, the step is over."""
        period = len(self._observed)
        self._observed.append(peak)
        if not self._over and peak > self._planned(period) + self._rounding:
            self._over = True
            log.warning("zero-offload gemini: step %d's non-model data went past the warm-up's trace (%s at period %d, "
                        "planned %s); cached shards go back to the host for the rest of the step and the plan is made "
                        "again before the optimizer step", self.step_index, _mib(peak), period,
                        _mib(self._planned(period)))

    def _diverge(self, why: str) -> None:
        self.diverged = True
        self.divergence = why
        log.warning("zero-offload gemini: the step diverged from the warm-up trace (%s); the graph is dynamic, so from "
                    "now on no shard is cached on the device and every point assumes the warm-up's largest non-model peak",
                    why)

    def _make_room(self, k: int, chunks: Sequence[Chunk], need: int) -> None:
        tiers = self.tiers
        budget = tiers.budget[DEVICE]
        assert budget is not None
        non_model = self._planned(k)
        # on CUDA the allocator's fragmentation measured in the warm-up stays lost in every step: the cache fits beside it
        # (on an H200, steps after a warm-up that ignored it here ran out of memory with 0.4-0.6 GiB stuck in split blocks)
        allowed = (budget - self.prefetch_reserve - self.inflight_reserve - self.tracer.fragmented - non_model
                   - self.context.device_bytes() - need)
        if self._over:  # the trace underestimates this step: its activations get the cache's room
            allowed = -1
        # the device holds the pinned chunks' parts and the cached shards (every other part is elsewhere)
        state = self.pinned_bytes + sum(self.chunks[i].shard_bytes for i in self.cached)
        using = {c.index for c in chunks}
        if state > allowed and self.cached:
            for index in sorted(self.cached - using, key=lambda i: self._next_use(i, k), reverse=True):
                if state <= allowed:
                    break
                chunk = self.chunks[index]
                tiers.move(chunk, Part.PARAMS, HOST)
                self.cached.discard(index)
                self.evictions += 1
                self._over_evictions += self._over
                state -= chunk.shard_bytes
        if self.diverged or self._over:
            return
        for chunk in chunks:
            if chunk.index in self.cached or chunk.index in self.pinned or tiers.tier(chunk, Part.PARAMS) is not HOST:
                continue
            if state + chunk.shard_bytes <= allowed:
                tiers.move(chunk, Part.PARAMS, DEVICE)
                self.cached.add(chunk.index)
                self.promotions += 1
                state += chunk.shard_bytes

    def _next_use(self, index: int, k: int) -> int:
        uses = self._uses.get(index, [])
        at = bisect.bisect_right(uses, k)
        return uses[at] if at < len(uses) else _INF

    def _steps_on_host(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` (its gradient down and the chunk released) may step on the host early: its gradient and
        states are there, and its shard is or goes there (a cached shard is not used again in this backward, and
        goes down now instead of when the backward ends)."""
        tiers = self.tiers
        if chunk.index in self.pinned or tiers.tier(chunk, Part.GRADS) is not HOST or tiers.tier(chunk, Part.OPTIM) is not HOST:
            return False
        if chunk.index in self.cached:
            tiers.move(chunk, Part.PARAMS, HOST)
            self.cached.discard(chunk.index)
        return tiers.tier(chunk, Part.PARAMS) is HOST

    def after_backward(self, chunks: Sequence[Chunk]) -> None:
        overlap = self.overlap
        if overlap is not None:
            self._backward_open = False
            if overlap.open:
                overlap.event("backward_end")  # every reduction has completed: what follows is the step's tail
                overlap.poll(self.chunks, self._steps_on_host)
                # the hand-over that follows gives every segment its gradient: the worker's step must be done by then
                overlap.wait()
        for index in sorted(self.cached):
            self.tiers.move(self.chunks[index], Part.PARAMS, HOST)
        self.cached.clear()
        super().after_backward(chunks)

    def before_step(self, chunks: Sequence[Chunk]) -> None:
        if self.warming_up:
            self.non_model.append(self.tracer.sample(self.device_bytes()))
            if not self.options.trace_every_step:
                self.tracer.stop()
            try:
                self._plan()
            except BaseException:  # refused at planning: no step follows to end the trace
                self.tracer.stop()
                raise
        elif self.in_step and self.watching:
            self._observe(self.tracer.sample(self.device_bytes(), synchronize=False))
            if not self.options.trace_every_step:
                self.tracer.stop()
            over = self._over
            comm = self.context.comm
            if comm.world_size > 1:  # the plan decides which collectives run (prefetch): every rank re-plans, or none
                over = comm.agree_any(torch.tensor([over], dtype=torch.uint8))[0].item() > 0
            if over:
                self._replan()
        if self.overlap is not None:
            kept, undone = self.overlap.commit()
            for chunk in kept:
                self._stepped(chunk)
            if undone:
                self.overlap.enabled = False
                log.warning("zero-offload gemini: the gradients of %d chunk(s) stepped early were changed between "
                            "backward and optimizer.step() (clipping, unscaling, zero_grad or a new .grad); those "
                            "steps were undone and redone with the new gradients, and overlap_step is off from now "
                            "on (see [Note: overlapped host steps])", len(undone))
        super().before_step(chunks)

    def after_step(self, chunks: Sequence[Chunk]) -> None:
        if self.overlap is not None:
            self.overlap.restore_grads()
        super().after_step(chunks)
        if self.options.trace_every_step:
            self._audit()
            self.tracer.stop()
        self.step_index += 1
        self.in_step = False

    # -- planning after the warm-up ------------------------------------------------------
    def _replan(self) -> None:
        """The plan's figures grow to this step's, and the plan is made again. See [Note: a step past its trace]."""
        observed = self._observed
        if not self.diverged and len(observed) == len(self.non_model):
            self.non_model = [max(a, b) for a, b in zip(self.non_model, observed)]
        else:  # no point-by-point match: every point assumes the largest peak of either
            largest = max(max(self.non_model, default=0), max(observed, default=0))
            self.non_model = [largest] * len(self.non_model)
        self.replans += 1
        entry = {"step": self.step_index, "evicted": self._over_evictions, "need_before": self.need,
                 "pinned_before": len(self.pinned)}
        self.replanned.append(entry)
        self._plan()
        entry.update(need=self.need, pinned=len(self.pinned))

    def _plan(self) -> None:
        """See [Note: gemini's decisions], steps 1 to 3 (and [Note: a step past its trace] for a re-plan)."""
        tiers, comm = self.tiers, self.context.comm
        self._uses = {}
        for k, (_, indices) in enumerate(self.events):
            for index in indices:
                self._uses.setdefault(index, []).append(k)
        # on CUDA, cached memory the allocator cannot release counts too (see [Note: what the tracer measures])
        if self.diverged:  # the warm-up's points no longer match the steps': the largest of each, at any point
            local = max(self.work, default=0) + max(self.non_model, default=0)
        else:
            local = max((w + n for w, n in zip(self.work, self.non_model)), default=0)
        local += self.inflight_reserve + self.tracer.fragmented
        self.need = -comm.agree_min(-local) if comm.world_size > 1 else local
        budget = tiers.budget[DEVICE]
        assert budget is not None
        if self._plan_activations(budget):
            return
        if self.need > budget:
            what = ("the warm-up step needed at its peak" if not self.replans else
                    f"step {self.step_index} needed at its peak, past the warm-up's trace (nothing has stepped this step)")
            if self.planned_activations:
                what += f" with the saved activations of {len(self.planned_activations)} block(s) in host memory"
            raise DeviceBudgetError(
                f"the device budget ({_mib(budget)}) is below what {what}: "
                f"{_mib(self.need)} (the gathered chunks and gradient buffers of one compute point plus the "
                f"activations measured there). The smallest budget that trains is device_budget_mb={self.need / 2**20!r} "
                f"({self.need} bytes); or lower the activations (smaller micro-batch, activation checkpointing).",
                needed=self.need, measured=True,
            )
        headroom = budget - self.need
        largest = max(self.group_bytes, default=0)
        self.allow_prefetch = self.options.prefetch and headroom >= largest
        self.prefetch_reserve = largest if self.allow_prefetch else 0
        headroom -= self.prefetch_reserve
        margin = int(headroom * self.options.margin_ratio)
        keep: list[Chunk] = []  # in plan order, while each chunk's parts fit what is left of the margin
        for chunk in self.chunks:
            if not chunk.requires_grad:
                continue
            cost = tiers.nbytes(chunk)
            if cost > margin:
                break
            keep.append(chunk)
            margin -= cost
        kept = {c.index for c in keep}
        for index in sorted(self.pinned - kept):  # a re-plan's smaller margin: these step on the host from now on
            chunk = self.chunks[index]
            for part in (Part.GRADS, Part.PARAMS, Part.OPTIM):
                tiers.move(chunk, part, HOST)
            self.pinned.discard(index)
        for chunk in keep:
            if chunk.index in self.pinned:
                continue
            for part in (Part.PARAMS, Part.GRADS, Part.OPTIM):  # a gradient may only join its parameter's device
                tiers.move(chunk, part, DEVICE)
            tiers.drop_host_copy(chunk.index)  # it steps on the device from now on: no host copy to keep fresh
            self.pinned.add(chunk.index)
        self.pinned_bytes = sum(tiers.nbytes(self.chunks[i]) for i in self.pinned)

    def _plan_activations(self, budget: int) -> bool:
        """offload_activations="auto", after the warm-up (which ran with every block's saved activations on the host):
        keep the last blocks' activations on the device (they wait least for their backward) while the estimate
        fits the budget; if that changes the blocks, trace the next step with them. Whether it does. See
        [Note: gemini's decisions]."""
        offload = self.activations
        if offload is None or not offload.measure:
            return False
        offload.measure = False  # planned once
        names = {id(m): n for n, m in self.context.model.named_modules()} if self.context.model is not None else {}
        measured = offload.measured()
        comm = self.context.comm
        if comm.world_size > 1:  # the choice decides the next step's plan: every rank chooses from the largest figures
            measured = [(m, -comm.agree_min(-n)) for m, n in measured]
        self.activation_bytes = {names.get(id(m), type(m).__name__): n for m, n in measured}
        kept: set[int] = set()
        extra = 0
        for module, nbytes in reversed(measured):  # each kept block's activations add to the peak, at most
            if self.need + extra + nbytes > budget:
                break
            kept.add(id(module))
            extra += nbytes
        chosen = [m for m, n in measured if id(m) not in kept and n]
        self.planned_activations = [names.get(id(m), type(m).__name__) for m in chosen]
        if not kept:
            return False  # the warm-up ran as planned: its trace is the plan's
        offload.remove()
        self.activations = ActivationOffload(chosen, simulate_host=not self.tracer.cuda) if chosen else None
        log.info("zero-offload gemini: the warm-up step, with every block's saved activations on the host, needs %s of "
                 "the device budget (%s); %d block(s) keep theirs on the device from now on, %d offload them (%s), "
                 "and the next step is traced again to plan from it", _mib(self.need), _mib(budget), len(kept),
                 len(chosen), ", ".join(self.planned_activations) or "none")
        # the next step is the warm-up again: streamed, nothing prefetched, cached or kept on the device
        self.trace_step = self.step_index + 1
        self.events, self.work, self.non_model = [], [], []
        self.allow_prefetch, self.prefetch_reserve = False, 0
        return True

    def close(self) -> None:
        """Also put back the forwards wrapped for activation offload, and end a trace still open.

        On CPU the tracer is a dispatch mode on the process's mode stack from the warm-up's forward to its
        ``optimizer.step()``; a model closed in between (a forward that raised, training stopped before its first
        step) would leave every later operator of the process going through it.
        """
        self.tracer.stop()
        if self.activations is not None:
            self.activations.remove()
            self.activations = None
        if self.overlap is not None:
            self.overlap.close()
        super().close()

    # -- audit ----------------------------------------------------------------------------
    def _audit(self) -> None:
        if not self.in_step:
            return
        total = self.device_bytes() + self.tracer.live(self.device_bytes())
        self.audit_points += 1
        self.audit_max = max(self.audit_max, total)

    def report(self) -> dict[str, Any]:
        return {**super().report(), "need": self.need, "prefetch": self.allow_prefetch, "pinned": sorted(self.pinned),
                "diverged": self.diverged, "promotions": self.promotions, "evictions": self.evictions,
                "audit_max": self.audit_max, "audit_points": self.audit_points, "replans": self.replans,
                "replanned": [dict(e) for e in self.replanned],
                "non_model_peak": max(self.non_model, default=0),
                "activations": self.activations.counts() if self.activations is not None else None,
                "overlap": self.overlap.report() if self.overlap is not None else None,
                "planned_activations": list(self.planned_activations), "activation_bytes": dict(self.activation_bytes),
                "resident": self.tracer.resident, "fragmented": self.tracer.fragmented,
                "allocator_cached_peak": self.tracer.cached_free}


