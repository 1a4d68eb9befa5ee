"""The optimizer's step on the sharded parameters' local tensors instead of their DTensors.

[Note: the step on local tensors]
Under a process group zero's sharded parameters are DTensors, and every tensor op of the user's
``optimizer.step()`` on them goes through DTensor's Python dispatch: on the bench's 48-block model
(195 parameters, AdamW with foreach) the step costs 12,134 Python calls against 5,381 on plain tensors,
about twice the step's host time. For an element-wise optimizer (each value's update reads only that
value's parameter, gradient and states) stepping the local tensors is the same arithmetic on the same
storage: the DTensor ops it replaces run exactly these local ops, so the result is bitwise the same.

So for torch's element-wise optimizers (:data:`ELEMENTWISE`, by exact type: a subclass may read a
parameter whole), a step that is not a whole-tensor step (``zero_core.runtime._whole_step``) and that
passes no closure runs its body with, for the length of the body only,

- each param group's ``params`` list holding each DTensor parameter's local tensor (other tensors as
  they are), each local's ``.grad`` its DTensor gradient's local tensor;
- ``optimizer.state`` a stand-in keyed by those locals, whose per-parameter dicts hold the states'
  local tensors (states are updated in place, so the DTensor states see the new values).

After the body (returned or raised) the groups and the state come back; a state the body created
or replaced (the first step's, SGD's momentum) is wrapped as a DTensor with its parameter's sharding,
as torch's ``zeros_like`` of the DTensor parameter would have made it, except the per-parameter
scalars (:data:`SCALAR_STATES`: ``step``, NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``), which
are plain tensors in the DTensor step too.

A body that raises leaves no local in sight either: zero wraps the optimizer's ``step`` (as it wraps
``zero_grad``), and the wrapper puts the DTensors back before the exception reaches the caller.

Hooks see DTensors, as without zero: the swap happens in zero's step pre-hook, which must be the
optimizer's last pre-hook, and ends in its post-hook, which must be its first post-hook. A step where
another hook sits inside that window (the user registered a pre-hook after ``shard()``, or a post-hook
before it), or where a gradient is not a DTensor of its parameter's placements, steps the DTensors as
before: slower, the same result.
"""

from __future__ import annotations

import operator
import types
from collections import defaultdict, deque
from itertools import chain, repeat
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from zero_core.chunks._chunk_layout import dtensor

__all__ = ["ELEMENTWISE", "SCALAR_STATES", "LocalStep"]

ELEMENTWISE: frozenset[type] = frozenset({
    torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.ASGD,
    torch.optim.Rprop,
})
"""torch's optimizers whose update of each value reads only that value's parameter, gradient and states."""

SCALAR_STATES = frozenset({"step", "mu_product", "eta", "mu"})
"""Per-parameter states of :data:`ELEMENTWISE` that are plain 0-d tensors even for a DTensor parameter."""


