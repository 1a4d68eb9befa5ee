"""Two-dimension cuts on meshes with more than one replica (see [Note: two-dimension cut] in zero_core.chunks._slots).

8 gloo ranks as HSDP's 2 replicas of a shard group of 4: the shard group cuts ``GridNet``'s three grid parameters
(tests/test_grid_cut.py) as a 2 x 2 grid, ``(Replicate(), Shard(0), Shard(d))`` on a ``(2, 2, 2)`` mesh over
the 8 ranks. With ``shard_optimizer_across_replicas=True`` the cut is over all 8 ranks instead, where the
``(12, 10)`` matrix ``wide`` (exact over 4 ranks) is a 4 x 2 grid whose rows span both replicas.

One spawn of 8 ranks trains each of ``RUNS`` (AdamW, torch's own ``clip_grad_norm_``, each rank on its own
eighth of every batch) at parity with one process on the whole batch (fp32, 1e-5 as tests/test_parity.py:
losses, norms and every parameter's ``full_tensor()``), and checks the placements, each rank's piece (the
grid block of its place; the same in both replicas under HSDP) and the state dict. The first run saves a
zero checkpoint and a DCP one, which one spawn of 4 ranks loads (each of ``LOADS``, and DCP once) and trains
on at parity.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_grid_cut import GRID, GridNet, dcp_loaded, train_clipped
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from zero_core import ChunkPolicy, ZeroConfig, load_checkpoint, save_checkpoint, shard
from zero_core.testing import full_value, run_distributed

BATCH, STEPS, MORE = 24, 3, 2  # STEPS at 8 ranks, then MORE after loading the checkpoint
# (strategy, stage, shard_optimizer_across_replicas) on the (2, 4) HSDP mesh; the first saves the checkpoints
RUNS = (("chunk", 3, False), ("tensor", 2, False), ("chunk", 2, False), ("tensor", 3, False), ("chunk", 3, True))
# where the checkpoint is loaded, by (mesh shape, across): 4 ranks without replicas (the same 2 x 2 grid), HSDP 2 x 2
# (a shard group of 2: no grid) and HSDP 2 x 2 cut across the replicas (over all 4 ranks: the 2 x 2 grid again)
LOADS = {"4": (None, False), "2x2": ((2, 2), False), "2x2 across": ((2, 2), True)}
HSDP = [[0, 1, 2, 3], [4, 5, 6, 7]]


class HsdpGridNet(GridNet):
    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Parameter(0.2 * torch.randn(12, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (torch.tanh(x @ self.wide[:6]) @ self.wide[6:].T)[:, :3]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(70 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int = 0,
           world: int = 1) -> tuple[list[float], list[float]]:
    return train_clipped(model, opt, steps, rank, world, _batch)


def _build(strategy: str = "chunk", stage: int = 3, across: bool = False, mesh_shape: tuple[int, int] | None = None):
    torch.manual_seed(0)
    model = HsdpGridNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    if not dist.is_initialized():
        return model, opt
    mesh = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    config = ZeroConfig(strategy=strategy, stage=stage, shard_optimizer_across_replicas=across,
                        chunk=ChunkPolicy(chunk_size=200 if strategy == "chunk" else None))
    return shard(model, opt, config=config, mesh=mesh)


def _eight(path: str) -> dict:
    rank = dist.get_rank()
    out: dict = {}
    for run in RUNS:
        model, opt = _build(*run, mesh_shape=(2, 4))
        trained = _train(model, opt, range(STEPS), rank, 8)
        params = dict(model.named_parameters())
        out[run] = {"trained": trained,
                    "params": {n: full_value(p) for n, p in params.items()},
                    "local": {n: p.to_local().detach().clone() for n, p in params.items()},
                    "placements": {n: (tuple(p.placements), p.device_mesh.mesh.tolist()) for n, p in params.items()},
                    "exp_avg": {n: full_value(opt.state[p]["exp_avg"]) for n, p in params.items()},
                    "state_dict": {k: full_value(v) for k, v in model.state_dict().items()}}
        if run == RUNS[0]:
            save_checkpoint(model, opt, f"{path}/zero")
            dcp.save({"model": model.state_dict()}, checkpoint_id=f"{path}/dcp")
        model.close()
    return out


def _four(path: str) -> dict:
    """The 8 ranks' checkpoints loaded at 4 ranks: zero's at each of ``LOADS``, trained on; DCP's without replicas."""
    rank = dist.get_rank()
    out: dict = {}
    for label, (mesh_shape, across) in LOADS.items():
        model, opt = _build(across=across, mesh_shape=mesh_shape)
        load_checkpoint(model, opt, f"{path}/zero")
        params = dict(model.named_parameters())
        out[label] = {"loaded": {n: full_value(p) for n, p in params.items()},
                      # at 4 ranks, rank 3 holds no rows of mid.bias, out.weight, out.bias: empty states, loaded too
                      "state": {n: (full_value(opt.state[p]["exp_avg"]), opt.state[p]["step"].item())
                                for n, p in params.items()},
                      "placements": {n: tuple(p.placements) for n, p in params.items()},
                      "trained": _train(model, opt, range(STEPS, STEPS + MORE), rank, 4)}
        out[label]["params"] = {n: full_value(p) for n, p in params.items()}
        model.close()
    out["dcp"] = dcp_loaded(f"{path}/dcp", lambda: _build("tensor", 2))
    return out


