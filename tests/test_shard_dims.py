"""Parameters cut along a later dimension (``Shard(d)``, see [Note: shard dimension] in zero_core.chunks._slots).

The zoo's ``fused_experts`` model (three experts fused into one ``(3, 8, 8)`` weight and a
one-row position table) trains as in one process at every stage, strategy, world size and
precision in ``test_parity.py``. Here: what users see of the placement, and everything that
reads pieces by their elements: zero's checkpoints across world sizes and strategies (and
``zero consolidate``), ``torch.distributed.checkpoint``, state dicts, and a whole-matrix
optimizer (Muon).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _small_loop import full_params, train_step
from safetensors.torch import load_file
from test_checkpoint import K, _assert_close, _run
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from zero_core import ChunkPolicy, ZeroConfig, shard
from zero_core.checkpoint._consolidate import consolidate
from zero_core.testing import full_value, get_case, run_distributed
from zero_core.testing.checkpointing import phase

CASE = "fused_experts"


def _config(strategy="chunk", stage=3):
    return ZeroConfig(strategy=strategy, stage=stage, chunk=ChunkPolicy(chunk_size=100 if strategy == "chunk" else None))


def _placements(stage: int, path: str) -> dict:
    """The placements users see, a state dict round trip, and a torch.distributed.checkpoint save (in ``path``)."""
    torch.manual_seed(0)
    case = get_case(CASE)
    model = case.build()
    model, opt = shard(model, torch.optim.AdamW(model.parameters(), lr=0.01), config=_config(stage=stage))
    x, y = case.batch(0, 8)
    rank, world = dist.get_rank(), dist.get_world_size()
    case.loss(model(x[rank::world]), y[rank::world]).backward()
    opt.step()
    opt.zero_grad()
    experts, pos = model.experts, model.pos
    out = {"experts": (experts.placements, tuple(experts.to_local().shape)),
           "pos": (pos.placements, tuple(pos.to_local().shape)),
           "state": {k: v.placements for k, v in opt.state[experts].items() if isinstance(v, DTensor)}}
    # a plain full state dict loads into the shards: every rank takes its columns of the experts
    full = {k: full_value(v) for k, v in model.state_dict().items()}
    doubled = {k: 2 * v for k, v in full.items()}
    model.load_state_dict(doubled)
    out["reloaded"] = all(torch.equal(full_value(v), doubled[k]) for k, v in model.state_dict().items())
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    out["full"] = {k: full_value(v) for k, v in model.state_dict().items()}
    model.close()
    return out


def _dcp_load(path: str) -> dict:
    torch.manual_seed(1)
    case = get_case(CASE)
    model = case.build()
    model, _ = shard(model, torch.optim.AdamW(model.parameters(), lr=0.01), config=_config(strategy="tensor"))
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    full = {k: full_value(v) for k, v in model.state_dict().items()}
    model.close()
    return full


@pytest.mark.parametrize("stage", [1, 3])
def test_fused_experts_are_dtensors_sharded_along_dim_1_that_round_trip_everywhere(stage, tmp_path):
    path = str(tmp_path / "dcp")
    saved = run_distributed(_placements, 2, stage, path)
    for result in saved:
        # (3, 8, 8) over 2 ranks: dim 0 would pad a fourth expert (33%); dim 1 cuts 4 of the 8 rows per rank
        assert result["experts"] == ((Shard(1),), (3, 4, 8))
        assert result["pos"] == ((Shard(1),), (1, 4))  # (1, 8): one row, cut along its 8 columns
        assert result["state"] == {"exp_avg": (Shard(1),), "exp_avg_sq": (Shard(1),)}
        assert result["reloaded"]
    # torch.distributed.checkpoint reshards it to 4 ranks of the tensor strategy (dim 1 again: 2 rows each)
    for loaded in run_distributed(_dcp_load, 4, path):
        for name, value in saved[0]["full"].items():
            assert torch.equal(loaded[name], value), name


@pytest.mark.parametrize(("saved", "loaded", "after"), [(2, 4, "chunk"), (4, 1, "chunk"), (2, 2, "tensor")])
def test_zero_checkpoints_of_strided_pieces_reshard(saved, loaded, after, tmp_path):
    reference = _run(saved, CASE, _config(), tmp_path, "save")
    metadata = json.loads((tmp_path / "zero_checkpoint.json").read_text())
    # strided pieces: [rank, lo, hi, stride, count], which only version 2 readers understand
    assert metadata["version"] == 2
    assert [p[3:] for p in metadata["params"]["experts"]["pieces"]] == [[64, 3]] * saved
    _assert_close(_run(loaded, CASE, _config(after), tmp_path, "load"), reference, bitwise=False)
    if saved == 2:  # `zero consolidate` reads them into the whole parameters the checkpoint holds
        consolidate(tmp_path, tmp_path / "out", single_file=True)
        weights = load_file(tmp_path / "out" / "model.safetensors")
        at_save = run_distributed(phase, 1, CASE, _config(), str(tmp_path), mode="load", k=K, j=0)[0]["params"]
        assert set(weights) == set(at_save)
        for name, value in at_save.items():
            assert torch.equal(weights[name], value), name


def _muon(world_size: int | None) -> object:
    torch.manual_seed(0)
    # Linear(8, 3)'s weight is (3, 8): over 2 or 4 ranks it is cut along dim 1
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 3, bias=False))
    opt = torch.optim.Muon(model.parameters(), lr=0.02, weight_decay=0.01)
    world, rank = (dist.get_world_size(), dist.get_rank()) if world_size else (1, 0)
    if world_size:
        model, opt = shard(model, opt, config=ZeroConfig(stage=3))
        assert model[2].weight.placements == (Shard(1),)
    losses = [train_step(model, opt, step, features=8, world=world, rank=rank) for step in range(3)]
    return losses, full_params(model)


@pytest.mark.parametrize("world", [2, 4])
def test_muon_steps_a_matrix_cut_along_dim_1_whole(world):
    ref_losses, ref_params = _muon(None)
    for losses, params in run_distributed(_muon, world, world):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, value in ref_params.items():
            assert torch.allclose(params[name], value, rtol=1e-5, atol=1e-6), name


def test_a_checkpoint_format_this_zero_does_not_read_is_refused_by_name(tmp_path):
    from zero_core import CheckpointError
    from zero_core.checkpoint._checkpoint import FORMAT, read_metadata

    (tmp_path / "zero_checkpoint.json").write_text(json.dumps({"format": FORMAT, "version": 3}))
    with pytest.raises(CheckpointError, match="format version 3; this zero reads versions 1, 2"):
        read_metadata(tmp_path)
