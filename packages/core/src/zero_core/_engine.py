"""The runtime that runs any shard plan: gather before use, release after, reduce gradients.

[Note: when chunks are gathered and released]
Every module that registers a parameter directly (a tied parameter registers under
several modules) gets a forward pre-hook that gathers the chunks holding its
parameters. In forward, a chunk is released as soon as every module that triggers it
has run once in this forward; whatever is still gathered when the wrapped model's
forward returns is released then. In backward, a hook on each module's outputs
gathers its chunks again before the module's backward runs, and activation
checkpointing's recomputation gathers through the same forward pre-hooks.

[Note: gradient reduction order]
Every rank must issue the same collectives in the same order, yet which parameters
receive a gradient may differ between ranks and steps (unused parameters, data-
dependent branches). So each backward reduce-scatters every trainable chunk exactly
once, in one fixed order (the reverse of the plan), on every rank. When a forward
that builds a graph returns, the engine walks the autograd graph from the outputs
and records which parameters can receive a gradient; a chunk is ready once all of
those have been accumulated, and is reduced when it is ready and every chunk before
it in the order has been reduced. When the backward ends, the remaining chunks are
reduced in order, with zeros for gradients that never came. No chunk ever waits for
a gradient that cannot arrive.

[Note: step transactions]
Every way out of forward, backward and step must leave an engine that can save a
checkpoint, evaluate, or train on as plain PyTorch would. A forward that raises is undone
at once (``abort_forward``). A forward whose backward never comes needs nothing: which
parameters its graph reaches joins what the next backward waits for, and a backward with
no forward since the previous one (a second backward through a retained graph) waits for
what the previous one did; each backward reduces every chunk once and adds its mean
gradient. A backward that raises is the hard case: the autograd
engine drops the queued end-of-backward callback, and nothing tells the engine. So every
entry point (the next forward, ``optimizer.step()``, ``zero_grad()``, each collective
verb) first *settles*: if the state is still BACKWARD while no backward runs on this
thread, the reductions issued are completed, their results and every gradient of that
backward dropped, and the chunks released (``_abort_backward``). Until then the modules
hold the sharded parameters with the optimizer's gradients untouched, because a backward
never registers the full parameters (only a recomputation does).

[Note: no idle buffers between steps]
A backward borrows full-size buffers (gradient buffers, the send and receive buffers of its
reduce-scatters) and a stage 1 or 2 step borrows receive buffers for its all-gathers; pools
keep them so that one phase reuses the same few buffers instead of allocating and faulting
in a fresh one per chunk. Kept past their phase they would be reserved for nothing: on GPT-2
small at 2 ranks the engine's pool and the gloo backend's receive pool held about 380 MiB
idle through the next forward, at the step's peak, when the activations needed that memory.
So when a backward's reductions are complete, and again after a step's all-gathers, the
engine drops the idle buffers of its pool and every comm backend's (``CommBackend.free``);
the next phase allocates them again, mostly from memory the allocator already holds.
A ``no_sync()`` backward keeps its pool: the gradients it accumulated live in it.

[Note: gradient buffers on arrival]
A chunk's gradients are reduced from one full-size buffer, and autograd accumulates into it
in place when each parameter's ``.grad`` is a view of it. Prepared when a module's backward
begins, that buffer lives from there to the chunk's reduction, which waits for the last of
its parameters' gradients: for GPT-2's tied embedding (its own 147 MiB chunk) that is the
whole backward, since the head's gradient comes first and the embedding's last, and
autograd itself already holds the head's part until then. So at stages 2 and 3 the buffer
is taken when the chunk's first gradient arrives (the post-accumulate-grad hook): that
gradient, which autograd made, is copied in (and dropped), and the other parameters'
``.grad`` point at their zeroed views from then on. Stage 1 keeps its buffer for the whole run and prepares it as
before; a chunk gathered on demand or exposed prepares it when it is gathered.

[Note: torch.compile]
Compiling a block (``block.compile()`` or ``torch.compile(block)``, before or after shard)
makes dynamo trace the forward hooks of the modules the block calls. Zero's hooks gather,
release and swap parameters, so they are disabled for dynamo (``_untraced``) and would run
eagerly at a graph break, splitting the block at every module that registers parameters
(6 graphs per GPT-2 block). So a compiled module is one unit of gather and release, as a
module passed to FSDP2's fully_shard is: the parameter registrations of its whole subtree
are grouped under the outermost compiled module (``_compiled_call_impl`` set by
``nn.Module.compile()``, or a dynamo ``OptimizedModule``, hooked on the wrapper, whose call
runs the hooks before entering the compiled frame); its pre-hook gathers all their chunks,
its forward hook releases them (as far as no other unit still needs them), the hook on its
outputs gathers them again for backward, and the modules inside get no hooks. Dynamo runs a
compiled module's own hooks outside its graph (for ``block.compile()`` too, whose compiled
``_call_impl`` runs them and picks up the forward's frame), so a GPT-2 block compiles to one
graph with no graph break (measured with ``aot_eager``, stages 2 and 3, both forms). At
stage 3 a whole block is gathered at once, as under FSDP2. Blocks compiled after shard are
found at the start of each root forward (a walk over ``modules()`` compared with the compiled
modules the hooks were grouped by), and the module hooks alone are installed again with the
new grouping. Guards hold across steps: the modules hold the same unsharded parameter
objects in every forward, only their ``.data`` changes, so there is no recompilation
after the first step. Compiling the wrapped model itself is refused (``ZeroModule.compile``
and a check in ``ZeroModule.__call__``): its root call opens and closes the step's state,
which cannot be traced. A module inside a compiled block called from outside the block's
forward reads stand-ins, gathered on demand (see [Note: parameters used outside their module]).
"""

