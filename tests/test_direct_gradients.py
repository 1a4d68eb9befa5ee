"""At one rank the reduction is the identity: autograd's gradients are handed to the sharded parameters as they are,
with no gradient buffer, exactly where that equals what the reduction would hand over; everywhere else the
gradients go through a buffer as before. See [Note: gradients handed over as autograd made them] in
``zero_core.chunks._chunk_grads``.

Each case trains zero and plain PyTorch side by side (stages 2 and 3, one rank, without a process group and under a
one-rank gloo group, where the sharded parameters are DTensors) and counts the gradient buffers the engine's pool
hands out in each backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zero_core import ChunkPolicy, Precision, ZeroConfig, shard

WIDTH, BATCH = 8, 4
LAYER = WIDTH * WIDTH + WIDTH


class _Boom(Exception):
    pass


def _raise(grad: torch.Tensor) -> None:
    raise _Boom


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _pair(stage: int, **config):
    reference = _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    sharded = _model()
    model, opt = shard(sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-2),
                       config=ZeroConfig(stage=stage, chunk=ChunkPolicy(chunk_size=LAYER), **config))
    taken = [0]
    for chunk in model.engine.chunks:  # one pool for all of them: count the buffers it hands out
        pool = chunk.pool
        if not getattr(pool, "_counted", False):
            take = pool.take

            def counted(*args, take=take, **kwargs):
                taken[0] += 1
                return take(*args, **kwargs)

            pool.take, pool._counted = counted, True
    return model, opt, reference, ref_opt, taken


def _both(model, reference, step, *, scale=1.0, create_graph=False):
    x, y = _batch(step)
    loss = F.mse_loss(model(x), y) * scale
    ref_loss = F.mse_loss(reference(x), y) * scale
    loss.backward(create_graph=create_graph)
    ref_loss.backward(create_graph=create_graph)
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-6, atol=1e-7)


def _grads_match(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert not p.grad.requires_grad, name
            full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # the whole, at any world size
            torch.testing.assert_close(full, q.grad.detach(), rtol=1e-6, atol=1e-7, msg=name)


def _params_match(model, reference):
    for (name, p), q in zip(model.full_state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def _cases(stage: int) -> dict:
    """Every case at one rank; returns what each saw (buffers taken per backward, whether gradients shared
    storage), after checking gradients and parameters against plain PyTorch's at every step."""
    seen: dict = {}
    model, opt, reference, ref_opt, taken = _pair(stage)

    def clear() -> None:  # both optimizers' zero_grad, and the buffer count from here
        opt.zero_grad()
        ref_opt.zero_grad()
        taken[0] = 0

    def step() -> None:  # the gradients agree, both step, the parameters agree
        _grads_match(model, reference)
        opt.step()
        ref_opt.step()
        _params_match(model, reference)

    # 1. plain steps: no buffer, each parameter's gradient autograd's own tensor (no two share a storage)
    buffers, storages = [], set()
    for i in range(3):
        clear()
        _both(model, reference, i)
        buffers.append(taken[0])
        storages = {_local(p.grad).untyped_storage().data_ptr() for p in model.parameters()}
        step()
    seen["steps"] = (buffers, len(storages), len(list(model.parameters())))
    # 2. two backwards before a step: the second adds to a .grad, so it is reduced through a buffer as before
    clear()
    _both(model, reference, 10)
    first = taken[0]
    _both(model, reference, 11)
    seen["accumulate"] = (first, taken[0] - first)
    step()
    # 3. no_sync, then a backward outside it: the window's gradients wait in buffers, the last backward adds to them
    clear()
    with model.no_sync():
        _both(model, reference, 12)
    _both(model, reference, 13)
    seen["no_sync"] = taken[0]
    step()
    # 4. a backward that raises contributes nothing (undone at the next call, here the next forward): without a
    # zero_grad in between, the next backward's gradients are plain PyTorch's for that backward alone
    clear()
    x, y = _batch(14)
    handle = model.module[1].register_forward_hook(lambda m, a, out: out.register_hook(_raise) and None)
    loss = F.mse_loss(model(x), y)
    handle.remove()
    with pytest.raises(_Boom):
        loss.backward()
    taken[0] = 0
    _both(model, reference, 15)
    seen["after_raise"] = taken[0]
    step()
    # 5. create_graph=True: the gradients have graphs of their own; the sharded .grad gets a detached copy, as before
    clear()
    _both(model, reference, 16, create_graph=True)
    seen["create_graph"] = taken[0]
    step()
    model.close()
    # 6. a compute dtype of its own: the reduction casts, so it goes through a buffer
    bf16, _, _, _, taken = _pair(stage, precision=Precision(compute="bf16"))
    x, y = _batch(17)
    F.mse_loss(bf16(x), y).backward()
    seen["bf16"] = taken[0]
    bf16.close()
    # 7. a placement policy that watches computes (Gemini traces memory): never by autograd's tensors
    gemini, _, _, _, _ = _pair(stage, placement="gemini",
                                placement_options={"device_budget_mb": 64})
    seen["gemini"] = [c.grads.may_hand_directly for c in gemini.engine.chunks]
    gemini.close()
    return seen


