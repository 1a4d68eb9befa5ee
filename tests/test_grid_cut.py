"""Parameters cut in two dimensions (see [Note: two-dimension cut] in zero_core.chunks._slots).

A ``(6, 10)`` matrix over 4 ranks has no dimension 4 divides (dim 0 would pad 2 rows, 33%); as a
2 x 2 grid every rank holds 3 x 5 of it, nothing padded. ``GridNet`` has three such parameters
(``(10, 6)``, ``(6, 10)`` and a ``(6, 3, 10)`` cube cut along dims 0 and 2) and one that no grid
divides (``(3, 6)``, padded along dim 0). At 1, 2 and 3 ranks every one of them has a dimension
the ranks divide, so the same runs check that nothing changed there. One spawn per world size:
training at parity with one process (both strategies, stages 3 and 2) through torch's own
``clip_grad_norm_`` over ``model.parameters()`` (DTensors on two meshes), the placements users
see, state dicts and ``full_tensor()``, and checkpoints resharded from 4 ranks to 2
(zero's own, and ``torch.distributed.checkpoint``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from zero_core import ChunkPolicy, ZeroConfig, load_checkpoint, save_checkpoint, shard
from zero_core.testing import full_value, run_distributed

STEPS = 3
GRID = {"inp.weight": ((10, 6), 1), "mid.weight": ((6, 10), 1), "cube": ((6, 3, 10), 2)}  # name: (shape, dim2)


class GridNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.mid = nn.Linear(10, 6)
        self.cube = nn.Parameter(0.2 * torch.randn(6, 3, 10))
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        g = torch.tanh(self.mid(h))
        t = torch.einsum("bi,ijk->bk", g, self.cube) / 3
        return self.out(torch.tanh(self.mid(torch.tanh(t) + h)) + g)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)


def train_clipped(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, world: int,
                  batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[float], list[float]]:
    """Each rank on its own slice of every step's ``batch(step)``, clipped by torch's own ``clip_grad_norm_`` (a stack
    of norms over the grid meshes too): the mean loss over the ranks (the whole batch's loss) and the norm, by step."""
    losses, norms = [], []
    for step in steps:
        x, y = batch(step)
        n = len(x) // world
        loss = F.cross_entropy(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
        losses.append(value.item() / world)
    return losses, norms


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> list[float]:
    return train_clipped(model, opt, range(STEPS), rank, world, _batch)[0]


def _build(strategy: str = "chunk", stage: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GridNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    if not dist.is_initialized():
        return model, opt
    chunk = ChunkPolicy(chunk_size=200 if strategy == "chunk" else None)
    return shard(model, opt, config=ZeroConfig(strategy=strategy, stage=stage, chunk=chunk))


def _world(path: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    for strategy, stage in (("chunk", 3), ("tensor", 2)):
        model, opt = _build(strategy, stage)
        losses = _train(model, opt, rank, world)
        params = dict(model.named_parameters())
        run = {"losses": losses, "params": {n: full_value(p) for n, p in params.items()},
               "placements": {n: (tuple(p.placements), p.device_mesh.ndim, tuple(p.to_local().shape))
                              for n, p in params.items()},
               "state": {n: full_value(opt.state[p]["exp_avg"]) for n, p in params.items()}}
        # a state dict holds the same DTensors; loading a plain one puts every rank's piece back
        state = {k: full_value(v) for k, v in model.state_dict().items()}
        run["state_dict"] = all(torch.equal(state[n], run["params"][n]) for n in params)
        model.load_state_dict({k: 2 * v for k, v in state.items()})
        run["reloaded"] = all(torch.equal(full_value(p), 2 * run["params"][n]) for n, p in params.items())
        model.load_state_dict(state)
        if world == 4 and strategy == "chunk":
            save_checkpoint(model, opt, f"{path}/zero")
            dcp.save({"model": model.state_dict()}, checkpoint_id=f"{path}/dcp")
        out[strategy] = run
        model.close()
    if world == 4:  # a grid of an HSDP mesh's shard dimension: (2, 2) -> (2, 1, 2), a replica of each piece
        from torch.distributed.device_mesh import init_device_mesh

        from zero_core.chunks._grid_mesh import grid_mesh

        grid = grid_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")), 2)
        value = torch.arange(24.0).view(4, 6)
        local = value.view(1, 4, 2, 3)[0, :, rank % 2].clone()  # all 4 rows, columns of this rank's half
        made = DTensor.from_local(local, grid, (Replicate(), Shard(0), Shard(1)), run_check=False, shape=value.shape,
                                  stride=value.stride())
        out["hsdp_grid"] = (tuple(grid.shape), torch.equal(made.full_tensor(), value))
    if world == 2:  # what 4 ranks saved, resharded onto 2 (a 2 x 2 grid onto a one-dimension cut)
        model, opt = _build()
        load_checkpoint(model, opt, f"{path}/zero")
        out["zero_loaded"] = {n: (full_value(p), full_value(opt.state[p]["exp_avg"]))
                              for n, p in model.named_parameters()}
        model.close()
        out["dcp_loaded"] = dcp_loaded(f"{path}/dcp", lambda: _build("tensor", 2))
    return out


def dcp_loaded(path: str, build: Callable[[], tuple[nn.Module, torch.optim.Optimizer]]) -> dict[str, torch.Tensor]:
    """The parameters of the DCP checkpoint at ``path`` loaded into the model ``build()`` shards on these ranks."""
    model, _ = build()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    loaded = {n: full_value(p) for n, p in model.named_parameters()}
    model.close()
    return loaded


def test_a_grid_cut_trains_at_parity_and_round_trips_across_world_sizes(tmp_path):
    model, opt = _build()
    reference = _train(model, opt, 0, 1)
    ref_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    results = {}
    for world in (4, 2, 3, 1):  # 4 first: it writes the checkpoints 2 loads
        results[world] = run_distributed(_world, world, str(tmp_path), timeout=300)
    for world, ranks in results.items():
        for result in ranks:
            for strategy in ("chunk", "tensor"):
                run = result[strategy]
                assert run["losses"] == pytest.approx(reference, rel=1e-5), (world, strategy)
                for name, value in ref_params.items():
                    assert torch.allclose(run["params"][name], value, rtol=1e-5, atol=1e-6), (world, strategy, name)
                assert run["state_dict"] and run["reloaded"], (world, strategy)
                for name, ((shape, dim2), (placements, ndim, local)) in (
                        (n, (GRID[n], run["placements"][n])) for n in GRID):
                    if world == 4:  # a 2 x 2 grid of equal pieces on a 2-D mesh over the same 4 ranks
                        assert placements == (Shard(0), Shard(dim2)) and ndim == 2, (strategy, name)
                        assert local == tuple(d // 2 if i in (0, dim2) else d for i, d in enumerate(shape)), name
                    else:
                        assert len(placements) == ndim == 1 and placements[0] != Replicate(), (world, name)
                if world == 4:  # no grid divides (3, 6) over 4 ranks: dim 0, padded, on the chunk's own mesh
                    assert run["placements"]["out.weight"][:2] == ((Shard(0),), 1)
    assert all(r["hsdp_grid"] == ((2, 1, 2), True) for r in results[4])
    saved = results[4][0]["chunk"]
    for result in results[2]:
        for name, (value, exp_avg) in result["zero_loaded"].items():
            assert torch.equal(value, saved["params"][name]) and torch.equal(exp_avg, saved["state"][name]), name
        for name, value in result["dcp_loaded"].items():
            assert torch.equal(value, saved["params"][name]), name