from __future__ import annotations

import atexit
import functools
import sys
import warnings
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zero_core._accounting import engine_work
from zero_core._autograd import in_backward, reachable_params, tensors_of
from zero_core._inspection import Inspection
from zero_core._optimizer_bridge import OptimizerBridge, ZeroGradHook
from zero_core._reduction import GradientReduction
from zero_core._group import GatherGroup, build_groups
from zero_core._lockstep import Lockstep
from zero_core._released import ReleasedParameter
from zero_core._scaler import LossScaler
from zero_core._schedule import GatherScheduler
from zero_core._state import ChunkState, TrainingState
from zero_core._waiter import ReductionWaiter
from zero_core.chunk import Chunk
from zero_core.errors import GradientLostError, ZeroError

if TYPE_CHECKING:
    import pluggy

    from zero_core.api import ZeroConfig
    from zero_core.comm import CommBackend
    from zero_core.placement import PlacementPolicy
    from zero_core.strategy import ShardStrategy

__all__ = ["Engine"]


def _untraced(hook: Any) -> Any:
    """``hook`` run as plain Python even inside a compiled region. See [Note: torch.compile].

    A compiled module's ``_call_impl`` traces the forward hooks of the modules it calls. Zero's
    hooks communicate and swap the modules' parameters (``param.data = ...``, which dynamo would
    record as an in-place ``set_`` and autograd then rejects in backward); as FSDP2 does with its
    own hooks, they are excluded from tracing and run eagerly at a graph break."""
    import torch._dynamo  # lazily: zero_core's import stays light; DTensor's ops load it anyway once the model runs

    return torch._dynamo.disable(hook, recursive=True, reason="zero_core hooks gather and release parameters")


