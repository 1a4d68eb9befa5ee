"""The optimizer's step on the sharded parameters' local tensors (see [Note: the step on local tensors] in
``zero_core.runtime._local_step``): bitwise the DTensor step for every element-wise torch optimizer, DTensors
wherever the user looks (hooks, states, after a step that raised), and the fallbacks that keep it so."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _small_loop import full_params, train_step
from torch import nn
from torch.distributed.tensor import DTensor

from zero_core import ZeroConfig, shard
from zero_core.runtime import _local_step
from zero_core.testing import RunResult, assert_parity, run_distributed

OPTIMIZERS = {
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    "adam-wd": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "rmsprop-centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=1),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
}
SCALARS = _local_step.SCALAR_STATES


def _model() -> nn.Module:
    torch.manual_seed(0)
    # a 0-d parameter among them: its states are 0-d too, and must still be told from the 0-d ``step``
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3, bias=False))
    model.register_parameter("temperature", nn.Parameter(torch.tensor(1.0)))
    return model


class _Counted:
    """Counts the steps that ran on local tensors (``LocalStep.begin`` answering True); ``off`` turns them off."""

    def __init__(self) -> None:
        self.local = 0
        self.off = False
        self._begin = _local_step.LocalStep.begin

    def __enter__(self) -> _Counted:
        counted = self

        def begin(step, args, kwargs):
            if counted.off:
                return False
            began = counted._begin(step, args, kwargs)
            counted.local += began
            return began

        _local_step.LocalStep.begin = begin
        return self

    def __exit__(self, *exc: object) -> None:
        _local_step.LocalStep.begin = self._begin


def _states(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, dict[str, object]]:
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, dict[str, object]] = {}
    for p, state in opt.state.items():
        out[names[id(p)]] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
                             if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    return out


def _train(name: str, *, local: bool, steps: int = 3):
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    model, opt = shard(model, OPTIMIZERS[name](model.parameters()), config=ZeroConfig(stage=3))
    with _Counted() as counted:
        counted.off = not local
        losses = [train_step(model, opt, s, features=6, world=world, rank=rank) for s in range(steps)]
    # the states as the DTensor step makes them: DTensors of their parameter's sharding, the scalars plain
    for p, state in opt.state.items():
        assert isinstance(p, DTensor), f"{name}: the state is keyed by a local tensor"
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if key in SCALARS:
                assert not isinstance(value, DTensor), f"{name}: {key} became a DTensor"
            else:
                assert isinstance(value, DTensor) and value._spec.placements == p._spec.placements, \
                    f"{name}: state {key} is {type(value).__name__}"
    assert all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
    model.close()
    return losses, full_params(model), _states(opt, model), counted.local


def _every_optimizer() -> tuple[dict[str, bool], RunResult]:
    same = {}
    for name in OPTIMIZERS:
        losses, params, states, stepped_locally = _train(name, local=True)
        assert stepped_locally == 3, f"{name}: {stepped_locally} of 3 steps ran on local tensors"
        if name == "rprop":  # DTensor cannot step it (no sharding rule for its masked writes): against one process
            rprop = RunResult(losses, params)
            continue
        ref_losses, ref_params, ref_states, _ = _train(name, local=False)
        same[name] = losses == ref_losses and all(torch.equal(params[k], ref_params[k]) for k in params) and \
            states.keys() == ref_states.keys() and all(
                states[p].keys() == ref_states[p].keys() and all(
                    torch.equal(v, ref_states[p][k]) if isinstance(v, torch.Tensor) else v == ref_states[p][k]
                    for k, v in states[p].items())
                for p in states)
    return same, rprop


def _rprop_in_one_process() -> RunResult:
    model = _model()
    opt = OPTIMIZERS["rprop"](model.parameters())
    return RunResult([train_step(model, opt, s, features=6, world=1, rank=0) for s in range(3)], full_params(model))


def test_every_elementwise_torch_optimizer_steps_locally_and_bitwise_as_on_dtensors():
    reference = _rprop_in_one_process()
    for rank, (same, rprop) in enumerate(run_distributed(_every_optimizer, 2, timeout=240)):
        assert all(same.values()), f"rank {rank}: differ from the DTensor step: {[k for k, v in same.items() if not v]}"
        assert_parity(reference, rprop, label=f"rank {rank}, Rprop:")


def _edited(local: bool):
    """AdamW at two ranks whose states the user edits between steps: one replaced, one parameter's dropped, one
    changed in place, then every state loaded back from an earlier state_dict."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    model, opt = shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=ZeroConfig(stage=3))
    params = list(model.parameters())[1:]  # the first, the 0-d temperature, gets no gradient: it has no state
    with _Counted() as counted:
        counted.off = not local
        losses = [train_step(model, opt, s, features=6, world=world, rank=rank) for s in range(2)]
        saved = opt.state_dict()
        opt.state[params[0]]["exp_avg"] = torch.ones_like(opt.state[params[0]]["exp_avg"])
        del opt.state[params[1]]
        opt.state[params[2]]["exp_avg_sq"].mul_(4.0)
        losses += [train_step(model, opt, s, features=6, world=world, rank=rank) for s in range(2, 4)]
        opt.load_state_dict(saved)
        losses += [train_step(model, opt, s, features=6, world=world, rank=rank) for s in range(4, 6)]
    model.close()
    return losses, full_params(model), _states(opt, model), counted.local