class LocalStep:
    """Swaps one optimizer's DTensor parameters and states for their local tensors around the body of its step."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, pre_hook: int, post_hook: int) -> None:
        self.optimizer = optimizer
        # the ids of zero's step hooks on this optimizer (see the Note: the window between them is the body)
        self._pre, self._post = pre_hook, post_hook
        self._eligible = type(optimizer) in ELEMENTWISE
        # Whether any parameter is a DTensor, for the groups' lists as they were when asked (a list replaced or grown
        # is asked again): without a process group nothing is swapped and the step pays one comparison.
        self._checked: tuple[tuple[int, int], ...] | None = None
        self._any_dtensor = False
        # Set between begin() and end(): the real state and groups' lists, and each swapped (parameter, local).
        self._state: Any = None
        self._groups: list[list[Any]] | None = None
        self._pairs: list[tuple[DTensor, torch.Tensor]] = []
        self._shadow: dict[torch.Tensor, dict[str, Any]] = {}
        # id of each swapped local -> its parameter and the parameter's real state dict when the body began (None:
        # it had none), so that end() finds them without hashing a tensor (torch's ``Tensor.__hash__`` is a Python
        # call, twice per parameter per step otherwise)
        self._of_local: dict[int, tuple[DTensor, dict[str, Any] | None, tuple[Any, ...] | None]] = {}
        # id of a DTensor parameter -> its real state dict, that dict's keys and values, and the shadow dict made
        # from them: see [Note: shadow states kept across steps]
        self._shadows: dict[int, tuple[dict[str, Any], tuple[str, ...], tuple[Any, ...], dict[str, Any],
                                       tuple[Any, ...]]] = {}

        # The step's swap as the last steady step made it, for the next to check and copy: see [Note: the steady step].
        self._plan: _Plan | None = None
        self._planned = False  # whether the running body's swap is the plan's (end() then checks it the same way)

        self._installed: Any = None
        if self._eligible:
            inner = optimizer.step  # the bound step, or whatever wrapped it before shard() (an LR scheduler's)

            def step(_optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
                try:
                    return inner(*args, **kwargs)
                finally:
                    self.end()  # only a body that raised left the locals in: the post-hook put them back otherwise

            # a bound method, as torch's LR schedulers expect of ``optimizer.step`` (they wrap its ``__func__``)
            self._installed = optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]

    def remove(self) -> None:
        """Take the step wrapper away, unless something wrapped it since (it then only calls through)."""
        if self._installed is not None and self.optimizer.__dict__.get("step") is self._installed:
            del self.optimizer.__dict__["step"]
        self._installed = None

    @property
    def active(self) -> bool:
        return self._groups is not None

    def begin(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Swap the locals in, if this step may run on them (see the Note); whether it does."""
        opt = self.optimizer
        # torch's hook gets the step's own arguments, the optimizer first: a closure runs a forward and a backward
        # inside the body, which must see the model's parameters as they are
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if not self._eligible or closure is not None or not self._has_dtensor():
            return False
        if next(reversed(opt._optimizer_step_pre_hooks)) != self._pre or \
                next(iter(opt._optimizer_step_post_hooks)) != self._post:
            return False
        groups = opt.param_groups
        if any(g.get("differentiable") for g in groups):
            return False
        state = opt.state
        plan = self._plan
        if plan is not None and plan.fits(groups, state):
            self._planned = True
            self._state, self._pairs, self._shadow, self._of_local = state, plan.pairs, defaultdict(dict, plan.shadow), \
                plan.of_local
            self._groups = [group["params"] for group in groups]
            for group, planned in zip(groups, plan.lists):
                group["params"] = list(planned)
            opt.state = self._shadow
            return True
        self._plan, self._planned = None, False
        shadows, is_ = self._shadows, operator.is_
        # the real state's dicts by their parameter's id: one pass that hashes no tensor (see ``_of_local``)
        state_of = {id(key): value for key, value in state.items()}
        shadow: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        pairs: list[tuple[DTensor, torch.Tensor]] = []
        of_local: dict[int, tuple[DTensor, dict[str, Any] | None, tuple[Any, ...] | None]] = {}
        lists: list[list[Any]] = []
        # whether this step is one the next may copy (see [Note: the steady step]): every parameter a DTensor with a
        # DTensor gradient of its very spec, and a kept shadow state
        steady = True
        for group in groups:
            swapped = []
            for p in group["params"]:
                if not isinstance(p, DTensor):
                    steady = False
                    found = state_of.get(id(p))
                    if found is not None:
                        shadow[p] = found  # the same dict: what the body writes lands in the real state
                    swapped.append(p)
                    continue
                grad = p.grad
                if grad is not None and not (isinstance(grad, DTensor) and (
                        grad._spec is p._spec or grad._spec.placements == p._spec.placements)):
                    self._drop_grads(pairs)
                    return False  # the DTensor step decides what such a gradient means (or refuses it)
                local = p._local_tensor
                if grad is not None:
                    local.grad = grad._local_tensor
                    steady = steady and grad._spec is p._spec
                else:
                    steady = False
                found = state_of.get(id(p))
                if found:
                    # [Note: shadow states kept across steps]
                    # An element-wise step updates its states in place, so after the first step each parameter's
                    # real state dict holds the same tensors step after step, and its shadow would be rebuilt the
                    # same (about 1.5 us a parameter). So the shadow is kept with the real dict's keys and values
                    # it was made from, and used again while those are the same objects: anything that replaced,
                    # added or dropped a state since (load_state_dict, a user, the body through end()) makes it anew.
                    # end() skips a shadow whose values are still the ones it was made with, the same way.
                    kept = shadows.get(id(p))
                    if kept is None or kept[0] is not found or kept[1] != tuple(found) or \
                            not all(map(is_, found.values(), kept[2])):
                        made = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in found.items()}
                        kept = shadows[id(p)] = (found, tuple(found), tuple(found.values()), made,
                                                 tuple(made.values()))
                        steady = False
                    shadow[local] = kept[3]
                    of_local[id(local)] = (p, found, kept[4])
                else:
                    shadows.pop(id(p), None)  # its states were dropped: hold none of them
                    of_local[id(local)] = (p, found, None)
                    steady = False
                pairs.append((p, local))
                swapped.append(local)
            lists.append(swapped)
        self._state, self._pairs, self._shadow, self._of_local = state, pairs, shadow, of_local
        if steady:
            self._plan = _Plan(groups, state, lists, pairs, shadow, of_local)
        self._groups = [group["params"] for group in groups]
        for group, swapped in zip(groups, lists):
            group["params"] = swapped
        opt.state = shadow
        return True

    def end(self) -> None:
        """Put the DTensors back (the body returned or raised), keeping every state the body wrote."""
        if self._groups is None:
            return
        opt, state, shadow, pairs, of_local = self.optimizer, self._state, self._shadow, self._pairs, self._of_local
        for group, params in zip(opt.param_groups, self._groups):
            group["params"] = params
        opt.state = state
        self._groups, self._state, self._pairs, self._shadow, self._of_local = None, None, [], {}, {}
        planned, self._planned = self._planned, False
        plan = self._plan
        if planned and plan is not None and plan.unchanged(shadow):  # the body replaced no state (the usual)
            deque(map(setattr, plan.locals, repeat("grad"), repeat(None)), maxlen=0)  # _drop_grads, as one C loop
            return
        for key, found in shadow.items():
            swapped = of_local.get(id(key))
            if swapped is None:  # not a DTensor: the body wrote its dict itself (a first step made it)
                if state.get(key) is not found:
                    state[key] = found
                continue
            p, real, made = swapped
            if made is not None and len(found) == len(made) and all(map(operator.is_, found.values(), made)):
                continue  # the body replaced no state: the real ones hold what it wrote
            if real is None:  # its first step: the real state's (defaultdict) entry is made now
                real = state[p]
            for name, value in found.items():
                old = real.get(name)
                if old is value or (isinstance(old, DTensor) and old._local_tensor is value):
                    continue
                if isinstance(value, torch.Tensor) and name not in SCALAR_STATES and value.shape == key.shape:
                    value = dtensor(value, p._spec)
                real[name] = value
            if len(real) != len(found):  # the body dropped a state
                for name in [n for n in real if n not in found]:
                    del real[name]
        self._drop_grads(pairs)

    @staticmethod
    def _drop_grads(pairs: list[tuple[DTensor, torch.Tensor]]) -> None:
        for _, local in pairs:
            local.grad = None

    def _has_dtensor(self) -> bool:
        key = tuple((id(g["params"]), len(g["params"])) for g in self.optimizer.param_groups)
        if key != self._checked:
            self._checked = key
            self._any_dtensor = any(isinstance(p, DTensor) for g in self.optimizer.param_groups for p in g["params"])
        return self._any_dtensor


