"""Checkpoints written before the DTensor layout still load.

``tests/data/previous-layout-checkpoint`` was saved at 2 ranks by zero before parameters
were cut in ``torch.chunk`` pieces (each rank then held an arbitrary contiguous range of
every chunk: ``wte.weight``'s rank 0 piece ends mid-row). Pieces are keyed by parameter
name and element range, so the new layout reads the ranges it needs. ``make.py`` beside
the files is the script that wrote them (run with the previous commit's packages), and
``expected_params.pt`` the full parameters it saved.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from zero_core import ChunkPolicy, ZeroConfig, load_checkpoint, shard
from zero_core.testing import run_distributed
from zero_core.testing.parity import make_optimizer
from zero_core.testing.zoo import get_case

DATA = Path(__file__).parent / "data" / "previous-layout-checkpoint"


def _load(path: str, stage: int) -> dict:
    case = get_case("gpt")
    torch.manual_seed(1)  # other initial values: everything must come from the checkpoint
    model = case.build()
    model, opt = shard(model, make_optimizer(case, model), config=ZeroConfig(stage=stage, chunk=ChunkPolicy(chunk_size=300)))
    extra = load_checkpoint(model, opt, path)
    params = model.full_parameters()
    r, n = dist.get_rank(), dist.get_world_size()
    x, y = case.batch(2, 4)
    per = 4 // n
    loss = case.loss(model(x[r * per:(r + 1) * per]), y[r * per:(r + 1) * per])
    loss.backward()
    opt.step()  # the loaded optimizer states step
    model.close()
    return {"extra": extra, "params": params}


@pytest.mark.parametrize("world,stage", [(2, 3), (1, 2), (4, 3)])
def test_a_checkpoint_of_the_previous_layout_loads(world, stage):
    expected = torch.load(DATA / "expected_params.pt")
    results = run_distributed(_load, world, str(DATA), stage)
    for result in results:
        assert result["extra"] == {"step": 2}
        assert result["params"].keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(result["params"][name], value), name