def _check(seen: dict, stage: int) -> None:
    buffers, storages, params = seen["steps"]
    assert buffers == [0, 0, 0], seen
    assert storages == params == 8, seen
    chunks = 4  # one chunk per block: Linear's weight and bias
    assert seen["accumulate"] == (0, chunks), seen
    assert seen["no_sync"] == chunks, seen  # taken by the window; the backward after it adds in place
    assert seen["after_raise"] == 0, seen
    assert seen["create_graph"] == chunks, seen
    assert seen["bf16"] >= chunks, seen
    assert seen["gemini"] == [False] * chunks, seen


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("stage", [2, 3])
def test_one_rank_hands_autograds_gradients_over_and_trains_as_plain_pytorch(stage):
    _check(_cases(stage), stage)


def _in_group(stage: int) -> dict:
    return _cases(stage)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("stage", [2, 3])
def test_one_rank_under_a_process_group_hands_them_over_as_dtensors(stage):
    from zero_core.testing import run_distributed

    [seen] = run_distributed(_in_group, 1, stage, timeout=120)
    _check(seen, stage)


def _wrappers(stage: int) -> dict:
    """Under a one-rank process group: which sharded gradients were DTensor wrappers lent again, whether what a user
    held or marked was left alone, and when the gradients zero_grad dropped were let go."""
    import weakref

    seen: dict = {}
    model, opt, reference, ref_opt, _ = _pair(stage)
    params = list(model.parameters())

    def train(step: int) -> None:
        opt.zero_grad()
        ref_opt.zero_grad()
        _both(model, reference, step)
        _grads_match(model, reference)
        opt.step()
        ref_opt.step()

    train(0)  # at two ranks the first backward hands every gradient over at its end (a new wrapper each)
    train(1)
    first = [id(p.grad) for p in params]
    held = params[0].grad  # a user's reference to a gradient: it must never change under them
    held_values = held.to_local().clone()
    params[1].grad.tag = "mine"  # an attribute set on a gradient: the next .grad is a new tensor without it
    weak = weakref.ref(params[2].grad)  # a weak reference: the same
    locals_ = [weakref.ref(p.grad._local_tensor) for p in params]
    opt.zero_grad()
    ref_opt.zero_grad()
    seen["kept_after_zero_grad"] = [r() is not None for r in locals_]
    x, y = _batch(1)
    out = model(x)  # the forward lets go of every gradient nothing else holds
    seen["let_go_by_forward"] = [r() is None for r in locals_]
    loss, ref_loss = F.mse_loss(out, y), F.mse_loss(reference(x), y)
    loss.backward()
    ref_loss.backward()
    _grads_match(model, reference)
    opt.step()
    ref_opt.step()
    seen["same_object"] = [id(p.grad) == i for p, i in zip(params, first)]
    seen["held_unchanged"] = torch.equal(held.to_local(), held_values) and params[0].grad is not held
    seen["tag"] = hasattr(params[1].grad, "tag")
    seen["weak"] = weak() is None
    # zero_grad between the forward and the backward: the dropped gradients go before the backward makes any (seen
    # from a hook on a middle block's output, which runs after the last blocks' gradients were made)
    locals_ = [weakref.ref(p.grad._local_tensor) for p in params]
    at_backward: list[bool] = []
    handle = model.module[2].register_forward_hook(
        lambda m, a, out: out.register_hook(lambda g: at_backward.extend(r() is None for r in locals_)) and None)
    x, y = _batch(2)
    out = model(x)
    handle.remove()
    seen["kept_through_forward"] = [r() is not None for r in locals_]
    opt.zero_grad()
    ref_opt.zero_grad()
    loss, ref_loss = F.mse_loss(out, y), F.mse_loss(reference(x), y)
    loss.backward()
    ref_loss.backward()
    _grads_match(model, reference)
    seen["let_go_by_backward"] = at_backward
    opt.step()
    ref_opt.step()
    _params_match(model, reference)
    model.close()
    return seen


def _wrappers_cases() -> dict:
    return {stage: _wrappers(stage) for stage in (2, 3)}


@pytest.mark.parametrize("world", [1, 2])
def test_dtensor_gradients_are_lent_again_only_where_nothing_else_can_see_them(world):
    """See [Note: gradient wrappers lent again] in ``zero_core.chunks._chunk_grads``: plain PyTorch makes a new
    gradient tensor every backward; zero gives back the same DTensor wrapper where nothing could tell. At one rank
    through the direct hand-over; at two through the hand-over as reductions land, which depends on when they
    land (the rest are handed over at the end of backward, new), so only what must hold either way is checked
    there. Every rank sees the same batches here, so each matches plain PyTorch on them."""
    from zero_core.testing import run_distributed

    for seen in run_distributed(_wrappers_cases, world, timeout=120):
        for stage, s in seen.items():
            if world == 1:
                assert s["kept_after_zero_grad"] == [True] * 8, (stage, s)  # until the next forward or backward
                # lent again: all but the held, the marked and the weakly referenced one (that one is let go by the
                # forward, so a new wrapper may reuse its address: the weak reference tells that it died)
                same = s["same_object"]
                assert same[:2] == [False, False] and same[3:] == [True] * 5, (stage, s)
            assert s["let_go_by_forward"] == [False] + [True] * 7, (stage, s)  # the held one lives on
            assert s["held_unchanged"] and not s["tag"] and s["weak"], (stage, s)
            assert s["kept_through_forward"] == [True] * 8, (stage, s)
            assert s["let_go_by_backward"] == [True] * 8, (stage, s)