_GRAD = operator.attrgetter("grad")
_SPEC = operator.attrgetter("_spec")
_LOCAL = operator.attrgetter("_local_tensor")


class _Plan:
    """One steady step's swap, for the next step to check and copy.

    [Note: the steady step]
    Once training is under way, each step swaps the same parameters, whose gradients are DTensors of their own spec,
    for the same locals, with the same real state dicts holding the same tensors (kept shadows, see [Note: shadow
    states kept across steps]); the loop of :meth:`LocalStep.begin` then does the same work per parameter each step,
    about 3 us each in Python (0.6 ms a step on the bench's 195 parameters). A step that finds nothing to make keeps
    what it made here. The next step checks that all of it still holds and copies it, where every check is an
    identity compared inside C (``map`` over ``operator.is_``, ``attrgetter``, ``chain``: no Python bytecode per
    parameter): the groups hold the same parameters, each still has the same local tensor and a DTensor gradient
    of its own spec (whose local becomes the local's ``.grad``); the real state has the same dicts for the same
    parameters, with the same keys and the same tensors. Anything else (a gradient set to None or replaced by
    another sharding, a state replaced, added or dropped, ``load_state_dict``, a parameter added) takes the loop,
    which makes the swap anew. ``end()`` checks the same way that the body replaced no shadow state
    (:meth:`unchanged`); otherwise it writes back as usual."""

    __slots__ = ("dicts", "keys", "lists", "locals", "made", "made_lens", "made_values", "names", "of_local", "pairs",
                 "params", "real", "shadow", "specs", "state", "values")

    def __init__(self, groups: list[dict[str, Any]], state: Any, lists: list[list[Any]],
                 pairs: list[tuple[DTensor, torch.Tensor]], shadow: dict[torch.Tensor, dict[str, Any]],
                 of_local: dict[int, Any]) -> None:
        self.real = tuple(group["params"] for group in groups)  # each group's list (the object)
        self.params = tuple(p for p, _ in pairs)
        self.locals = tuple(local for _, local in pairs)
        self.specs = tuple(map(_SPEC, self.params))
        self.lists = tuple(tuple(swapped) for swapped in lists)
        self.pairs = pairs
        self.state = state
        self.keys = tuple(state)
        self.dicts = tuple(state.values())
        self.names = tuple(chain.from_iterable(self.dicts))
        self.values = tuple(chain.from_iterable(map(dict.values, self.dicts)))
        self.shadow = dict(shadow)
        self.of_local = of_local
        self.made = tuple(shadow.values())
        self.made_lens = list(map(len, self.made))
        self.made_values = tuple(chain.from_iterable(map(dict.values, self.made)))

    def fits(self, groups: list[dict[str, Any]], state: Any) -> bool:
        """Whether a step that begins now may copy this one (see the Note); if so, the locals' ``.grad`` are set."""
        is_ = operator.is_
        if state is not self.state or len(groups) != len(self.real) or len(state) != len(self.keys):
            return False
        lists = [group["params"] for group in groups]
        if not all(map(is_, lists, self.real)):
            return False
        params = list(chain.from_iterable(lists))
        if len(params) != len(self.params) or not all(map(is_, params, self.params)) or \
                not all(map(is_, map(_LOCAL, params), self.locals)):
            return False
        if not all(map(is_, state, self.keys)) or not all(map(is_, state.values(), self.dicts)) or \
                list(chain.from_iterable(self.dicts)) != list(self.names) or \
                not all(map(is_, chain.from_iterable(map(dict.values, self.dicts)), self.values)):
            return False
        grads = list(map(_GRAD, params))
        if not all(map(is_, map(type, grads), repeat(DTensor))) or not all(map(is_, map(_SPEC, grads), self.specs)):
            return False  # a gradient None, not a DTensor, or of another spec: the loop decides
        deque(map(setattr, self.locals, repeat("grad"), map(_LOCAL, grads)), maxlen=0)
        return True

    def unchanged(self, shadow: dict[torch.Tensor, dict[str, Any]]) -> bool:
        """Whether the body left every shadow state dict as this plan made it: the same dicts, keys and tensors."""
        is_ = operator.is_
        return (len(shadow) == len(self.made) and all(map(is_, shadow.values(), self.made))
                and list(map(len, self.made)) == self.made_lens
                and all(map(is_, chain.from_iterable(map(dict.values, self.made)), self.made_values)))
