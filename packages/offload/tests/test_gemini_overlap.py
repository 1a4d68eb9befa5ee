"""Host steps hidden behind the backward (issue 48 item 5; see [Note: overlapped host steps]).

Each chunk whose states are on the host steps on a worker thread once its gradient is down, while the backward goes
on; ``optimizer.step()`` keeps the steps whose gradients are unchanged and undoes the others. Checked here: the
order of events (a chunk's host step begins before the backward ends), parity with one-process PyTorch at 1 and 2
ranks, and every fall-back (clipping, accumulation with and without no_sync, a backward that raises, a loss scaler).
"""

import pytest
import torch

from zero_core import ChunkPolicy, ConfigError, LossScale, Precision, ZeroConfig, shard
from zero_core.testing import assert_parity, run_distributed, train_reference, train_sharded
from zero_core.testing.parity import _build, make_optimizer
from zero_core.testing.zoo import get_case

STEPS = 3


def _config(**options):
    return ZeroConfig(chunk=ChunkPolicy(chunk_size=300), placement="gemini",
                      placement_options={"device_budget_mb": 1, "overlap_step": True,
                                                         "margin_ratio": 0.0, **options})  # every chunk steps on the host


_RUNS = ("plain", "clip", "clip_torch", "no_sync", "accumulate")


def _runs(names=_RUNS):
    """On each rank: plain training, clipping by zero's clip and by torch's, and accumulation over two micro-batches
    with and without no_sync()."""
    runs = {
        "plain": lambda: train_sharded("gpt", config=_config(), steps=STEPS),
        "clip": lambda: train_sharded("gpt", config=_config(), steps=STEPS, clip=0.05),
        "clip_torch": lambda: train_sharded("gpt", config=_config(), steps=STEPS, clip=0.05, clip_with="torch"),
        "no_sync": lambda: train_sharded("gpt", config=_config(), steps=STEPS, micro_batches=2),
        "accumulate": lambda: train_sharded("gpt", config=_config(), steps=STEPS, micro_batches=2, no_sync=False),
    }
    return {name: runs[name]() for name in names}


def _check(runs, world):
    reference = train_reference("gpt", steps=STEPS)
    clipped = train_reference("gpt", steps=STEPS, clip=0.05)
    chunks_stepped = STEPS - 1  # every step after the warm-up
    for name, run in runs.items():
        assert_parity(clipped if name.startswith("clip") else reference, run, label=f"{name}, world {world}")
        overlap = run.placement["overlap"]
        if name in ("plain", "no_sync"):
            # every chunk of every step after the warm-up stepped early, and kept its step
            assert overlap["kept"] == chunks_stepped * len(run.chunks) and overlap["undone"] == 0, (name, overlap)
            assert overlap["elements"] > 0 and overlap["ns_per_element"] > 0
        elif name.startswith("clip"):
            # step 1 stepped early, the clip changed the gradients: undone, redone, and overlap off from then on
            assert overlap["kept"] == 0 and overlap["undone"] == len(run.chunks), (name, overlap)
        else:
            # the first micro-batch's backward stepped early; the second backward undid it before it began
            assert overlap["kept"] == 0 and overlap["undone"] == chunks_stepped * len(run.chunks), (name, overlap)


def test_overlapped_host_steps_match_plain_pytorch_at_one_rank_and_host_steps_begin_inside_the_backward():
    _check(_runs(("plain", "clip_torch", "accumulate")), 1)  # the other two at two ranks
    # the order of events in one step: chunks submitted and begun on the worker before the backward ended
    case = get_case("gpt")
    built = _build(case)
    model, optimizer = shard(built, make_optimizer(case, built), config=_config())
    overlap = model.engine.placement.overlap
    overlap.record_events = True
    for step in range(2):
        optimizer.zero_grad()
        inputs, targets = case.batch(step, 8)
        model.backward(case.loss(model(inputs), targets))
        optimizer.step()
    events = overlap.events
    end = next(i for i, (what, _, _) in enumerate(events) if what == "backward_end")
    begun = [index for what, index, _ in events[:end] if what == "begin"]
    ended = {index for what, index, _ in events if what == "end"}
    assert begun, events  # at least one chunk's host step began while the backward was running
    assert ended == set(range(len(model.engine.chunks)))
    # reduced in reverse plan order: the last chunks step first
    assert [index for what, index, _ in events if what == "submit"][0] == len(model.engine.chunks) - 1
    model.engine.close()


def test_overlapped_host_steps_match_plain_pytorch_at_two_ranks():
    _check(run_distributed(_runs, 2, timeout=600)[0], 2)


def test_a_backward_that_raises_after_chunks_stepped_early_leaves_nothing_stepped():
    case = get_case("gpt")
    built = _build(case)
    model, optimizer = shard(built, make_optimizer(case, built), config=_config())
    policy = model.engine.placement

    def train(step, *, fail=False):
        optimizer.zero_grad()
        inputs, targets = case.batch(step, 8)
        hook = None
        if fail:  # the first block's output gradient raises: every later block's chunks are reduced by then
            def raising(module, args, output):
                output.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("injected")))
            hook = model.blocks[0].register_forward_hook(raising)
        try:
            model.backward(case.loss(model(inputs), targets))
        finally:
            if hook is not None:
                hook.remove()
        optimizer.step()

    train(0)
    train(1)
    before = {k: v.clone() for k, v in model.full_parameters().items()}
    with pytest.raises(RuntimeError, match="injected"):
        train(2, fail=True)
    after = model.full_parameters()  # settles the engine after the raise, as any entry point does
    assert policy.overlap.undone > 0  # chunks had stepped early, and were undone
    assert all(torch.equal(before[k], after[k]) for k in before)
    train(2)  # the same step again: as if the failed one never happened
    reference = train_reference("gpt", steps=STEPS)
    for name, value in model.full_parameters().items():
        torch.testing.assert_close(value, reference.params[name], rtol=1e-5, atol=1e-7, msg=name)
    model.engine.close()


def test_it_is_refused_with_a_loss_scaler_and_off_by_default():
    case = get_case("gpt")
    built = _build(case)
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=300), placement="gemini",
                        precision=Precision(compute="bf16", loss_scale=LossScale()),
                        placement_options={"device_budget_mb": 1, "overlap_step": True, "margin_ratio": 0.0})
    with pytest.raises(ConfigError, match="overlap_step cannot be used with Precision"):
        shard(built, make_optimizer(case, built), config=config)
    built = _build(case)
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=300), placement="gemini",
                        placement_options={"device_budget_mb": 1, "margin_ratio": 0.0})
    model, _ = shard(built, make_optimizer(case, built), config=config)
    assert model.engine.placement.overlap is None
    model.engine.close()
