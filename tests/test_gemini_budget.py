"""gemini's plan never over-commits (issue 48, items 1 and 2, on the CPU, where the tracer counts bytes exactly).

- The floor: the smallest budget the plan accepts (``need``: one compute point's gathered chunks and gradient
  buffers, the activations measured there, and at two ranks the gradient buffers of reductions in flight) trains,
  streaming every chunk from the host, with every operator of every step audited within it and the same values as
  plain PyTorch; one byte below, the plan refuses before anything steps, naming that budget.
- A step past its trace (a bigger batch after the warm-up) re-plans: cached shards go back to the host, the plan
  is made again from the larger figures, and training goes on with the same values as plain PyTorch; a bigger
  step that no budget-sized plan can hold is refused before it steps, naming the budget it needs.
- With its defaults (``margin_ratio=1.0``), a model whose states fit the budget keeps them all on the device after the
  warm-up: every chunk steps there and nothing crosses the link again (issue 48 item 3, the CPU part).
"""

import pytest
import torch

from zero_core import ChunkPolicy, ZeroConfig, shard
from zero_core.testing import assert_parity, device_under_test, run_distributed, train_reference, train_sharded
from zero_core.testing.parity import RunResult, make_optimizer
from zero_core.testing.zoo import get_case
from zero_offload import DeviceBudgetError

STEPS = 3  # the warm-up and two steps from its plan: the audit at every operator costs time


def _config(budget_bytes, **options):
    # exact bytes: int(mib * 2**20) gives back the same integer for any byte count a float holds exactly
    return ZeroConfig(chunk=ChunkPolicy(chunk_size=300), placement="gemini",
                      placement_options={"device_budget_mb": budget_bytes / 2**20, **options})


def _floor_worker():
    """The plan's refusal names the floor; the floor trains (audited at every operator); one byte below is refused."""
    try:  # above the setup's check (one gather group), below the step's peak
        train_sharded("gpt", config=_config(80_000))
        raise AssertionError("a budget below the warm-up's peak trained")
    except DeviceBudgetError as e:
        assert e.measured and "The smallest budget that trains is device_budget_mb=" in str(e), e
        floor = e.needed
    at_floor = train_sharded("gpt", config=_config(floor, trace_every_step=True), steps=STEPS)
    try:
        train_sharded("gpt", config=_config(floor - 1))
        below = None
    except DeviceBudgetError as e:
        below = (e.needed, e.measured, str(e))
    return floor, at_floor, below


@pytest.mark.parametrize("world", [1, 2])
def test_the_floor_trains_streaming_and_one_byte_below_is_refused_at_planning(world):
    results = [_floor_worker()] if world == 1 else run_distributed(_floor_worker, world, timeout=300)
    reference = train_reference("gpt", steps=STEPS)
    for floor, at_floor, below in results:
        assert_parity(reference, at_floor, label=f"at the floor, world {world}")
        report = at_floor.placement
        assert report["need"] == floor == report["budget"]["device"]
        # every operator of every step counted: model data on the device plus live activations (on CUDA: the
        # allocator's figures at each compute point)
        assert report["audit_points"] > (500 if device_under_test() == "cpu" else 50)
        assert report["audit_max"] <= floor, report
        # streaming: no chunk's states kept on the device, nothing prefetched, nothing re-planned
        assert report["pinned"] == [] and not report["prefetch"] and report["replans"] == 0
        # the budget was used, not just respected by keeping nothing: where a point's peak leaves room, shards stay up
        assert report["promotions"] > 0
        assert below is not None, "one byte below the floor trained"
        needed, measured, message = below
        assert needed == floor and measured  # the same figure, refused by the plan, not at setup
        assert f"({floor - 1} bytes" in message and f"({floor} bytes)" in message
    assert len({floor for floor, _, _ in results}) == 1  # agreed over ranks