def _block(full: torch.Tensor, dim2: int, grid: tuple[int, int], place: int) -> torch.Tensor:
    """The piece of an ``(a, b)`` grid at ``place`` (row ``place // b`` of dim 0, column ``place % b`` of ``dim2``)."""
    a, b = grid
    return full.chunk(a, 0)[place // b].chunk(b, dim2)[place % b]


def test_a_grid_trains_at_parity_with_two_replicas_and_its_checkpoints_load_at_four_ranks(tmp_path):
    model, opt = _build()
    reference = _train(model, opt, range(STEPS))
    ref_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    more = _train(model, opt, range(STEPS, STEPS + MORE))
    ref_final = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert min(reference[1] + more[1]) > 0.05  # the clip bites at every step

    results = run_distributed(_eight, 8, str(tmp_path), timeout=300)
    for rank, result in enumerate(results):
        for run_id in RUNS:
            run, across = result[run_id], run_id[2]
            assert run["trained"] == (pytest.approx(reference[0], rel=1e-5), pytest.approx(reference[1], rel=1e-5)), \
                (rank, run_id)
            for name, value in ref_params.items():
                assert torch.allclose(run["params"][name], value, rtol=1e-5, atol=1e-6), (rank, run_id, name)
            assert all(torch.equal(run["state_dict"][n], v) for n, v in run["params"].items()), (rank, run_id)
            placements = run["placements"]
            if across:  # cut over all 8 ranks: only wide is a grid, (4, 2), its rows across the replicas
                assert placements["wide"] == ((Shard(0), Shard(1)), [[0, 1], [2, 3], [4, 5], [6, 7]])
                assert torch.equal(run["local"]["wide"], _block(run["params"]["wide"], 1, (4, 2), rank)), rank
                continue
            for name, (_, dim2) in GRID.items():  # the grid of the shard group; each rank's piece is its block
                assert placements[name] == ((Replicate(), Shard(0), Shard(dim2)), [[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
                assert torch.equal(run["local"][name], _block(run["params"][name], dim2, (2, 2), rank % 4)), name
            # (3, 6) no grid divides over 4 ranks (dim 0, padded), and (12, 10) dim 0 does: the HSDP mesh itself
            assert placements["out.weight"] == placements["wide"] == ((Replicate(), Shard(0)), HSDP), run_id
            twin = results[(rank + 4) % 8][run_id]  # the other replica's rank at the same place: the same pieces
            assert all(torch.equal(v, twin["local"][n]) for n, v in run["local"].items()), (rank, run_id)

    saved = results[0][RUNS[0]]
    resumed = run_distributed(_four, 4, str(tmp_path), timeout=300)
    for rank, result in enumerate(resumed):
        assert all(torch.equal(v, saved["params"][n]) for n, v in result.pop("dcp").items()), rank
        for label, run in result.items():
            assert all(torch.equal(v, saved["params"][n]) for n, v in run["loaded"].items()), (rank, label)
            for name, (exp_avg, step) in run["state"].items():
                assert torch.equal(exp_avg, saved["exp_avg"][name]) and step == STEPS, (rank, label, name)
            for name, (_, dim2) in GRID.items():
                grid = (Replicate(), Shard(0)) if label == "2x2" else (Shard(0), Shard(dim2))
                assert run["placements"][name] == grid, (label, name)
            assert run["trained"] == (pytest.approx(more[0], rel=1e-5), pytest.approx(more[1], rel=1e-5)), (rank, label)
            for name, value in ref_final.items():
                assert torch.allclose(run["params"][name], value, rtol=1e-5, atol=1e-6), (rank, label, name)
