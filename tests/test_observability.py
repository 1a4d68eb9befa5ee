"""Every phase of zero's work is a ``ZeRO::<phase>`` range in ``torch.profiler`` traces and, with the ``zero`` logger
at DEBUG, a log line; with neither watching, nothing is logged. See [Note: phase ranges] in ``zero_core.base._trace``."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import zero_core
from zero_core import ChunkPolicy, ZeroConfig, lazy_init, shard
from zero_core.base import _trace
from zero_core.base._trace import PHASES
from zero_core.testing import device_under_test, run_distributed
from zero_core.testing.zoo import get_case

ROOT = Path(__file__).resolve().parents[1]
CASE = get_case("gpt")
# The phases every training step opens, at any stage, placement or world size.
STEP_PHASES = {_trace.ROOT_PRE_FORWARD, _trace.ROOT_POST_FORWARD, _trace.PRE_BACKWARD,
               _trace.REDUCE_SCATTER, _trace.POST_BACKWARD, _trace.REDUCE_WAIT, _trace.PRE_STEP, _trace.POST_STEP}
# Stage 3 over several ranks gathers in forward and backward and releases after forward; one rank keeps every chunk
# gathered (its units are kept: no forward hook, see [Note: kept units] in zero_core.runtime._unit), and refreshes it
# after each step (as stages 1 and 2 do).
GATHER_PHASES = {_trace.PRE_FORWARD, _trace.ALL_GATHER, _trace.POST_FORWARD}
ONE_RANK_STEP_PHASES = STEP_PHASES | {_trace.REFRESH_PARAMETERS}
# What test_two_ranks_open_each_range_once_per_unit_or_step checks instead of the one-rank test.
TWO_RANK_PHASES = GATHER_PHASES | {_trace.REFRESH_GROUP_SHARDS}


def _build(config: ZeroConfig, *, lazy: bool = False):
    torch.manual_seed(0)
    if lazy:
        with lazy_init():
            model = CASE.build()
    else:
        model = CASE.build()
    return shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)


def _step(model, optimizer, batch: int = 4) -> None:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    inputs, targets = CASE.batch(0, batch * world)
    part = slice(rank * batch, (rank + 1) * batch)
    device = next(model.parameters()).device
    optimizer.zero_grad()
    model.backward(CASE.loss(model(inputs[part].to(device)), targets[part].to(device)))
    optimizer.step()


def _ranges(prof) -> set[str]:
    return {event.name for event in prof.events() if event.name.startswith("ZeRO::")}


def _config(**kwargs) -> ZeroConfig:
    return ZeroConfig(chunk=ChunkPolicy(chunk_size=CASE.chunk_size), **kwargs)


def test_every_phase_of_one_rank_is_a_profiler_range(tmp_path):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model, optimizer = _build(_config(stage=3), lazy=True)
        _step(model, optimizer)
        model.full_state_dict()
        zero_core.save_full_state_dict(model, tmp_path / "weights.safetensors")
        model.load_full_state_dict(tmp_path / "weights.safetensors")
        zero_core.save_checkpoint(model, optimizer, tmp_path / "ckpt")
        zero_core.load_checkpoint(model, optimizer, tmp_path / "ckpt")
        model.close()
        model, optimizer = _build(_config(stage=3, placement="static", placement_options={"offload_optim_frac": 1.0}))
        _step(model, optimizer)  # a placement policy steps its host tier early
        model.close()
    seen = _ranges(prof)
    assert set(PHASES) - TWO_RANK_PHASES <= seen, sorted(set(PHASES) - TWO_RANK_PHASES - seen)
    assert seen <= set(PHASES), f"ranges outside zero_core.base._trace.PHASES: {sorted(seen - set(PHASES))}"


def test_debug_logs_each_phase_and_nothing_by_default(caplog):
    model, optimizer = _build(_config(stage=3))
    assert not logging.getLogger("zero.core.phase").isEnabledFor(logging.DEBUG)  # off unless asked for
    _step(model, optimizer)  # caplog's handler takes every record the loggers emit at their default levels
    assert not [r for r in caplog.records if r.name.startswith("zero")], [r.getMessage() for r in caplog.records]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="zero"):
        _step(model, optimizer)
    model.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "zero.core.phase"]
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "zero.core.phase")
    assert {line.split()[0] for line in lines} == ONE_RANK_STEP_PHASES, lines
    reductions = [line for line in lines if line.startswith(_trace.REDUCE_SCATTER)]
    assert len(reductions) == len(model.engine.reducer.order), lines  # one line per chunk, naming it
    assert all(re.fullmatch(r"ZeRO::reduce_scatter chunk \d+", line) for line in reductions), reductions
    # the backward's start; at one rank no unit gathers for its backward (every unit is kept), so it is the only one
    assert [line for line in lines if line.startswith(_trace.PRE_BACKWARD)] == [_trace.PRE_BACKWARD], lines


def test_the_phase_logger_can_be_silenced_alone(caplog):
    model, optimizer = _build(_config(stage=3))
    quiet = logging.getLogger("zero.core.phase")
    quiet.setLevel(logging.INFO)
    try:
        with caplog.at_level(logging.DEBUG, logger="zero"):
            _step(model, optimizer)
    finally:
        quiet.setLevel(logging.NOTSET)
        model.close()
    assert not [r for r in caplog.records if r.name == "zero.core.phase"]


def _profiled_ranks() -> dict[str, dict[str, int]]:
    """Per configuration, how often one step (after a first) opens each ``ZeRO::`` range; plus the model's counts."""
    seen = {}
    for label, config, mesh_shape in [("stage 3", _config(), None),
                                      ("optimizer across replicas", _config(shard_optimizer_across_replicas=True),
                                       (2, 1))]:
        mesh = None
        if mesh_shape is not None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device_under_test(), mesh_shape, mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        built = CASE.build()
        model, optimizer = shard(built, torch.optim.AdamW(built.parameters(), lr=1e-3), config=config, mesh=mesh)
        _step(model, optimizer)  # the first step builds what later steps reuse
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(model, optimizer)
        counts = {"units": len(model.engine._module_hooks._handles) // 2,  # a pre- and a post-forward hook per unit
                  "parameters": sum(len(chunk.slots) for chunk in model.engine.chunks),
                  "reduced chunks": len(model.engine.reducer.order)}
        for event in prof.events():
            if event.name.startswith("ZeRO::"):
                counts[event.name] = counts.get(event.name, 0) + 1
        model.close()
        seen[label] = counts
    return seen


