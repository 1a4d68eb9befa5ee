"""Several optimizers over one model (the Muon recipe) train as in one process; one left out is refused.

See [Note: several optimizers] in ``zero_core._shard``. Muon steps the hidden matrices whole, AdamW the
biases, the LayerNorm and the head element-wise; both are built before shard() and passed together. One
spawn per world size runs every stage of both strategies against the same code in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _small_loop import full_params, train_step
from torch import nn

from zero_core import (
    CheckpointError,
    ConfigError,
    LossScale,
    Precision,
    RanksOutOfStepError,
    ZeroConfig,
    ZeroError,
    ZeroSetupError,
    load_checkpoint,
    save_checkpoint,
    shard,
)
from zero_core.testing import RunResult, assert_parity, run_distributed

STEPS = 4
ONLY_ADAMW = 2  # in this step the loop steps AdamW alone (Muon's parameters keep still, as in one process)
LAYOUTS = [(strategy, stage) for strategy in ("chunk", "tensor") for stage in (1, 2, 3)]
RTOL = 1e-5


def _model() -> nn.Module:
    torch.manual_seed(0)
    # prime widths: no world size divides a parameter, so pieces are padded and some ranks hold no rows
    return nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 3))


def _recipe(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """Muon over the hidden matrices, AdamW over the rest (biases, the norm, the head)."""
    head = model[-1].weight
    matrices = [p for p in model.parameters() if p.dim() == 2 and p is not head]
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    return torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=0.01, weight_decay=0.01)


class _Both:
    """What the small loop steps: both optimizers (AdamW alone in step ONLY_ADAMW), then zero both."""

    def __init__(self, optimizers) -> None:
        self.optimizers, self.step_index = optimizers, 0

    def step(self) -> None:
        muon, adamw = self.optimizers
        if self.step_index != ONLY_ADAMW:
            muon.step()
        adamw.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad()


def _train(layout: tuple[str, int] | None, *, steps: range = range(STEPS), load: str | None = None,
           save: str | None = None) -> RunResult:
    sharded = layout is not None
    world, rank = (dist.get_world_size(), dist.get_rank()) if sharded else (1, 0)
    model = _model()
    optimizers = _recipe(model)
    if sharded:
        strategy, stage = layout
        passed = optimizers if strategy == "chunk" else list(optimizers)  # a tuple or a list: mirrored
        model, returned = shard(model, passed, config=ZeroConfig(stage=stage, strategy=strategy))
        assert returned is passed and all(a is b for a, b in zip(returned, optimizers))
    if load is not None:
        load_checkpoint(model, optimizers, load)
    both = _Both(optimizers)
    losses = []
    for step in steps:
        both.step_index = step
        losses.append(train_step(model, both, step, features=7, world=world, rank=rank))
    params = full_params(model)
    if save is not None:
        save_checkpoint(model, optimizers, save)
    if sharded:
        model.close()
    return RunResult(losses, params)


def _all_layouts() -> dict[tuple[str, int], RunResult]:
    return {layout: _train(layout) for layout in LAYOUTS}


def _max_error(reference: RunResult, result: RunResult) -> float:
    """The largest difference, relative to each tensor's largest magnitude (assert_parity's measure)."""
    return max((result.params[n] - p).abs().max().item() / max(p.abs().max().item(), 1e-12)
               for n, p in reference.params.items())


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_muon_recipe_trains_as_in_one_process(world):
    reference = _train(None)
    worst = 0.0
    for rank, runs in enumerate(run_distributed(_all_layouts, world, timeout=300)):
        for (strategy, stage), result in runs.items():
            assert_parity(reference, result, rtol=RTOL, label=f"{strategy} stage {stage}, rank {rank} of {world}:")
            worst = max(worst, _max_error(reference, result))
    print(f"world {world}: largest relative parameter difference {worst:.3g}")


def _save_then_resume(directory: str, phase: str) -> dict[str, object]:
    if phase == "save":  # 2 steps at 2 ranks, chunked stage 3
        return {"run": _train(("chunk", 3), steps=range(2), save=directory)}
    # the last 2 at 4 ranks, tensor strategy stage 2: other owners, other pieces
    out: dict[str, object] = {"run": _train(("tensor", 2), steps=range(2, STEPS), load=directory)}
    model = _model()
    muon, adamw = _recipe(model)
    model, _ = shard(model, (muon, adamw))
    for name, given in (("one", muon), ("reversed", (adamw, muon))):
        try:
            load_checkpoint(model, given, directory)
        except CheckpointError as exc:
            out[name] = str(exc)
    model.close()
    model = _model()
    model, adamw = shard(model, torch.optim.AdamW(model.parameters()))
    try:  # both optimizers' states cannot become one optimizer's
        load_checkpoint(model, adamw, directory)
    except CheckpointError as exc:
        out["single"] = str(exc)
    load_checkpoint(model, None, directory)  # the parameters alone load
    model.close()
    return out


def test_a_checkpoint_of_both_resumes_at_another_world_size(tmp_path):
    reference = _train(None)
    run_distributed(_save_then_resume, 2, str(tmp_path), "save", timeout=120)
    for rank, out in enumerate(run_distributed(_save_then_resume, 4, str(tmp_path), "load", timeout=120)):
        assert_parity(RunResult(reference.losses[2:], reference.params), out["run"], rtol=RTOL, label=f"rank {rank}:")
        assert "pass all of them" in out["one"], out
        assert "sharded with 2 optimizers" in out["reversed"] or "element-wise" in out["reversed"], out
        assert "saved with 2 optimizer(s)" in out["single"], out


def _left_out() -> dict[object, object]:
    """Each kind of optimizer built before shard() and not passed to it, at every stage: its first step's error.
    And, with both optimizers passed (the same spawn), an fp16 overflow and ranks that step different ones."""
    out: dict[object, object] = {"overflow": _overflow(), "diverged": _diverged()}
    for kind in ("adamw", "adafactor"):
        for stage in (1, 2, 3):
            model = _model()
            muon, adamw = _recipe(model)
            other = adamw if kind == "adamw" else torch.optim.Adafactor(list(adamw.param_groups[0]["params"]))
            model, _ = shard(model, muon, config=ZeroConfig(stage=stage))
            model(torch.randn(4, 7)).sum().backward()
            muon.step()
            try:
                other.step()
                out[kind, stage] = "stepped"
            except ZeroError as exc:
                out[kind, stage] = str(exc)
            model.close()
    return out


def _overflow() -> dict[str, object]:
    """A first scale so large that the first backward overflows: both optimizers skip, the scale halves once."""
    model = _model()
    muon, adamw = _recipe(model)
    config = ZeroConfig(stage=3, precision=Precision(compute="fp16", loss_scale=LossScale(init_scale=2.0**40,
                                                                                          hysteresis=1)))
    model, _ = shard(model, (muon, adamw), config=config)
    before = full_params(model)
    model.backward(model(torch.randn(4, 7)).float().sum())
    muon.step()
    adamw.step()
    out: dict[str, object] = {"unchanged": all(torch.equal(before[n], p) for n, p in full_params(model).items()),
                              "scale": model.loss_scaler.scale}
    try:  # a second step of the same optimizer without a backward is refused, as with one optimizer
        muon.step()
    except ZeroError as exc:
        out["again"] = str(exc)
    model.close()
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[object, object]]:
    """One spawn at 2 ranks for the tests below."""
    return run_distributed(_left_out, 2, timeout=120)


def test_an_fp16_overflow_skips_both_optimizers_and_moves_the_scale_once(two_ranks):
    for out in two_ranks:
        overflow = out["overflow"]
        assert overflow["unchanged"] and overflow["scale"] == 2.0**39, overflow
        assert "were not loss-scaled" in overflow.get("again", ""), overflow


def _diverged() -> str:
    """Rank 0 steps Muon while rank 1 steps AdamW."""
    model = _model()
    muon, adamw = _recipe(model)
    model, _ = shard(model, (muon, adamw))
    model(torch.randn(4, 7)).sum().backward()
    try:
        (muon if dist.get_rank() == 0 else adamw).step()
        return "stepped"
    except RanksOutOfStepError as exc:
        return str(exc)
    finally:
        model.close()


def test_ranks_stepping_different_optimizers_raise_on_every_rank(two_ranks):
    for out in two_ranks:
        assert "optimizer 0 (Muon)" in out["diverged"] and "optimizer 1 (AdamW)" in out["diverged"], out["diverged"]


def test_an_optimizer_left_out_of_shard_is_refused_at_its_first_step(two_ranks):
    for out in two_ranks:
        messages = {k: v for k, v in out.items() if k not in ("overflow", "diverged")}
        assert len(messages) == 6
        for (kind, stage), message in messages.items():
            assert "pass it to shard() together: shard(model, (opt_a, opt_b))" in message, (kind, stage, message)
            assert "as it was before zero_core.shard replaced it" in message, message


def test_what_several_optimizers_cannot_do_is_refused_at_shard():
    model = _model()
    muon, adamw = _recipe(model)
    with pytest.raises(ConfigError, match="placement='device'"):
        shard(model, (torch.optim.AdamW(muon.param_groups[0]["params"]), adamw), config=ZeroConfig(placement="host"))
    with pytest.raises(ZeroSetupError, match="each parameter may be stepped by one optimizer only"):
        shard(model, (muon, torch.optim.AdamW(model.parameters())))
    with pytest.raises(ZeroSetupError, match="the same optimizer twice"):
        shard(model, (adamw, adamw))
    with pytest.raises(ZeroSetupError, match="needs a torch.optim.Optimizer"):
        shard(model, (adamw, "muon"))
