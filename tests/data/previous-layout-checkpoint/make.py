"""Write a checkpoint with the previous (contiguous-split) layout, and the full parameters it holds."""
import sys

import torch
import torch.distributed as dist

from zero_core import ChunkPolicy, ZeroConfig, save_checkpoint, shard
from zero_core.testing import run_distributed
from zero_core.testing.parity import make_optimizer
from zero_core.testing.zoo import get_case


def work(path):
    case = get_case("gpt")
    torch.manual_seed(0)
    model = case.build()
    model, opt = shard(model, make_optimizer(case, model), config=ZeroConfig(stage=3, chunk=ChunkPolicy(chunk_size=300)))
    r = dist.get_rank()
    for step in range(2):
        x, y = case.batch(step, 4)
        case.loss(model(x[r*2:(r+1)*2]), y[r*2:(r+1)*2]).backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(model, opt, path, extra={"step": 2})
    full = model.full_parameters()
    model.close()
    return full


if __name__ == "__main__":
    res = run_distributed(work, 2, sys.argv[1])
    torch.save(res[0], sys.argv[1] + "/expected_params.pt")
