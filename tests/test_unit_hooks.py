"""The per-module hooks do work only where a chunk changes: see [Note: a unit whose chunks are ready] in
``zero_core.runtime._unit``, and ``zero_core.runtime._autograd.on_first_gradient`` for the backward hooks on each unit's outputs.

Six linear layers in two chunks of three: in each pass the first unit that needs a chunk gathers it and the
other units' hooks return at once, so a stage-3 step makes four gathers through the residency (two per pass),
not one per module (twelve), and still trains as one process does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zero_core import ChunkPolicy, ZeroConfig, shard
from zero_core.interfaces.placement import DevicePlacementPolicy, PlacementPolicy
from zero_core.runtime._autograd import on_first_gradient

STEPS, BATCH, WIDTH = 3, 4, 16
LAYER = WIDTH * WIDTH + WIDTH  # elements of one layer's weight and bias


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(6)))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def _run() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    sharded = _model()
    model, opt = shard(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1),
                       config=ZeroConfig(stage=3, chunk=ChunkPolicy(chunk_size=3 * LAYER)))
    residency = model.engine.residency
    calls = {"forward": 0, "backward": 0}
    gather = residency.gather

    def counted(chunks, *, backward):
        calls["backward" if backward else "forward"] += 1
        return gather(chunks, backward=backward)

    residency.gather = counted
    per_step, losses, ref_losses = [], [], []
    per = BATCH // world
    for step in range(STEPS):
        x, y = _batch(step)
        calls.update(forward=0, backward=0)
        opt.zero_grad()
        loss = F.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        per_step.append(dict(calls))
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        losses.append(reported.item() / world)
        ref_opt.zero_grad()
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(ref_loss.item())
    full = model.full_parameters()
    worst = max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    return {"chunks": len(model.engine.chunks), "calls": per_step, "losses": losses, "ref_losses": ref_losses,
            "worst": worst}


def test_only_the_first_unit_of_a_chunk_gathers_and_training_matches_one_process():
    from zero_core.testing import run_distributed

    for r in run_distributed(_run, 2, timeout=120):
        assert r["chunks"] == 2
        assert r["calls"] == [{"forward": 2, "backward": 2}] * STEPS  # one per chunk and pass, not one per module
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["ref_losses"])) < 1e-5
        assert r["worst"] < 1e-5


def test_only_a_policy_that_overrides_before_compute_watches_every_unit():
    class Watching(DevicePlacementPolicy):
        name = "watching-test"

        def before_compute(self, chunks, *, backward):
            pass

    assert not DevicePlacementPolicy().watches_computes
    assert Watching().watches_computes
    assert PlacementPolicy.watches_computes.__doc__

    class Moving(DevicePlacementPolicy):  # gradients then wait for the end of backward: see moves_after_backward
        name = "moving-test"

        def after_backward(self, chunks):
            pass

    assert not DevicePlacementPolicy().moves_after_backward and not Watching().moves_after_backward
    assert Moving().moves_after_backward


def test_on_first_gradient_runs_once_per_backward_as_a_multi_grad_hook_does():
    w = torch.randn(3, requires_grad=True)
    a, b = w * 2, w.exp()
    c = b[:2]  # a view: another node of the same graph
    ours, torchs = [], []
    on_first_gradient([a, b, c], lambda grads: ours.append(torch._C._current_graph_task_id()))
    torch.autograd.graph.register_multi_grad_hook([a, b, c], lambda grad: torchs.append(1), mode="any")
    loss = a.sum() + b.sum() + c.sum()
    loss.backward(retain_graph=True)
    torch.autograd.grad(loss, [w])  # another backward through the same graph: once more
    assert len(ours) == len(torchs) == 2 and ours[0] != ours[1]
    unused = torch.randn(2, requires_grad=True) * 3  # a tensor of another graph: never called
    called = []
    on_first_gradient([unused, torch.ones(2)], lambda grads: called.append(1))  # a tensor without grad is skipped
    (w * 5).sum().backward()
    assert called == []



def _moments() -> dict:
    """What the units and the engine's backward pass say at each moment of a step, a gradient penalty and a
    capture pass (two ranks: at one rank every chunk is kept gathered)."""
    from zero_core.base._state import TrainingState

    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = _model()
    model, opt = shard(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1),
                       config=ZeroConfig(stage=3, chunk=ChunkPolicy(chunk_size=3 * LAYER)))
    engine = model.engine
    units = engine._module_hooks.units
    seen: dict[str, object] = {"units": [len(u.chunks) for u in units]}

    def now():
        backward = engine.backward_pass
        return (engine.state.value, None if backward is None else backward.kind.value,
                None if backward is None else backward.holds_gathered, sorted({u.state.value for u in units}),
                [c.is_gathered for c in engine.chunks])

    def look(name):
        def hook(grad):  # the input's gradient comes after every module's backward
            seen[name] = now()
        return hook

    x, y = _batch(0)
    per = BATCH // world
    x, y = x[rank * per:(rank + 1) * per].requires_grad_(True), y[rank * per:(rank + 1) * per]
    params = list(model.parameters())
    early: dict[str, object] = {}

    def landed(grad):
        """Before the third layer's backward (its gradients come next): the later chunk's reduction was launched when
        its last gradient came; wait until the reducer's thread has landed it (the training thread never waits in a
        backward), so that the next gradient to arrive hands it over. See [Note: gradients handed over as they
        land] in zero_core.chunks._chunk_grads."""
        import time

        deadline = time.monotonic() + 60
        while not engine.chunks[1].grads.landed and time.monotonic() < deadline:
            time.sleep(0.01)

    def early_grads(grad):
        """On the input, before the backward's end: the later chunk's .grad are set, the earlier chunk's not yet
        (it is reduced at the end)."""
        early["set"] = [p.grad is not None for p in params]
        early["values"] = [p.grad.to_local().clone() for p in params[6:]]

    seen["before"] = now()
    handle = x.register_hook(look("backward"))
    early_handle = x.register_hook(early_grads)
    def hook_third(module, args, out):
        out.register_hook(landed)

    third = sharded[2].register_forward_hook(hook_third)
    loss = F.mse_loss(model(x), y)
    third.remove()
    seen["after forward"] = now()
    loss.backward()
    handle.remove()
    early_handle.remove()
    seen["after backward"] = now() + ([p.grad is not None for p in model.parameters()],)
    # the values set early are those the backward's end leaves, and plain PyTorch's over the whole batch
    reference = _model()
    xs, ys = _batch(0)
    F.mse_loss(reference(xs), ys).backward()
    seen["early .grad set"] = early["set"]
    seen["early .grad kept"] = all(torch.equal(v, p.grad.to_local()) for v, p in zip(early["values"], params[6:]))
    seen["early .grad is plain PyTorch's"] = [
        torch.allclose(p.grad.full_tensor(), r.grad, atol=1e-6, rtol=1e-5) for p, r in zip(params, reference.parameters())]
    opt.zero_grad()
    with torch.no_grad():  # a forward without a graph leaves every unit idle
        model(x)
    seen["after a forward without graph"] = now()
    # a gradient penalty: a capture pass that keeps the chunks gathered, then a backward through its graph that
    # holds them until its end
    loss = F.mse_loss(model(x), y)
    handle = x.register_hook(look("capture for graph"))
    (grad_x,) = torch.autograd.grad(loss, [x], create_graph=True)
    handle.remove()
    seen["after capture for graph"] = now() + ([p.grad is not None for p in model.parameters()],)
    handle = x.register_hook(look("through the gradients' graph"))
    (loss + grad_x.pow(2).sum()).backward()
    handle.remove()
    seen["after the penalty's backward"] = now() + ([p.grad is not None for p in model.parameters()],)
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    handle = x.register_hook(look("capture"))
    torch.autograd.grad(loss, [x])
    handle.remove()
    seen["after capture"] = now()
    assert engine.state is TrainingState.IDLE
    model.close()
    return seen


def test_each_unit_and_backward_pass_records_its_moment_of_the_step():
    """Each unit's UnitState follows its hooks, and each backward's BackwardPass says what it does with gradients
    (see [Note: the unit of gather and release] in ``zero_core.runtime._unit``, and [Note: the end of a backward]
    in ``zero_core.runtime._engine``)."""
    from zero_core.testing import run_distributed

    sharded, gathered, none, every = [False, False], [True, True], [False] * 12, [True] * 12
    for seen in run_distributed(_moments, 2, timeout=120):
        assert seen["units"] == [1] * 6  # six modules, each a unit of one of the two chunks
        assert seen["before"] == ("idle", None, None, ["idle"], sharded)
        assert seen["after forward"] == ("backward_pending", None, None, ["after_forward"], sharded)
        # the later chunk was reduced: its three units are AFTER_BACKWARD, the earlier chunk's still in BACKWARD
        assert seen["backward"] == ("backward", "reduce", False, ["after_backward", "backward"], [True, False])
        assert seen["after backward"] == ("idle", None, None, ["idle"], sharded, every)
        assert seen["early .grad set"] == [False] * 6 + [True] * 6  # before the end of backward, as each lands
        assert seen["early .grad kept"]
        assert seen["early .grad is plain PyTorch's"] == every
        assert seen["after a forward without graph"] == ("idle", None, None, ["idle"], sharded)
        assert seen["capture for graph"] == ("backward", "capture_for_graph", False, ["backward"], gathered)
        assert seen["after capture for graph"] == ("backward_pending", None, None, ["idle"], gathered, none)
        # reduced as in any backward (the later chunk's units AFTER_BACKWARD), but nothing released before its end
        assert seen["through the gradients' graph"] == ("backward", "reduce", True, ["after_backward", "backward"],
                                                        gathered)
        assert seen["after the penalty's backward"] == ("idle", None, None, ["idle"], sharded, every)
        assert seen["capture"] == ("backward", "capture", False, ["backward"], gathered)  # released at its end
        assert seen["after capture"] == ("idle", None, None, ["idle"], sharded)


def test_kept_units_have_no_forward_hook_and_move_with_the_pass():
    """A unit whose chunks are all kept (stage 2) gets no forward hook and no hook at its outputs, only its
    pre-hook: its state follows the pass (see [Note: kept units] in ``zero_core.runtime._unit``), it trains as one
    process does, and calling one of its modules outside the wrapped model's forward is refused at the call."""
    import pytest

    from zero_core.base.errors import ZeroError

    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    sharded = _model()
    model, opt = shard(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1),
                       config=ZeroConfig(stage=2, chunk=ChunkPolicy(chunk_size=3 * LAYER)))
    units = model.engine._module_hooks.units
    assert len(units) == 6 and all(u.kept for u in units)
    for layer in sharded:
        assert len(layer._forward_pre_hooks) == 1 and not layer._forward_hooks
    states = lambda: [u.state.value for u in units]  # noqa: E731
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        ref_opt.zero_grad()
        seen: list[list[str]] = []

        def record(_grad, seen=seen):
            seen.append(states())

        # the gradient at the fourth layer's output: the backward began, no chunk is reduced yet
        handle = sharded[3].register_forward_hook(lambda m, a, out: out.register_hook(record) and None)
        loss = F.mse_loss(model(x), y)
        handle.remove()
        assert states() == ["after_forward"] * 6
        loss.register_hook(record)  # before the backward reaches the model
        loss.backward()
        assert seen == [["after_forward"] * 6, ["backward"] * 6] and states() == ["idle"] * 6
        opt.step()
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        model(x)
    assert states() == ["idle"] * 6  # a forward without a graph leaves them as it found them
    with pytest.raises(ZeroError, match="ran outside the wrapped model's forward"):
        sharded[0](x)
    for p, q in zip(model.full_state_dict().values(), reference.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    model.close()