def _train(sizes, config=None):
    """Plain PyTorch (no config) or gemini on one process, step ``s`` on a batch of ``sizes[s]`` samples."""
    case = get_case("gpt")
    torch.manual_seed(0)
    model = case.build()
    opt = make_optimizer(case, model)
    if config is not None:
        model, opt = shard(model, opt, config=config)
    losses = []
    params_before_last = None
    try:
        for step, size in enumerate(sizes):
            opt.zero_grad(set_to_none=True)
            if config is not None and step == len(sizes) - 1:  # before the step begins: not the step's memory
                params_before_last = {k: v.clone() for k, v in model.full_parameters().items()}
            inputs, targets = case.batch(step, size)
            loss = case.loss(model(inputs), targets)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    except DeviceBudgetError as e:
        after = model.full_parameters()
        unchanged = all(torch.equal(params_before_last[k], after[k]) for k in after)
        return e, unchanged, model.engine.placement.report()
    if config is None:
        return RunResult(losses, {n: p.detach().clone() for n, p in model.named_parameters()})
    result = RunResult(losses, {n: v.clone() for n, v in model.full_parameters().items()},
                       placement=model.engine.placement.report())
    model.close()
    return result


def test_a_step_past_its_trace_replans_instead_of_failing():
    """The warm-up on 8 samples, step 1 on 16 (its activations past the trace), step 2 on 8 again."""
    sizes = [8, 16, 8]
    # room above the 8-sample floor (about 0.19 MiB) for the margin's chunks and a cache, and for the 16-sample step
    config = _config(640 * 1024, margin_ratio=0.5, trace_every_step=True)
    result = _train(sizes, config)
    assert_parity(_train(sizes), result, label="a bigger batch after the warm-up")
    report = result.placement
    # the figures grew once (step 2's smaller batch fits them): a larger need, fewer chunks kept in the margin
    (replan,) = report["replanned"]
    assert replan["step"] == 1 and replan["need"] > replan["need_before"] > 0, replan
    assert replan["pinned_before"] > replan["pinned"] == len(report["pinned"]), replan
    # every operator audited, the over step's included: the plan's figures were never past the budget
    assert report["audit_max"] <= report["budget"]["device"], report


def test_a_step_past_its_trace_that_the_budget_cannot_hold_is_refused_before_it_steps():
    # margin_ratio 0: the headroom goes to the cache (not to chunks stepping on the device), which the over step empties
    error, unchanged, report = _train([8, 32], _config(300 * 1024, watch=True, margin_ratio=0.0))
    assert isinstance(error, DeviceBudgetError) and error.measured, error
    assert "step 1 needed at its peak, past the warm-up's trace" in str(error)
    assert error.needed > report["budget"]["device"] and f"({error.needed} bytes)" in str(error)
    assert unchanged and report["replans"] == 1
    # once over, the step's cached shards went back to the host to give the activations their room
    assert report["replanned"][0]["evicted"] > 0 and report["evictions"] >= report["replanned"][0]["evicted"]


def test_with_the_defaults_a_model_that_fits_keeps_its_states_on_the_device_after_the_warm_up():
    """Three steps and five: the same moves and bytes across the link, so steps 3 and 4 moved nothing."""
    short, long = (_train([8] * n, _config(8 * 2**20)) for n in (3, 5))
    assert_parity(_train([8] * 5), long, label="gemini's defaults, a model that fits")
    chunks = len(long.placement["pinned"])
    assert chunks > 1 and long.placement["pinned"] == list(range(chunks)), long.placement["pinned"]  # every chunk
    assert long.placement["used"]["host"] == 0, long.placement["used"]  # no state left on the host
    assert long.placement["moves"] == short.placement["moves"], (short.placement["moves"], long.placement["moves"])
    assert long.placement["bytes_moved"] == short.placement["bytes_moved"]


def test_a_model_closed_before_its_warm_up_step_leaves_no_trace_running():
    """The CPU tracer is a dispatch mode on the process's stack from the warm-up's forward to its step: closing the
    model in between (training stopped after a forward and backward) takes it off, so later work runs untraced."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    before = list(_get_current_dispatch_mode_stack())  # what earlier work of this process left, if anything
    case = get_case("gpt")
    torch.manual_seed(0)
    built = case.build()
    model, _ = shard(built, make_optimizer(case, built), config=_config(8 * 2**20))
    inputs, targets = case.batch(0, 8)
    case.loss(model(inputs), targets).backward()
    assert len(_get_current_dispatch_mode_stack()) == len(before) + 1, "the warm-up's trace did not start"
    model.close()
    assert _get_current_dispatch_mode_stack() == before, _get_current_dispatch_mode_stack()
