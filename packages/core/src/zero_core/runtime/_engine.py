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
backward dropped, and the chunks released (``_end_backward`` with ``BackwardEnd.RAISED``). Until then the modules
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
the next phase allocates them again: from memory the caching allocator holds on CUDA, from
fresh mappings on the host, faulted in 2 MiB at a time where the kernel allows (see [Note: huge
pages for the engine's host buffers] in ``zero_core.base._host_memory``).
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

[Note: backwards that accumulate nothing]
``torch.autograd.grad(loss, inputs)`` (a gradient penalty, a saliency map) runs the same
autograd graph as ``loss.backward()``, so the module hooks fire and the chunks are gathered as
modules need them, but no parameter's gradient is accumulated. When such a pass begins, the
engine asks the autograd engine whether it will run any trainable parameter's gradient
accumulator (``torch._C._will_engine_execute_node``; under ``autograd.grad`` that question is
refused for leaves, which answers it too); if not, the pass reduces nothing and prepares no
gradient buffer (its ``BackwardKind`` is CAPTURE, decided once in the pass's ``BackwardPass``).
With ``create_graph=True`` (CAPTURE_FOR_GRAPH) the gradients it returns have a graph of their
own that reads the gathered parameters when a later backward runs through it, and that graph
has no module hooks to gather again; so the chunks stay gathered (the state is
BACKWARD_PENDING) until that backward ends, and that backward releases nothing before its end
(its ``BackwardPass.holds_gathered``).
Stage 3 then holds the model gathered between the two passes, as stage 2 always does.

[Note: torch.compile]
Compiling a block (``block.compile()`` or ``torch.compile(block)``, before or after shard)
makes dynamo trace the forward hooks of the modules the block calls. Zero's hooks gather,
release and swap parameters, so dynamo skips them (``untraced``: see [Note: hooks dynamo skips without a wrapper]) and would run
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
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zero_core.base._accounting import engine_work
from zero_core.base._dtensor_ops import register_mesh_round
from zero_core.base._state import BackwardEnd, BackwardKind, ChunkState, TrainingState
from zero_core.base._trace import (
    POST_BACKWARD,
    POST_STEP,
    PRE_BACKWARD,
    PRE_STEP,
    ROOT_POST_FORWARD,
    ROOT_PRE_FORWARD,
    traced,
)
from zero_core.base.errors import CollectiveTimeoutError, GradientLostError, RanksOutOfStepError, ZeroError
from zero_core.chunks._group import GatherGroup
from zero_core.chunks.chunk import Chunk
from zero_core.comm._lockstep import Lockstep
from zero_core.interfaces._view import EngineView
from zero_core.runtime._autograd import in_backward, on_first_gradient, reachable_params, tensors_of
from zero_core.runtime._backward import BackwardPass
from zero_core.runtime._module_hooks import ModuleHooks
from zero_core.runtime._module_params import ModuleParameters
from zero_core.runtime._optimizer_bridge import OptimizerBridge, ZeroGradHook
from zero_core.runtime._reducer import GradientReducer
from zero_core.runtime._residency import Residency
from zero_core.runtime._step_state import GradientState

if TYPE_CHECKING:
    import pluggy

    from zero_core.comm.backend import CommBackend
    from zero_core.config.api import ZeroConfig
    from zero_core.interfaces.placement import PlacementPolicy
    from zero_core.interfaces.strategy import ShardStrategy

__all__ = ["Engine"]


class Engine:
    """Drives the chunks of one wrapped model through each step: the training state, the hooks, and the order
    across chunks. Its collaborators own the rest, each built with what it needs:

    - :class:`~zero_core.runtime._module_params.ModuleParameters` (``params``): what the modules hold, gradient hooks;
    - :class:`~zero_core.runtime._module_hooks.ModuleHooks`: which modules are units that gather which chunks,
      each a :class:`~zero_core.runtime._unit.Unit` whose hooks call back here for the training state;
    - :class:`~zero_core.runtime._residency.Residency` (``residency``): gathers, releases, buffers, the gather scheduler;
    - :class:`~zero_core.runtime._reducer.GradientReducer` (``reducer``): reductions and their bookkeeping;
    - :class:`~zero_core.runtime._optimizer_bridge.OptimizerBridge` (``bridge``): the step's own state;
    - the placement policy: where shards live.
    """

    def __init__(
        self,
        *,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        chunks: list[Chunk],
        comm: CommBackend,
        reduce_comm: CommBackend,
        mesh_comms: Sequence[CommBackend],
        groups: Sequence[GatherGroup],
        reducer: GradientReducer,
        bridge: OptimizerBridge,
        strategy: ShardStrategy,
        placement: PlacementPolicy,
        config: ZeroConfig,
        plugin_hooks: pluggy.HookRelay,
        device: torch.device,
    ) -> None:
        # What was built at setup; fixed for the engine's life.
        self.module = module
        # Every optimizer passed to shard(); ``optimizer`` is the first (the only one, usually). See [Note: several
        # optimizers] in zero_core._shard.
        self.optimizers = tuple(optimizers)
        self.optimizer = self.optimizers[0]
        self.chunks = chunks
        self.comm = comm
        # Reduce-scatters run on their own process group, asynchronously: they are ordered by
        # [Note: gradient reduction order] while all-gathers follow [Note: agreeing on all-gathers],
        # and a rank blocked on one stream must never hold up the other. The chunks' own groups beyond
        # these two serve meshes (see [Note: one group per direction of traffic]).
        self.reduce_comm = reduce_comm
        self._comms = (comm, reduce_comm, *mesh_comms)
        self.reducer = reducer
        self.bridge = bridge
        self.strategy = strategy
        self.placement = placement
        # See [Note: a unit whose chunks are ready] in zero_core.runtime._unit: a policy that watches computes sees
        # every unit's.
        self.computes_watched = placement.watches_computes
        # See [Note: gradients handed over as they land] in zero_core.chunks._chunk_grads.
        # See [Note: gradients handed over as autograd made them] there.
        for chunk in chunks:
            chunk.grads.hands_early = not placement.moves_after_backward
            chunk.grads.may_hand_directly = chunk.grads.hands_early and not placement.watches_computes
        self.config = config
        # The plugin manager's hook relay (pluggy): "hooks" alone in this module are torch's module, autograd
        # and optimizer hooks.
        self.plugin_hooks = plugin_hooks
        self.device = device
        self.params = ModuleParameters(module, chunks, self.gather_on_demand, self._gradient_hook)
        self._module_hooks = ModuleHooks(module, self.params.registrations, chunks, self)
        # Stages 1 and 2 never gather during a pass, so they need no agreement rounds either.
        self._forward_gathers = any(not c.persistent for c in chunks)
        self.groups = list(groups)
        # Every communicating phase begins with a round that checks the ranks are in the same one, and every
        # agreement inside a phase is tagged the same way (see [Note: lockstep rounds]).
        self._lockstep = Lockstep(comm, enabled=not config.static_graph)
        agree = functools.partial(self._lockstep.min, "agreement on the next all-gather")
        self.residency = Residency(chunks, self.groups, comm=comm, comms=self._comms, placement=placement,
                                   params=self.params, stage=config.stage,
                                   agree=agree if not config.static_graph and self._forward_gathers else None)
        # Chunks whose parameters a forward with a graph read outside their modules: gathered when backward begins.
        self._exposed: set[int] = set()
        # Forwards that built a graph since the last backward: ranks must agree on it when a backward begins,
        # which catches a rank that skipped a backward even where forwards do not communicate (stages 1, 2).
        self._graph_forwards = 0
        # Forwards with gradients that raised since the last backward: a rank that skipped its batch after an
        # exception must not pair its next backward with a peer's backward of the batch before (see settle's Note).
        self._raised_forwards = 0
        # Per-step state, reset by the transitions below.
        self.state = TrainingState.IDLE
        # The running backward (made when it begins, dropped at its end: _end_backward); outside a backward, None.
        self.backward_pass: BackwardPass | None = None
        # A CAPTURE_FOR_GRAPH backward that finished: its gradients' graph reads the chunks it left gathered
        # (BACKWARD_PENDING), so the next backward releases nothing before its end. See [Note: backwards that
        # accumulate nothing].
        self._gathered_for_graph: BackwardPass | None = None
        self.step_count = 0

        # What the step's round compares beyond the phase: see [Note: what a step round agrees on].
        self._gradient_state = GradientState(lambda: self.reducer.order, active=self._lockstep.enabled)

        self._module_hooks.install()
        # zero_grad() drops what a no_sync() window accumulated, as in DDP; refused only during backward
        self._handles: list[Any] = self._hook_optimizers(reducer)
        self.params.use_sharded()
        # torch's clip over the sharded parameters' meshes begins with a round: see [Note: a round before torch's clip]
        register_mesh_round({id(m): m for c in chunks for m in (c.mesh, *c.grid_meshes.values()) if m is not None}.values(),
                            self.collective_round)
        # A user who never calls close() still gets it before the interpreter tears torch down: process
        # groups and work handles freed that late can abort the exit ("terminate called without an active exception").
        self._closed = False
        ref = weakref.ref(self)
        atexit.register(lambda: None if (engine := ref()) is None else engine.close())

    def _hook_optimizers(self, reducer: GradientReducer) -> list[Any]:
        """Each optimizer's step and zero_grad hooks; ``zero_grad_hook`` is what ``model.zero_grad()`` runs."""
        settle = functools.partial(self.settle, "zero_grad()", in_forward=True)
        handles: list[Any] = []
        for optimizer in self.optimizers:
            clears = self.bridge.chunks_cleared_by(optimizer, self.chunks)
            hook = ZeroGradHook(optimizer, settle=settle, discard=functools.partial(self._discard_for_zero_grad, chunks=clears))
            pre, post = optimizer.register_step_pre_hook(self._before_step), optimizer.register_step_post_hook(self._after_step)
            self.bridge.hooked(optimizer, pre_hook=pre.id, post_hook=post.id)
            handles += [pre, post, hook]
        self.zero_grad_hook = handles[2] if len(self.optimizers) == 1 else \
            ZeroGradHook(None, settle=settle, discard=self._discard_for_zero_grad)
        return handles

    def close(self) -> None:
        """Remove every hook, stop the reduction waiter and let the placement policy free what it holds (disk files).

        The engine cannot train afterwards."""
        if self._closed:
            return
        self._closed = True
        self._module_hooks.remove()
        self.params.remove_hooks()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.bridge.remove()
        self.reducer.close()
        self.placement.close()
        for comm in self._comms:
            comm.close()

    def _set_state(self, state: TrainingState) -> None:
        self.state = state
        self.placement.on_transition(state)

    # -- forward -------------------------------------------------------------------
    @traced(ROOT_PRE_FORWARD)
    def pre_forward_root(self) -> None:
        """The wrapped model's forward begins."""
        if self.state is TrainingState.FORWARD or (self.state is TrainingState.BACKWARD and in_backward()):
            raise ZeroError(
                f"the wrapped model was called while the engine is in {self.state.value}; "
                "do not call the model from inside its own forward or from a backward hook"
            )
        self.settle()
        if self.params.full_copies:
            raise ZeroError(
                "the model was called inside model.gathered_parameters(): the modules hold the context's full "
                "master copies, and a forward would replace them; run the forward after the context exits"
            )
        if self.state is TrainingState.IDLE:
            self.reducer.reorder()  # parameters may have been (un)frozen since the last step
        for chunk in self.chunks:  # see [Note: gradient wrappers lent again] in zero_core.chunks._chunk_grads
            chunk.grads.release_idle()
        self._module_hooks.regroup_if_compiled()  # a block compiled after shard() becomes one unit
        # see [Note: writes outside the optimizer] in zero_core.runtime._residency
        written = self.residency.written()
        if self._forward_gathers or written:
            what = "forward" if self._forward_gathers else "forward after parameters were written outside the optimizer"
            if self._lockstep.begin(what, self.step_count, flag=written):
                self.residency.refresh()
        self.params.use_unsharded()
        self._set_state(TrainingState.FORWARD)
        self._module_hooks.begin_forward()
        self.residency.scheduler.begin_pass(reverse=False)

    @traced(ROOT_POST_FORWARD)
    @engine_work  # its drain may serve other ranks' gathers: buffers made then must not be inference tensors
    def post_forward_root(self, outputs: Any) -> None:
        """The wrapped model's forward returned ``outputs``."""
        try:
            self.residency.scheduler.drain()
            tensors = [t for t in tensors_of(outputs) if t.requires_grad and t.grad_fn is not None]
            graph = torch.is_grad_enabled() and bool(tensors) and bool(self.reducer.order)
            self._module_hooks.forward_returned()
            self.residency.release_after_forward(self.chunks, for_backward=graph)
            if not graph:
                self.residency.drop_leftovers()
                self._module_hooks.units_idle()
            if graph:
                self.reducer.expect(reachable_params(tensors))
                on_first_gradient(tensors, self.enter_backward)
                self._graph_forwards += 1
        except BaseException as error:
            self.abort_forward(error)
            raise
        self._set_state(TrainingState.BACKWARD_PENDING if graph else TrainingState.IDLE)
        self.params.use_sharded()

    @engine_work
    def abort_forward(self, error: BaseException | None = None) -> None:
        """The wrapped model's forward raised ``error``: free what it gathered so the next step starts clean.

        The pass's gathers are finished first, as a pass that ended would finish them (see [Note: a forward that
        raises finishes its gathers]); gathers in flight are completed (every rank issued them), never left to
        write later."""
        scheduler = self.residency.scheduler
        if scheduler.open and isinstance(error, Exception) and not isinstance(error, (CollectiveTimeoutError,
                                                                                       RanksOutOfStepError)):
            # [Note: a forward that raises finishes its gathers]
            # Its peers may still be inside this forward: replaying a repeated gather sequence (all-gathers with no
            # agreement, which pair with whatever this rank issues next) or agreeing on the next all-gather. So this
            # rank finishes its pass the way a rank whose forward ended early does: it issues the rest of the
            # replayed sequence and serves its peers' proposals until every rank is done (the sequence is the same
            # on every rank, and pairing is by order, so this pairs wherever the peers are). A rank that then skips
            # its batch meets its peers' next phase with a lockstep round and every rank raises RanksOutOfStepError;
            # ranks that all raised finish together. A collective that failed itself is not followed by more, and an
            # interrupt (KeyboardInterrupt) does not wait for the peers.
            try:
                scheduler.drain()
            except Exception as failed:  # noqa: BLE001 - the forward's own error is the one to raise
                warnings.warn(f"a forward raised, and finishing its all-gathers with the other ranks failed too "
                              f"({type(failed).__name__}: {failed}); the ranks are probably out of step",
                              stacklevel=2)
        self.residency.drop_leftovers(wait=True)
        self._set_state(TrainingState.IDLE)
        self._module_hooks.units_idle()
        self.params.use_sharded()
        if torch.is_grad_enabled():
            self._raised_forwards += 1

    def expose(self, chunk_indices: set[int]) -> None:
        """A unit's module returned parameters of these chunks in a forward with a graph: its caller reads them
        outside the module, so they are gathered when the backward begins (see [Note: parameters used outside
        their module])."""
        self._exposed.update(chunk_indices)

    @engine_work
    def gather_on_demand(self, chunk: Chunk, slot: int) -> nn.Parameter:
        """A stand-in's values were read: gather its chunk now. See [Note: parameters used outside their module]."""
        name = chunk.slots[slot].name
        if not self.params.unsharded or self.state not in (TrainingState.FORWARD, TrainingState.BACKWARD):
            raise ZeroError(
                f"parameter {name!r} was read from a reference kept from inside a forward or backward, where it "
                "stood for a parameter that was not gathered; read model parameters again between steps "
                "(they are then the sharded parameters), or inside model.gathered_parameters()"
            )
        if self.reducer.is_reduced(chunk) and self.state is TrainingState.BACKWARD:
            raise GradientLostError(
                f"parameter {name!r} was read in backward after its chunk {chunk.index} was reduced; its gradient "
                "would be lost. Read it inside the forward of the module that owns it"
            )
        if not chunk.is_gathered:
            self.residency.gather([chunk], backward=self.state is TrainingState.BACKWARD)
        elif chunk.state is ChunkState.GATHERING:  # prefetched and still in flight: its parameters are empty until then
            chunk.wait()
        if self.state is TrainingState.BACKWARD:
            chunk.grads.prepare()
        elif torch.is_grad_enabled():
            self._exposed.add(chunk.index)
        return chunk.slots[slot].param

    # -- backward ------------------------------------------------------------------
    def enter_backward(self, *_: Any) -> None:
        """A backward reaches the model: the root's outputs got a gradient, a gradient arrived, or a unit's hook
        ran (on its outputs, or a recomputation's pre-hook). The first of them begins the backward."""
        if self.state is not TrainingState.BACKWARD:
            self._begin_backward()

    @traced(PRE_BACKWARD)
    @engine_work
    def _begin_backward(self) -> None:
        """A backward begins: the lockstep round, what it does with gradients (a ``BackwardPass``), its gathers'
        pass, the chunks read outside their modules, and its one end queued on the autograd engine."""
        forwards, self._graph_forwards = self._graph_forwards, 0
        # a no_sync() window's gradients share this backward's buffers: a failure here loses them too
        window_open = self.reducer.has_unreduced
        raised, self._raised_forwards = self._raised_forwards, 0
        # inside no_sync() or not is part of the phase: a rank accumulating while its peers reduce would leave
        # their reduce-scatters unpaired (an extra micro-batch under no_sync() on one rank)
        self._lockstep.begin(f"backward after {forwards} forward(s) with gradients"
                             + (f" and {raised} that raised" if raised else "")
                             + ("" if self.reducer.sync else " inside no_sync()"), self.step_count)
        # What this backward does with gradients is decided now, once: see [Note: backwards that accumulate nothing].
        kind = BackwardKind.REDUCE if self.reducer.accumulates() else \
            BackwardKind.CAPTURE_FOR_GRAPH if torch.is_grad_enabled() else BackwardKind.CAPTURE
        backward = BackwardPass(kind, window_open=window_open, holds_gathered=self._gathered_for_graph is not None)
        self._gathered_for_graph = None  # held by this backward now, until its end
        self.backward_pass = backward
        # The modules keep the sharded parameters in backward (autograd reads the unsharded ones it saved), so a
        # backward that raises leaves them as they are between steps; only a recomputation swaps (Unit.before_forward).
        self._set_state(TrainingState.BACKWARD)
        self._module_hooks.backward_began()
        self.bridge.backward_began()
        self.reducer.begin(forwards=forwards)
        self.residency.scheduler.begin_pass(reverse=True)
        exposed = [c for c in self.chunks if c.index in self._exposed and not c.persistent]
        if exposed:  # see [Note: parameters used outside their module]
            self.residency.gather(exposed, backward=True)
            for chunk in exposed:
                if backward.accumulates:
                    chunk.grads.prepare()
        # the one end of this backward when it finishes; one that raises is ended by settle (autograd drops this)
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _gradient_hook(self, param: torch.Tensor) -> Callable[[torch.Tensor], None]:
        """The hook autograd calls after it accumulated ``param``'s gradient (an unsharded parameter's).

        [Note: one call per gradient]
        Autograd calls a hook for every parameter in every backward. So each parameter's hook is made once, when
        it is first watched, with what the arrival needs bound in (its chunk, its slot, its gather group, its
        id), and an arrival costs the hook's call and the reducer's bookkeeping: no lookup of the parameter's
        place per gradient (see benchmarks/results/cpu-2026-12-04-host-light-9/).

        Not engine work as a whole: most gradients only tick the reducer's bookkeeping (autograd added them in
        place into the chunk's buffer, or at one rank left them where it made them: see [Note: gradients handed
        over as autograd made them]); what allocates (the chunk's buffer on its first gradient,
        ``ChunkGradients.adopt``; the reductions; the hand-over) is."""
        reducer = self.reducer
        chunk, slot, group = reducer.where(param)
        key, backward = id(param), TrainingState.BACKWARD

        def accumulated(_: torch.Tensor) -> None:
            if self.state is not backward:  # once per backward, not per parameter (nothing to do after)
                self._begin_backward()
            if reducer.in_flight:  # see [Note: gradients handed over as they land] in zero_core.chunks._chunk_grads
                self._hand_over_landed()
            if reducer.accumulated_at(chunk, slot, group, key) and reducer.sync:
                self._launch_ready()

        return accumulated

    @engine_work
    def _hand_over_landed(self) -> None:
        self.reducer.hand_over_landed()

    @engine_work
    def _launch_ready(self) -> None:
        """The next group of the reducer's order is ready: launch it and every ready one after it."""
        backward = self.backward_pass
        for chunk in self.reducer.launch_ready(self.bridge.loss_scale):
            # a kept chunk (persistent) is never released: no call for it (this runs for every chunk in every backward)
            if not chunk.persistent and (backward is None or not backward.holds_gathered):
                self.residency.release([chunk])
            self._module_hooks.chunk_reduced(chunk)

    @traced(POST_BACKWARD)
    def _finish_backward(self) -> None:
        """Queued on the autograd engine when a backward begins: runs once when the outermost backward finishes."""
        self._end_backward(BackwardEnd.FINISHED)

    @engine_work
    def _end_backward(self, ended: BackwardEnd) -> None:
        """The one end of every backward, whichever way it ended. See [Note: the end of a backward].

        [Note: the end of a backward]
        A backward ends in one of two ways (``BackwardEnd``): the autograd engine runs the callback queued when it
        began (FINISHED), or the backward raised, autograd dropped that callback, and the next entry point's settle
        finds the state still BACKWARD (RAISED). Both run this sequence:

        1. the pass's all-gathers are finished with the other ranks (the scheduler's drain; after a raise, the
           gathers still in flight are completed first);
        2. a backward that reduces (REDUCE, outside ``no_sync()``) launches the reductions not launched yet, in
           the reducer's order, and completes them all; FINISHED: each is released as it is launched (unless the
           backward holds the chunks gathered), the placement policy is told, and the gradients are handed over;
           RAISED: only the ranks' agreement on which parameters got a gradient is joined (see [Note: a backward
           that raises finishes its collectives]);
        3. FINISHED: every chunk is released, unless a CAPTURE_FOR_GRAPH backward leaves them gathered for the
           backward through its gradients' graph (BACKWARD_PENDING), and a reducing backward frees the idle
           buffers (see [Note: no idle buffers between steps]);
        4. whatever happened: a backward that raised, or whose end failed, is undone (every gradient it produced
           discarded, every chunk released), the copies kept for it are dropped, the reducer's groups go IDLE,
           the units IDLE, the modules hold the sharded parameters, and the engine leaves BACKWARD.

        [Note: a backward that raises finishes its collectives]
        Its peers may still be in that backward, all-gathering (stage 3) and reduce-scattering chunk after chunk.
        Those collectives pair by order, so this rank issues what a backward that ended here would have: it finishes
        the gather pass (serving its peers until every rank is done), launches the reductions of the chunks not
        reduced yet, in the reducer's order (with the gradients it has, zeros for the rest), and joins the
        agreement on which parameters got gradients. All of it is then discarded, as before: nothing of this
        backward reaches the optimizer. The peers' gradients are wrong (this rank's part is partial), but every
        rank's next lockstep round (this rank's next forward or backward, the peers' ``optimizer.step()``) differs,
        so every rank raises RanksOutOfStepError before any step; ranks that all raised finish together and go
        on in step."""
        backward = self.backward_pass
        assert backward is not None, "the state is BACKWARD only with a running backward"
        finished = ended is BackwardEnd.FINISHED
        reduces = self.reducer.sync and backward.accumulates
        keep = finished and backward.keeps_gathered
        undo = not finished
        try:
            if not finished:
                for chunk in self.chunks:
                    if chunk.state is ChunkState.GATHERING:
                        chunk.wait()
            if self.residency.scheduler.open:
                self.residency.scheduler.drain()
            if reduces:
                for chunk in self.reducer.launch_rest(self.bridge.loss_scale):
                    if finished and not backward.holds_gathered:
                        self.residency.release([chunk])
                    self._module_hooks.chunk_reduced(chunk)
                self.reducer.complete()
                if finished:
                    self.placement.after_backward(self.chunks)
                self.reducer.hand_over(apply=finished)
                if finished:
                    self._gradient_state.mark(handed_over=True)
            if finished:
                if not keep:
                    self.residency.release(self.chunks)
                if reduces:
                    self.residency.free_idle_buffers()
            else:
                self.reducer.complete()  # reductions launched before the raise, whatever this backward was
        except BaseException:
            undo = True  # nothing of this backward reaches the optimizer, and nothing stays gathered or lent
            raise
        finally:
            if undo:
                for chunk in self.chunks:
                    chunk.grads.discard()
                self.residency.release(self.chunks)
            for chunk in self.chunks:
                if not chunk.persistent:  # a kept chunk is never sharded, so never holds a post-forward copy
                    chunk.drop_post_forward_copy()
            self.reducer.end()
            self.backward_pass = None
            self._gathered_for_graph = backward if keep else None
            self._set_state(TrainingState.BACKWARD_PENDING if keep else TrainingState.IDLE)
            self._module_hooks.units_idle()
            self.params.use_sharded()

    # -- leaving a step by any way ----------------------------------------------------
    def settle(self, what: str | None = None, *, collective: bool = False, in_forward: bool = False) -> None:
        """Bring the engine back to IDLE from wherever an earlier exit left it. See [Note: step transactions].

        ``what`` names a user's call that needs an idle engine (between steps): it is refused after
        :meth:`close` and while a backward (or, unless ``in_forward``, a forward) runs; ``collective``
        (a verb every rank calls) begins with a lockstep round.

        An optimizer step that raised after the engine prepared it is closed; a backward that raised
        (autograd then drops the queued end-of-backward callback) is undone: the collectives it started
        complete (every rank that got as far issued them) and everything it produced is dropped, so it
        contributes nothing (gradients accumulated before it in a ``no_sync()`` window share its buffers
        and go with it, warned); a forward whose backward never came (a validation forward with gradients
        enabled) needs nothing: its graph may still be backwarded later.
        """
        if what is not None:
            if self._closed:
                raise ZeroError(f"{what} was called after model.close(); the engine no longer holds the model")
            if (self.state is TrainingState.FORWARD and not in_forward) or (
                    self.state is TrainingState.BACKWARD and in_backward()):
                raise ZeroError(f"{what} needs an idle engine (between steps), but it is in {self.state.value}")
        if self.bridge.step_open:
            self.bridge.abort()
            self.residency.after_step(refresh_kept=True)
        if self.state is TrainingState.BACKWARD and not in_backward():
            accumulating = self.backward_pass is not None and self.backward_pass.window_open
            try:
                self._end_backward(BackwardEnd.RAISED)
            except BaseException as error:  # noqa: BLE001 - the state was reset by _end_backward; this is raised after
                failed: BaseException | None = error
            else:
                failed = None
            if accumulating:
                warnings.warn(
                    "a backward raised inside a no_sync() accumulation: the gradients accumulated in that window "
                    "were discarded along with the failed backward's; start the accumulation again", stacklevel=2)
            if failed is not None:
                raise ZeroError(
                    f"a backward raised earlier, and completing the collectives it had started failed: {failed}. The "
                    "ranks probably failed at different points of that backward; restart from the last checkpoint"
                ) from failed
        if self.state is TrainingState.BACKWARD_PENDING:
            self.residency.drop_leftovers()
            self._set_state(TrainingState.IDLE)
            self._module_hooks.units_idle()
            self._gathered_for_graph = None
        if collective and self._lockstep.begin(what or "a collective call", self.step_count, flag=self.residency.written()):
            self.residency.refresh()  # a verb reads or writes kept buffers: see [Note: writes outside the optimizer]

    def collective_round(self, what: str) -> None:
        """torch is about to reduce over the sharded parameters' mesh (see [Note: a round before torch's clip] in
        ``zero_core.base._dtensor_ops``): between steps, every rank must be doing the same."""
        if self._closed:
            return
        self.settle()
        if self.state is TrainingState.IDLE:
            self._lockstep.begin(what, self.step_count)

    def _discard_for_zero_grad(self, *, set_to_none: bool = True, chunks: Sequence[Chunk] | None = None) -> None:
        """``zero_grad()`` runs (after settling): see [Note: what a step round agrees on], then the no_sync() window
        (of ``chunks`` only: those one of several optimizers clears)."""
        self._gradient_state.cleared()
        self.reducer.discard_unreduced(set_to_none=set_to_none, chunks=chunks)

    # -- the optimizer's hooks ------------------------------------------------------------
    @traced(PRE_STEP)
    @engine_work
    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.bridge.in_substep:
            return
        if self.state is TrainingState.BACKWARD and in_backward():
            raise ZeroError("optimizer.step() was called during backward; call it after loss.backward() returns")
        self.settle()
        if not self.reducer.sync:
            raise ZeroError(
                "optimizer.step() was called inside model.no_sync(): this backward's gradients were not reduced. "
                "Run the last micro-batch's forward and backward outside no_sync(), then step"
            )
        if self.reducer.has_unreduced:
            raise ZeroError(
                "optimizer.step() after a backward inside model.no_sync(): the accumulated gradients were never "
                "reduced. Run the last micro-batch's forward and backward outside no_sync(), then step"
            )
        self._lockstep.begin(self._step_name(optimizer), self.step_count, state=self._gradient_state.state,
                             explain=self._gradient_state.explain)
        self.bridge.begin(optimizer)
        self.placement.before_step(self.chunks)
        self.bridge.step_locally(args, kwargs)

    @traced(POST_STEP)
    @engine_work
    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.bridge.in_substep:
            return
        skipped = self.bridge.end()
        self._gradient_state.mark()  # a step may replace gradients (whole-tensor steps): the engine's, on every rank
        self.residency.after_step(refresh_kept=not skipped, chunks=self.bridge.chunks_stepped_by(optimizer))
        self.reducer.forget_graphs()  # graphs built before the step cannot be backwarded after it
        self._exposed = set()
        self.step_count += 1
        finished = self.comm.stats.end_step()
        view = EngineView(step=self.step_count, config=self.config, rank=self.comm.rank, world_size=self.comm.world_size,
                          chunks=tuple(self.chunks), comm_stats=self.comm.stats, _optimizer=self.optimizers)
        self.plugin_hooks.zero_after_step(engine=view, stats=self.comm.stats.summary(finished))

    def _step_name(self, optimizer: torch.optim.Optimizer) -> str:
        """What a step's lockstep round is named: which optimizer, when there are several (ranks stepping different
        ones raise RanksOutOfStepError instead of exchanging mismatched pieces)."""
        if len(self.optimizers) == 1:
            return "optimizer.step()"
        return f"optimizer.step() of optimizer {self.bridge.index_of(optimizer)} ({type(optimizer).__name__})"
