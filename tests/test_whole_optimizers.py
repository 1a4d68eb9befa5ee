"""Whole-tensor optimizers (Muon, Adafactor) train as in one process: each parameter stepped whole on its owner.

See [Note: whole-tensor optimizer steps] in ``zero_core.runtime._whole_step``. One spawn per world size runs
every stage and strategy for both optimizers, each against the same code in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _small_loop import full_params, train_step
from torch import nn

from zero_core import CheckpointError, ChunkPolicy, ConfigError, LossScale, Precision, ZeroConfig, ZeroError, load_checkpoint, save_checkpoint, shard
from zero_core.runtime._whole_step import assign_owners
from zero_core.testing import RunResult, assert_parity, run_distributed, train_reference, train_sharded

STEPS = 4
# (strategy, stage): every stage of both strategies
LAYOUTS = [(strategy, stage) for strategy in ("chunk", "tensor") for stage in (1, 2, 3)]


def _model(biases: bool) -> nn.Module:
    torch.manual_seed(0)
    # prime widths: no world size divides a parameter, so pieces are padded and some ranks hold no rows
    return nn.Sequential(nn.Linear(7, 13, bias=biases), nn.Tanh(), nn.Linear(13, 11, bias=biases), nn.Tanh(),
                         nn.Linear(11, 3, bias=biases))


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "muon":
        return torch.optim.Muon(params, lr=0.02, weight_decay=0.01)
    return torch.optim.Adafactor(params, lr=0.01, weight_decay=0.01)


def _train(name: str, layout: tuple[str, int] | None, *, steps: range = range(STEPS), load: str | None = None,
           save: str | None = None) -> tuple[RunResult, dict[str, dict[str, int]]]:
    sharded = layout is not None
    world, rank = (dist.get_world_size(), dist.get_rank()) if sharded else (1, 0)
    model = _model(biases=name == "adafactor")  # Muon takes matrices only, as in one process
    opt = _optimizer(name, model.parameters())
    if sharded:
        strategy, stage = layout
        model, opt = shard(model, opt, config=ZeroConfig(stage=stage, strategy=strategy))
    if load is not None:
        load_checkpoint(model, opt, load)
    losses = [train_step(model, opt, step, features=7, world=world, rank=rank) for step in steps]
    counts = model.comm_stats.summary() if sharded else {}
    params = full_params(model)
    if save is not None:
        save_checkpoint(model, opt, save)
    if sharded:
        model.close()
    return RunResult(losses, params), counts


def _all_layouts() -> dict[tuple[str, str, int], tuple[RunResult, dict]]:
    return {(name, *layout): _train(name, layout) for name in ("muon", "adafactor") for layout in LAYOUTS}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_muon_and_adafactor_train_as_in_one_process(world):
    references = {name: _train(name, None)[0] for name in ("muon", "adafactor")}
    for rank, runs in enumerate(run_distributed(_all_layouts, world, timeout=300)):
        for (name, strategy, stage), (result, counts) in runs.items():
            assert_parity(references[name], result, label=f"{name} {strategy} stage {stage}, rank {rank} of {world}:")
            if world > 1:
                assert counts["all_to_all"]["calls"] == 3, counts


def _expected_all_to_all_bytes(world: int, rank: int) -> int:
    """Three all-to-alls of fp32 pieces: values and gradients to the owners, values back (see the Note)."""
    shapes = [(13, 7), (11, 13), (3, 11)]
    pieces = [-(-rows // world) * cols for rows, cols in shapes]
    owners = assign_owners([rows * cols for rows, cols in shapes], world)
    splits = [sum(p for p, o in zip(pieces, owners) if o == r) for r in range(world)]
    to_owners = sum(splits) - splits[rank]  # all but this rank's own share leave it
    back = (world - 1) * splits[rank]  # the owner sends each other rank its pieces
    return 4 * (2 * to_owners + back)


def _counted() -> dict[str, dict[str, int]]:
    return _train("muon", ("chunk", 3))[1]


@pytest.mark.parametrize("world", [2, 4])
def test_whole_steps_send_exactly_the_pieces(world):
    for rank, counts in enumerate(run_distributed(_counted, world, timeout=120)):
        assert counts["all_to_all"] == {"calls": 3, "bytes_sent": _expected_all_to_all_bytes(world, rank)}


def test_owners_are_balanced_and_deterministic():
    assert assign_owners([10, 30, 20, 5], 2) == [1, 0, 1, 0]  # 30 -> 0, 20 -> 1, 10 -> 1 (30 each), 5 -> 0 (tie)
    assert assign_owners([4, 4, 4], 4) == [0, 1, 2]
    assert assign_owners([], 3) == []


def _save_then_resume(directory: str, phase: str) -> dict[str, RunResult]:
    out = {}
    for name in ("muon", "adafactor"):
        path = f"{directory}/{name}"
        if phase == "save":  # 2 steps at 2 ranks, chunked stage 3
            out[name] = _train(name, ("chunk", 3), steps=range(2), save=path)[0]
        else:  # the last 2 at 4 ranks, tensor strategy stage 2: other owners, other pieces
            out[name] = _train(name, ("tensor", 2), steps=range(2, STEPS), load=path)[0]
    if phase == "load":  # whole-tensor states cannot become an element-wise optimizer's
        model = _model(biases=False)
        model, opt = shard(model, torch.optim.AdamW(model.parameters()))
        try:
            load_checkpoint(model, opt, f"{directory}/muon")
        except CheckpointError as exc:
            out["adamw"] = str(exc)
        load_checkpoint(model, None, f"{directory}/muon")  # the parameters alone load
        model.close()
    return out


def test_a_checkpoint_resumes_at_another_world_size_and_strategy(tmp_path):
    references = {name: _train(name, None)[0] for name in ("muon", "adafactor")}
    run_distributed(_save_then_resume, 2, str(tmp_path), "save", timeout=120)
    for rank, runs in enumerate(run_distributed(_save_then_resume, 4, str(tmp_path), "load", timeout=120)):
        assert "holds the states of an optimizer stepped whole per parameter" in runs.pop("adamw", "")
        for name, result in runs.items():
            reference = references[name]
            assert_parity(RunResult(reference.losses[2:], reference.params), result, label=f"{name} rank {rank}:")


def test_whole_tensor_optimizers_are_refused_where_their_layout_does_not_hold():
    model = _model(biases=False)
    with pytest.raises(ConfigError, match="declares Muon element-wise"):
        shard(model, torch.optim.Muon(model.parameters()), config=ZeroConfig(optimizer_updates="elementwise"))
    with pytest.raises(ConfigError, match="placement='device'"):
        shard(model, torch.optim.Muon(model.parameters()), config=ZeroConfig(placement="host"))


@pytest.mark.parametrize("compute", [
    Precision(compute="bf16"),
    # a first scale so large that the first step overflows: skipped on every rank with nothing to step whole
    Precision(compute="fp16", loss_scale=LossScale(init_scale=2.0**40, hysteresis=1)),
], ids=["bf16", "fp16-overflow"])
def test_16bit_compute_with_a_whole_tensor_optimizer_matches_the_16bit_reference(compute):
    config = ZeroConfig(stage=3, precision=compute, chunk=ChunkPolicy(chunk_size=300))
    results = run_distributed(train_sharded, 2, "gpt", config=config, optimizer="adafactor")
    reference = train_reference("gpt", precision=compute, world=2, optimizer="adafactor")
    if compute.loss_scale is not None:
        assert min(reference.scales) < 2.0**40 and results[0].scales == reference.scales  # the overflow happened
    for rank, result in enumerate(results):
        assert_parity(reference, result, rtol=1e-3, label=f"rank {rank}:")


def _unregistered(recipe: str) -> str:
    model = _model(biases=False)
    model, _ = shard(model, torch.optim.Muon(model.parameters(), lr=0.02))
    # FSDP2's recipe (an optimizer built after sharding), or a second optimizer over some of the parameters
    other = torch.optim.Muon(model.parameters(), lr=0.02) if recipe == "rebuilt" else \
        torch.optim.Adafactor([next(model.parameters())])
    x = torch.randn(4, 7)
    model(x).sum().backward()
    try:
        other.step()
    except ZeroError as exc:
        return str(exc)
    finally:
        model.close()
    return "stepped"


@pytest.mark.parametrize("recipe", ["rebuilt", "second"])
def test_a_whole_tensor_optimizer_not_given_to_shard_is_refused_at_its_step(recipe):
    message = run_distributed(_unregistered, 2, recipe, timeout=120)[0]
    assert "without having been passed to zero_core.shard" in message, message
    assert ("Muon orthogonalises" if recipe == "rebuilt" else "Adafactor factors") in message