class Engine(GradientReduction, OptimizerBridge, Inspection):
    """Owns the chunks of one wrapped model and drives them through each step."""

    def __init__(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        chunks: list[Chunk],
        comm: CommBackend,
        gather_groups: Sequence[Sequence[int]] | None = None,
        reduce_comm: CommBackend,
        strategy: ShardStrategy,
        placement: PlacementPolicy,
        config: ZeroConfig,
        hook: pluggy.HookRelay,
        device: torch.device,
    ) -> None:
        # What was built at setup; fixed for the engine's life.
        self.module = module
        self.optimizer = optimizer
        self.chunks = chunks
        self.comm = comm
        # Reduce-scatters run on their own process group, asynchronously: they are ordered by
        # [Note: gradient reduction order] while all-gathers follow [Note: agreeing on all-gathers],
        # and a rank blocked on one stream must never hold up the other.
        self.reduce_comm = reduce_comm
        # The chunks' own groups beyond these two (meshes, see [Note: one group per direction of traffic]).
        self._mesh_comms: list[CommBackend] = []
        for chunk in chunks:
            if chunk.groups is None:
                continue
            g = chunk.groups
            for comm_ in (g.gather, g.reduce, g.reduce_all, g.replicate, g.sub):
                if comm_ is not None and comm_ is not comm and comm_ is not reduce_comm and \
                        all(comm_ is not c for c in self._mesh_comms):
                    self._mesh_comms.append(comm_)
        self.strategy = strategy
        self.placement = placement
        self.config = config
        self.hook = hook
        self.device = device
        self._chunk_of: dict[int, Chunk] = {id(s.param): c for c in chunks for s in c.slots}
        self._slot_of: dict[int, int] = {id(s.param): i for c in chunks for i, s in enumerate(c.slots)}
        self._name_of: dict[int, str] = {id(s.param): s.name for c in chunks for s in c.slots}
        # Every place a parameter is registered (a tied one under several modules): (module, name, chunk, slot).
        # The engine swaps the sharded and unsharded parameters there. See [Note: parameter views].
        self._registrations: list[tuple[nn.Module, str, Chunk, int]] = []
        for m in module.modules():
            for pname, p in m._parameters.items():
                if p is not None and id(p) in self._chunk_of:
                    self._registrations.append((m, pname, self._chunk_of[id(p)], self._slot_of[id(p)]))
        self._by_chunk: dict[int, list[tuple[nn.Module, str, int]]] = {}
        for m, pname, chunk, i in self._registrations:
            self._by_chunk.setdefault(chunk.index, []).append((m, pname, i))
        # What the modules hold, inside forward and backward, for parameters of chunks not gathered.
        # See [Note: parameters used outside their module].
        self._stand_ins = {(c.index, i): ReleasedParameter(self.gather_on_demand, c, i) for c in chunks if not c.persistent
                           for i in range(len(c.slots))}
        # Chunks whose parameters a forward with a graph read outside their modules: gathered when backward begins.
        self._exposed: set[int] = set()
        # Chunks reduced in this order on every rank. See [Note: gradient reduction order]. Recomputed when a
        # step's first forward begins, since parameters may be frozen or unfrozen between steps.
        self._reduce_order: list[Chunk] = [c for c in reversed(chunks) if c.requires_grad]
        # Whether the modules hold the unsharded parameters (inside forward and backward) or the sharded ones.
        self._unsharded = True
        # True inside model.gathered_parameters(): the modules hold the context's full copies.
        self._gathered_context = False
        # Which modules trigger a gather of which chunks. See [Note: when chunks are gathered and released].
        self._module_chunks: dict[int, tuple[Chunk, ...]] = {}
        self._triggers: dict[int, set[int]] = {c.index: set() for c in chunks}
        self._handles: list[Any] = []
        # The forward hooks of the modules alone, replaced when the compiled modules change. See [Note: torch.compile].
        self._module_handles: list[Any] = []
        # The compiled modules (held, so their ids stay theirs) the module hooks were grouped by.
        self._compiled: tuple[nn.Module, ...] = ()
        self._grad_hooked: set[int] = set()
        # Stages 1 and 2 never gather during a pass, so they need no agreement rounds either.
        sharded_params = any(not c.persistent for c in chunks)
        self._forward_gathers = sharded_params
        # Every communicating phase begins with a round that checks the ranks are in the same one.
        self._lockstep = Lockstep(comm, enabled=not config.static_graph)
        # Forwards that built a graph since the last backward: ranks must agree on it when a backward begins,
        # which catches a rank that skipped a backward even where forwards do not communicate (stages 1, 2).
        self._graph_forwards = 0
        self._window_open = False
        pool = chunks[0].pool if chunks else None
        self.groups: list[GatherGroup] = build_groups(chunks, gather_groups, pool) if pool is not None else []
        self._scheduler = GatherScheduler(self.groups, comm, placement, agree=not config.static_graph and sharded_params)
        # Groups that keep full buffers, refreshed from the master shards after each step (their trainable members).
        self._refresh_after_step = [g for g in self.groups if any(c.persistent for c in g.chunks)]
        loss_scale = config.precision.loss_scale
        self.scaler = LossScaler(loss_scale) if loss_scale is not None else None
        # Set by ZeroModule.backward: the losses of this step were scaled by the scaler.
        self.loss_scaled = False
        self._waiter = ReductionWaiter()
        # False inside ZeroModule.no_sync(): backwards accumulate full gradients without reducing them.
        self.sync_gradients = True

        # Per-step state, reset by the transitions below.
        self.state = TrainingState.IDLE
        # Modules that ran in the current forward, per chunk index.
        self._ran: dict[int, set[int]] = {}
        # Parameters a gradient may reach from the graphs the forwards since the last backward built, per chunk
        # index; the last backward's are kept, for a second backward through a retained graph.
        self._expected: dict[int, set[int]] = {}
        self._last_expected: dict[int, set[int]] = {}
        # Of those, the ones the running backward still waits for.
        self._waiting: dict[int, set[int]] = {}
        self._ready: dict[int, bool] = {}
        self._reduced: set[int] = set()
        self._next_reduce = 0
        self._callback_queued = False
        self.step_count = 0
        # Segments a placement policy already stepped in this optimizer step (see step_chunks), with their
        # gradients, which the user's own step must skip and which come back after it.
        self._stepped: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._in_substep = False
        # Between the engine's step pre-hook and its post-hook: still set later means the step raised.
        self._step_open = False

        self._install_hooks()
        self.use_sharded()
        # A user who never calls close() still gets it before the interpreter tears torch down: process
        # groups and work handles freed that late can abort the exit ("terminate called without an active exception").
        self._closed = False
        ref = weakref.ref(self)
        atexit.register(lambda: (engine := ref()) is not None and engine.close())

    # -- hook installation ---------------------------------------------------------
    def _install_hooks(self) -> None:
        self._install_module_hooks()
        for chunk in self.chunks:
            for slot in chunk.slots:
                self._hook_gradient(slot.param)
        self._handles.append(self.optimizer.register_step_pre_hook(self._before_step))
        self._handles.append(self.optimizer.register_step_post_hook(self._after_step))
        self._handles.append(ZeroGradHook(self.optimizer, self.discard_accumulation))

    def _compiled_modules(self) -> tuple[nn.Module, ...]:
        """The modules below the root that are compiled, in ``modules()`` order. See [Note: torch.compile]."""
        # OptimizedModule exists only once dynamo is loaded: never import it from here
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        optimized = getattr(eval_frame, "OptimizedModule", None)
        return tuple(m for m in self.module.modules() if m is not self.module and (
            getattr(m, "_compiled_call_impl", None) is not None or (optimized is not None and isinstance(m, optimized))))

    def _hook_units(self, compiled: tuple[nn.Module, ...]) -> dict[int, nn.Module]:
        """Each module below a compiled one (by id) -> its outermost compiled ancestor, which runs the hooks."""
        units: dict[int, nn.Module] = {}
        if not compiled:
            return units
        compiled_ids = {id(m) for m in compiled}
        seen: set[int] = set()
        stack: list[tuple[nn.Module, nn.Module | None]] = [(self.module, None)]
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

    def _install_module_hooks(self) -> None:
        """Hook each unit of gather and release: a module that registers parameters, or the outermost compiled
        module above it, which then gathers and releases the chunks of all of them. See [Note: torch.compile]."""
        for handle in self._module_handles:
            handle.remove()
        self._module_handles.clear()
        self._module_chunks.clear()
        for triggers in self._triggers.values():
            triggers.clear()
        self._compiled = self._compiled_modules()
        units = self._hook_units(self._compiled)
        by_unit: dict[int, tuple[nn.Module, dict[int, Chunk]]] = {}
        for m, _, chunk, _ in self._registrations:
            unit = units.get(id(m), m)
            by_unit.setdefault(id(unit), (unit, {}))[1][id(chunk)] = chunk
        for module, chunks in by_unit.values():
            ordered = tuple(sorted(chunks.values(), key=lambda c: c.index))
            self._module_chunks[id(module)] = ordered
            for chunk in ordered:
                self._triggers[chunk.index].add(id(module))
            pre = _untraced(functools.partial(self._pre_forward, ordered))
            post = _untraced(functools.partial(self._post_forward, ordered, id(module)))
            self._module_handles.append(module.register_forward_pre_hook(pre))
            self._module_handles.append(module.register_forward_hook(post))

    def _regroup_if_compiled(self) -> None:
        """A module was compiled (or a compiled one replaced) since the hooks were installed: install them again."""
        compiled = self._compiled_modules()
        if len(compiled) != len(self._compiled) or any(a is not b for a, b in zip(compiled, self._compiled)):
            self._install_module_hooks()

    def _hook_gradient(self, param: torch.Tensor) -> None:
        """Watch ``param``'s gradient accumulation; a frozen one is watched once it is unfrozen."""
        if param.requires_grad and id(param) not in self._grad_hooked:
            self._grad_hooked.add(id(param))
            self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad_accumulated))

    def close(self) -> None:
        """Remove every hook, stop the reduction waiter and let the placement policy free what it holds (disk files).

        The engine cannot train afterwards."""
        if self._closed:
            return
        self._closed = True
        for handle in (*self._module_handles, *self._handles):
            handle.remove()
        self._module_handles.clear()
        self._handles.clear()
        self._compiled = ()
        self._waiter.close()
        self.placement.close()
        for comm in (self.comm, self.reduce_comm, *self._mesh_comms):
            comm.close()

    # -- which parameters the modules hold ----------------------------------------------
    def use_unsharded(self, *, stand_ins: bool = True) -> None:
        """Register the unsharded parameters in the modules (forward and backward run on them).

        Each takes its sharded parameter's ``requires_grad``, so freezing or unfreezing
        through ``model.parameters()`` between steps applies to the next forward.

        ``stand_ins=False`` registers every unsharded parameter whatever its chunk holds
        (``gathered_parameters`` points them at full copies of its own)."""
        if self._unsharded:
            return
        for chunk in self.chunks:
            for seg in chunk.segments:
                unsharded = chunk.slots[seg.slot].param
                if unsharded.requires_grad != seg.param.requires_grad:
                    unsharded.requires_grad_(seg.param.requires_grad)
                    self._hook_gradient(unsharded)
        for m, name, chunk, i in self._registrations:
            real = chunk.is_gathered or not stand_ins
            m._parameters[name] = chunk.slots[i].param if real else self._stand_ins[(chunk.index, i)]
        self._unsharded = True

    def _show(self, chunks: Sequence[Chunk]) -> None:
        """Inside forward and backward: register each chunk's real parameters if it is gathered, else stand-ins."""
        if not self._unsharded:
            return
        for chunk in chunks:
            gathered = chunk.is_gathered
            for m, name, i in self._by_chunk.get(chunk.index, ()):
                m._parameters[name] = chunk.slots[i].param if gathered else self._stand_ins[(chunk.index, i)]

    @engine_work
    def gather_on_demand(self, chunk: Chunk, slot: int) -> nn.Parameter:
        """A stand-in's values were read: gather its chunk now. See [Note: parameters used outside their module]."""
        name = chunk.slots[slot].name
        if not self._unsharded or self.state not in (TrainingState.FORWARD, TrainingState.BACKWARD):
            raise ZeroError(
                f"parameter {name!r} was read from a reference kept from inside a forward or backward, where it "
                "stood for a parameter that was not gathered; read model parameters again between steps "
                "(they are then the sharded parameters), or inside model.gathered_parameters()"
            )
        if chunk.index in self._reduced and self.state is TrainingState.BACKWARD:
            raise GradientLostError(
                f"parameter {name!r} was read in backward after its chunk {chunk.index} was reduced; its gradient "
                "would be lost. Read it inside the forward of the module that owns it"
            )
        if not chunk.is_gathered:
            self._gather([chunk])
        elif chunk.state is ChunkState.GATHERING:  # prefetched and still in flight: its parameters are empty until then
            chunk.wait()
        if self.state is TrainingState.BACKWARD:
            chunk.prepare_gradients()
        elif torch.is_grad_enabled():
            self._exposed.add(chunk.index)
        return chunk.slots[slot].param

    def use_sharded(self) -> None:
        """Register the sharded parameters in the modules: what the user and the optimizer see between steps."""
        if not self._unsharded:
            return
        for m, name, chunk, i in self._registrations:
            m._parameters[name] = chunk.segments[i].param
        self._unsharded = False

    # -- gather / release ----------------------------------------------------------
    def _set_state(self, state: TrainingState) -> None:
        self.state = state
        self.placement.on_transition(state)

    @engine_work
    def _gather(self, chunks: Sequence[Chunk]) -> None:
        self.placement.before_compute(chunks, backward=self.state is TrainingState.BACKWARD)
        with torch.profiler.record_function("ZeRO::all_gather"):
            self._scheduler.gather(chunks)
        self._show(chunks)

    @engine_work
    def _release(self, chunks: Sequence[Chunk], *, keep_copy: bool = False) -> None:
        done = [c for c in chunks if c.is_gathered and not c.persistent]
        for chunk in done:
            chunk.release(keep_copy=keep_copy)
        if done:
            self.placement.after_release(done)
            self._show(done)

    def _release_after_forward(self, chunks: Sequence[Chunk], *, for_backward: bool) -> None:
        """A forward is done with ``chunks``: each is resharded as its plan says when a backward will need it.

        ``reshard_after_forward=False`` keeps a trainable chunk gathered until its backward has reduced it; an
        int keeps a copy sharded inside groups of that size for the backward's gather; ``True`` frees it."""
        if not for_backward or self.config.stage != 3:
            self._release(chunks)
            return
        now, with_copy = [], []
        for chunk in chunks:
            policy = chunk.plan.reshard_after_forward if chunk.plan is not None else True
            if policy is False and chunk.requires_grad:
                continue
            (with_copy if policy is not True and chunk.requires_grad else now).append(chunk)
        self._release(now)
        self._release(with_copy, keep_copy=True)

    def _drop_forward_leftovers(self) -> None:
        """No backward will use what forwards kept for it (copies, chunks kept gathered): free them."""
        for chunk in self.chunks:
            chunk.copy = None
        self._release(self.chunks)

    # -- forward -------------------------------------------------------------------
    def pre_forward_root(self) -> None:
        """The wrapped model's forward begins."""
        if self.state is TrainingState.FORWARD or (self.state is TrainingState.BACKWARD and in_backward()):
            raise ZeroError(
                f"the wrapped model was called while the engine is in {self.state.value}; "
                "do not call the model from inside its own forward or from a backward hook"
            )
        self.settle()
        if self._gathered_context:
            raise ZeroError(
                "the model was called inside model.gathered_parameters(): the modules hold the context's full "
                "master copies, and a forward would replace them; run the forward after the context exits"
            )
        if self.state is TrainingState.IDLE and not any(c.has_unreduced_gradients for c in self.chunks):
            # a step's first forward (no no_sync() accumulation open): parameters may have been (un)frozen since
            self._reduce_order = [c for c in reversed(self.chunks) if c.requires_grad]
        self._regroup_if_compiled()  # a block compiled after shard() becomes one unit. See [Note: torch.compile]
        if self._forward_gathers:
            self._lockstep.begin("forward", self.step_count)
        self.use_unsharded()
        self._set_state(TrainingState.FORWARD)
        self._ran = {}
        self._scheduler.begin_pass(reverse=False)

    @engine_work  # its drain may serve other ranks' gathers: buffers made then must not be inference tensors
    def post_forward_root(self, outputs: Any) -> None:
        """The wrapped model's forward returned ``outputs``."""
        try:
            self._scheduler.drain()
            tensors = [t for t in tensors_of(outputs) if t.requires_grad and t.grad_fn is not None]
            graph = torch.is_grad_enabled() and bool(tensors) and bool(self._reduce_order)
            self._release_after_forward(self.chunks, for_backward=graph)
            if not graph:
                self._drop_forward_leftovers()
            if graph:
                reachable = reachable_params(tensors)
                for chunk in self._reduce_order:
                    ids = {id(s.param) for s in chunk.slots if id(s.param) in reachable}
                    self._expected.setdefault(chunk.index, set()).update(ids)
                torch.autograd.graph.register_multi_grad_hook(tensors, self._enter_backward, mode="any")
                self._graph_forwards += 1
        except BaseException:
            self.abort_forward()
            raise
        self._set_state(TrainingState.BACKWARD_PENDING if graph else TrainingState.IDLE)
        self.use_sharded()

    @engine_work
    def abort_forward(self) -> None:
        """The wrapped model's forward raised: free what it gathered so the next step starts clean.

        Gathers in flight are completed first (every rank issued them), never left to write later."""
        for chunk in self.chunks:
            if chunk.state is ChunkState.GATHERING:
                chunk.wait()
            chunk.copy = None
        self._release(self.chunks)
        self._set_state(TrainingState.IDLE)
        self.use_sharded()

    def settle(self) -> None:
        """Bring the engine back to IDLE from wherever an earlier exit left it. See [Note: step transactions].

        A backward that raised (autograd then drops the queued end-of-backward callback) is
        undone, and so is an optimizer step that raised after the engine prepared it; a forward
        whose backward never came (a validation forward with gradients
        enabled) needs nothing: its graph may still be backwarded later.
        """
        if self._step_open:
            self._abort_step()
        if self.state is TrainingState.BACKWARD and not in_backward():
            self._abort_backward()
        if self.state is TrainingState.BACKWARD_PENDING:
            self._drop_forward_leftovers()
            self._set_state(TrainingState.IDLE)

    def _abort_backward(self) -> None:
        """A backward raised: complete the collectives it started, then drop everything it produced.

        Reductions are completed (every rank that got as far issued them) and their results
        discarded, so the failed backward contributes nothing; gradients accumulated before
        it in a ``no_sync()`` window share its buffers and are discarded with it (warned).
        """
        accumulating = self._window_open
        error: BaseException | None = None
        try:
            for chunk in self.chunks:
                if chunk.state is ChunkState.GATHERING:
                    chunk.wait()
            self._flush_reductions()
            self._waiter.join()
        except BaseException as err:  # noqa: BLE001 - the state is reset first, then this is raised
            error = err
        finally:
            for chunk in self.chunks:
                chunk.discard_gradients()
                chunk.copy = None
            self._release(self.chunks)
            self._waiting, self._ready = {}, {}
            self._callback_queued = False
            self._set_state(TrainingState.IDLE)
            self.use_sharded()
        if accumulating:
            warnings.warn(
                "a backward raised inside a no_sync() accumulation: the gradients accumulated in that window were "
                "discarded along with the failed backward's; start the accumulation again", stacklevel=3)
        if error is not None:
            raise ZeroError(
                f"a backward raised earlier, and completing the collectives it had started failed: {error}. The "
                "ranks probably failed at different points of that backward; restart from the last checkpoint"
            ) from error


    def _pre_forward(self, chunks: tuple[Chunk, ...], module: nn.Module, args: Any) -> None:
        if self.state in (TrainingState.IDLE, TrainingState.BACKWARD_PENDING):
            if not in_backward():
                raise ZeroError(
                    f"{type(module).__name__} ran outside the wrapped model's forward, but its parameters are "
                    "sharded; call the model returned by zero_core.shard, not one of its submodules"
                )
            self._enter_backward()  # activation checkpointing recomputes before any other backward hook
        if self.state is TrainingState.BACKWARD:
            self.use_unsharded()  # a recomputation reads the modules' parameters
        self._gather(chunks)

    def _post_forward(self, chunks: tuple[Chunk, ...], module_id: int, module: nn.Module, args: Any, outputs: Any) -> None:
        if self.state is not TrainingState.FORWARD:
            return  # recomputation under activation checkpointing: keep gathered for the backward
        returned = {self._chunk_of[id(t)].index for t in tensors_of(outputs) if id(t) in self._chunk_of}
        if returned:  # a module returned one of its parameters: its caller reads it after this hook
            if torch.is_grad_enabled():
                self._exposed.update(returned)
            chunks = tuple(c for c in chunks if c.index not in returned)
        for chunk in chunks:
            ran = self._ran.setdefault(chunk.index, set())
            ran.add(module_id)
            if ran >= self._triggers[chunk.index]:
                self._ran[chunk.index] = set()
                self._release_after_forward([chunk], for_backward=torch.is_grad_enabled())
        if torch.is_grad_enabled():
            # Not on leaves (a module that returns one of its parameters): a hook on a leaf stays for good,
            # one more every step.
            tensors = [t for t in tensors_of(outputs) if t.requires_grad and t.grad_fn is not None]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, functools.partial(self._pre_backward, chunks), mode="any"
                )

    # -- backward ------------------------------------------------------------------
    def _enter_backward(self, *_: Any) -> None:
        if self.state is TrainingState.BACKWARD:
            return
        forwards, self._graph_forwards = self._graph_forwards, 0
        # a no_sync() window's gradients share this backward's buffers: a failure here loses them too
        self._window_open = any(c.has_unreduced_gradients for c in self._reduce_order)
        self._lockstep.begin(f"backward after {forwards} forward(s) with gradients", self.step_count)
        # The modules keep the sharded parameters in backward (autograd reads the unsharded ones it saved), so a
        # backward that raises leaves them as they are between steps; only a recomputation swaps (_pre_forward).
        self._set_state(TrainingState.BACKWARD)
        # a backward with no forward since the last one runs through a kept graph: it reaches what that one did
        expected = self._expected if forwards else self._last_expected
        self._last_expected, self._expected = expected, {}
        self._waiting = {index: set(ids) for index, ids in expected.items()}
        self._ready = {c.index: not self._waiting.get(c.index) for c in self._reduce_order}
        self._reduced = set()
        self._next_reduce = 0
        self._scheduler.begin_pass(reverse=True)
        exposed = [c for c in self.chunks if c.index in self._exposed and not c.persistent]
        if exposed:  # see [Note: parameters used outside their module]
            self._gather(exposed)
            for chunk in exposed:
                chunk.prepare_gradients()
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    @engine_work
    def _pre_backward(self, chunks: tuple[Chunk, ...], *_: Any) -> None:
        self._enter_backward()
        self._gather(chunks)
        for chunk in chunks:
            if chunk.index not in self._reduced and chunk.stage == 1:  # its kept buffer is there anyway
                chunk.prepare_gradients()  # stages 2 and 3: see [Note: gradient buffers on arrival]






    @engine_work
    def _finish_backward(self) -> None:
        """Queued on the autograd engine: runs once when the outermost backward finishes."""
        try:
            self._scheduler.drain()
            if self.sync_gradients:
                while self._next_reduce < len(self._reduce_order):
                    self._reduce(self._reduce_order[self._next_reduce])
                self._flush_reductions()
                self._waiter.join()
                self.placement.after_backward(self.chunks)
                self._publish_gradients()
            self._release(self.chunks)
            if self.sync_gradients:
                self._free_idle_buffers()
        except BaseException:
            # nothing of this backward reaches the optimizer, and nothing stays gathered or lent
            for chunk in self.chunks:
                chunk.discard_gradients()
            self._release(self.chunks)
            raise
        finally:
            for chunk in self.chunks:
                chunk.copy = None
            self._waiting = {}
            self._ready = {}
            self._callback_queued = False
            self._set_state(TrainingState.IDLE)
            self.use_sharded()

    # -- optimizer step ------------------------------------------------------------







    def _free_idle_buffers(self) -> None:
        """See [Note: no idle buffers between steps]."""
        if self.chunks:
            self.chunks[0].pool.clear()
        for comm in (self.comm, self.reduce_comm, *self._mesh_comms):
            comm.free()

    # -- inspection ----------------------------------------------------------------

    def require_idle(self, what: str, *, collective: bool = True) -> None:
        """Settle the engine for ``what`` between steps; a collective verb begins with a lockstep round."""
        if self._closed:
            raise ZeroError(f"{what} was called after model.close(); the engine no longer holds the model")
        if self.state is TrainingState.FORWARD or (self.state is TrainingState.BACKWARD and in_backward()):
            raise ZeroError(f"{what} needs an idle engine (between steps), but it is in {self.state.value}")
        self.settle()
        if collective:
            self._lockstep.begin(what, self.step_count)