def _edited_both_ways() -> tuple[bool, int]:
    losses, params, states, stepped_locally = _edited(local=True)
    ref_losses, ref_params, ref_states, _ = _edited(local=False)
    same = losses == ref_losses and all(torch.equal(params[k], ref_params[k]) for k in params) and all(
        torch.equal(v, ref_states[p][k]) if isinstance(v, torch.Tensor) else v == ref_states[p][k]
        for p in states for k, v in states[p].items()) and states.keys() == ref_states.keys()
    return same, stepped_locally


def test_states_edited_between_steps_are_what_the_next_local_step_reads():
    """See [Note: shadow states kept across steps] in ``zero_core.runtime._local_step``."""
    for rank, (same, stepped_locally) in enumerate(run_distributed(_edited_both_ways, 2, timeout=120)):
        assert stepped_locally == 6, f"rank {rank}: {stepped_locally} of 6 steps ran on local tensors"
        assert same, f"rank {rank}: the local steps differ from the DTensor steps after the states were edited"


def _steady(local: bool):
    """AdamW at two ranks, every parameter with a gradient (so steps copy the last steady swap, see [Note: the steady
    step]), the user editing between steps what that swap checks: a state replaced, one changed in place, one
    parameter's dropped, a gradient set to None or replaced by another DTensor before the step, a parameter group
    added, the states loaded back."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))  # every parameter gets a gradient
    model, opt = shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=ZeroConfig(stage=2))
    params = list(model.parameters())
    step = [0]
    losses: list[float] = []

    def run(steps: int, edit_grads=None) -> None:
        for _ in range(steps):
            g = torch.Generator().manual_seed(step[0])
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            n = 8 // world
            loss = F.cross_entropy(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n])
            loss.backward()
            if edit_grads is not None:
                edit_grads()
            opt.step()
            opt.zero_grad()
            value = loss.detach().clone()
            dist.all_reduce(value)
            losses.append(value.item() / world)
            step[0] += 1

    copied = [0]
    fits = _local_step._Plan.fits

    def counting(plan, groups, state):
        ok = fits(plan, groups, state)
        copied[0] += ok
        return ok

    _local_step._Plan.fits = counting
    try:
        with _Counted() as counted:
            counted.off = not local
            run(4)
            saved = opt.state_dict()
            # after each edit, three steps: the first takes the loop, the next ones copy its swap again
            opt.state[params[0]]["exp_avg"] = torch.ones_like(opt.state[params[0]]["exp_avg"])
            run(3)
            opt.state[params[1]]["exp_avg_sq"].mul_(4.0)  # in place: the swap's locals see it
            run(3)
            del opt.state[params[2]]
            run(3)

            def none_and_replaced() -> None:
                params[3].grad = None
                params[0].grad = params[0].grad * 2.0  # a DTensor of the same spec, another local tensor

            run(1, none_and_replaced)
            run(3)
            run(3, lambda: setattr(params[1], "grad", params[1].grad.clone()))  # another spec object: the loop's
            run(2)
            # a body that replaces a state (torch's own keep theirs in place): the step writes the new one back
            init_group = torch.optim.Adam._init_group

            def replacing(self, group, *args):
                made = init_group(self, group, *args)
                first = group["params"][0]
                self.state[first]["exp_avg"] = self.state[first]["exp_avg"].clone()  # the step updates the old one
                return made

            torch.optim.Adam._init_group = replacing
            try:
                run(1)
            finally:
                torch.optim.Adam._init_group = init_group
            before_load = _states(opt, model)
            run(3)
            opt.load_state_dict(saved)
            run(3)
            extra = nn.Parameter(torch.ones(3))  # a plain tensor, in a group of its own
            opt.add_param_group({"params": [extra], "lr": 1e-3})
            model.register_parameter("extra", extra)  # for full_params; it gets no gradient from the forward
            run(3)
    finally:
        _local_step._Plan.fits = fits
    model.close()
    states = {"before the load": before_load, "at the end": _states(opt, model)}
    return losses, full_params(model), states, counted.local, copied[0]


def _steady_both_ways() -> tuple[bool, int, int]:
    losses, params, states, stepped_locally, copied = _steady(local=True)
    ref_losses, ref_params, ref_states, _, _ = _steady(local=False)
    same = losses == ref_losses and all(torch.equal(params[k], ref_params[k]) for k in params) and all(
        states[when].keys() == ref_states[when].keys() and all(
            torch.equal(v, ref_states[when][p][k]) if isinstance(v, torch.Tensor) else v == ref_states[when][p][k]
            for p in states[when] for k, v in states[when][p].items())
        for when in states)
    return same, stepped_locally, copied


def test_steady_steps_copy_their_swap_and_see_every_edit_between_steps():
    """See [Note: the steady step] in ``zero_core.runtime._local_step``: bitwise the DTensor step throughout."""
    for rank, (same, stepped_locally, copied) in enumerate(run_distributed(_steady_both_ways, 2, timeout=120)):
        assert stepped_locally == 32, f"rank {rank}: {stepped_locally} of 32 steps ran on local tensors"
        assert copied >= 10, f"rank {rank}: only {copied} steps copied a steady swap"
        assert same, f"rank {rank}: the local steps differ from the DTensor steps"


def _what_the_user_sees() -> dict[str, object]:
    world, rank = dist.get_world_size(), dist.get_rank()
    seen: dict[str, object] = {}
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def look(what: str):
        def hook(o: torch.optim.Optimizer, args: object, kwargs: object) -> None:
            seen.setdefault(what, [type(p) for g in o.param_groups for p in g["params"]])
        return hook

    early = opt.register_step_post_hook(look("post-hook before shard()"))  # runs before zero's post-hook
    model, opt = shard(model, opt, config=ZeroConfig(stage=3))
    with _Counted() as counted:
        train_step(model, opt, 0, features=6, world=world, rank=rank)
        seen["with a post-hook registered before shard(): local steps"] = counted.local
        early.remove()
        late = opt.register_step_pre_hook(look("pre-hook after shard()"))  # runs after zero's pre-hook
        train_step(model, opt, 1, features=6, world=world, rank=rank)
        seen["with a pre-hook registered after shard(): local steps"] = counted.local
        late.remove()
        # an LR scheduler made after shard() wraps zero's step wrapper: it still sees the step called
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_step(model, opt, 2, features=6, world=world, rank=rank)
            scheduler.step()
        seen["scheduler warnings"] = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
        seen["lr after the scheduler's step"] = opt.param_groups[0]["lr"]
        seen["local steps with no hook in the window"] = counted.local
        # a body that raises: the caller gets the exception with the DTensors back in place
        state_keys = set(map(id, opt.state))
        loss = model(torch.randn(4, 6)).sum()
        loss.backward()
        lr = opt.param_groups[0]["lr"]
        opt.param_groups[0]["lr"] = "not a number"
        try:
            opt.step()
        except Exception as e:  # noqa: BLE001 - torch's own error for the bad lr, whatever its class
            seen["raised"] = type(e).__name__
        seen["after the raise: params"] = sorted({type(p).__name__ for g in opt.param_groups for p in g["params"]})
        seen["after the raise: state keys unchanged"] = set(map(id, opt.state)) == state_keys
        opt.param_groups[0]["lr"] = lr
        opt.step()  # the same gradients step once, as they would have
        opt.zero_grad()
        seen["local steps in all"] = counted.local
    model.close()
    seen["step wrapper removed by close()"] = "step" not in opt.__dict__ or hasattr(opt.step, "_wrapped_by_lr_sched")
    return seen


def test_hooks_schedulers_and_a_raising_step_see_dtensors():
    for seen in run_distributed(_what_the_user_sees, 2, timeout=120):
        assert seen["post-hook before shard()"] == [DTensor] * 4
        assert seen["pre-hook after shard()"] == [DTensor] * 4
        # either hook sits inside the swap's window: those steps ran on the DTensors
        assert seen["with a post-hook registered before shard(): local steps"] == 0
        assert seen["with a pre-hook registered after shard(): local steps"] == 0
        assert seen["local steps with no hook in the window"] == 1
        assert seen["scheduler warnings"] == [] and seen["lr after the scheduler's step"] == 5e-3
        assert seen["raised"] and seen["after the raise: params"] == ["DTensor"]
        assert seen["after the raise: state keys unchanged"]
        assert seen["local steps in all"] == 3
        assert seen["step wrapper removed by close()"]