def test_two_ranks_open_each_range_once_per_unit_or_step():
    results = run_distributed(_profiled_ranks, 2, timeout=120)
    assert results[0] == results[1]
    for label, counts in results[0].items():
        assert STEP_PHASES <= set(counts), (label, sorted(STEP_PHASES - set(counts)))
        assert set(counts) - {"units", "parameters", "reduced chunks"} <= set(PHASES), (label, counts)
    assert GATHER_PHASES <= set(results[0]["stage 3"])
    counts = results[0]["stage 3"]
    units, params = counts["units"], counts["parameters"]
    assert counts[_trace.POST_FORWARD] == units, counts
    assert 0 < counts[_trace.PRE_FORWARD] <= units, counts  # a unit whose chunks another unit gathered opens none
    assert counts[_trace.ALL_GATHER] <= 2 * units, counts  # forward and backward
    assert counts[_trace.PRE_BACKWARD] <= units + 1 < params, counts  # each unit's outputs, and the backward's start
    assert counts[_trace.REDUCE_SCATTER] == counts["reduced chunks"], counts
    for once in (_trace.ROOT_PRE_FORWARD, _trace.ROOT_POST_FORWARD, _trace.POST_BACKWARD, _trace.REDUCE_WAIT,
                 _trace.PRE_STEP, _trace.POST_STEP):
        assert counts[once] == 1, (once, counts)
    assert _trace.REFRESH_GROUP_SHARDS in results[0]["optimizer across replicas"]


def test_the_docs_list_every_phase():
    page = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"`(ZeRO::\w+)`", page))
    assert listed == set(PHASES), (sorted(set(PHASES) - listed), sorted(listed - set(PHASES)))
