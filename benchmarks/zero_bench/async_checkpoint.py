"""How long save_checkpoint blocks training, synchronous against asynchronous, and the staging memory it takes.

Each rank shards the model (chunk strategy, stage 3), trains one step (so AdamW has its states), then saves
``--repeats`` times each way into a fresh directory:

- synchronous: ``save_checkpoint(model, opt, dir)``, which returns when the checkpoint is complete;
- asynchronous: ``save_checkpoint(model, opt, dir, async_=True)``, which returns after staging; the seconds
  it blocked, and the seconds until the background write and commit were done (``handle.wait()``).

    python -m zero_bench.async_checkpoint --model gpt2-small --world 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch


def _worker(model_name: str, repeats: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from zero_bench.configs import MODELS, build_model
    from zero_core import ZeroConfig, save_checkpoint, shard

    options = MODELS[model_name].options()
    torch.manual_seed(0)
    model = build_model(options)
    model, opt = shard(model, torch.optim.AdamW(model.parameters()), config=ZeroConfig(stage=3))
    tokens = torch.randint(0, options["vocab"], (2, options["seq_len"] + 1))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    sync, blocked, total, staged = [], [], [], 0
    for i in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        save_checkpoint(model, opt, f"{root}/sync-{i}")
        sync.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        handle = save_checkpoint(model, opt, f"{root}/async-{i}", async_=True)
        blocked.append(time.perf_counter() - start)
        handle.wait()
        total.append(time.perf_counter() - start)
        staged = handle.staged_bytes
    model.close()
    return {"sync": statistics.median(sync), "blocked": statistics.median(blocked), "total": statistics.median(total),
            "staged": staged, "params": sum(p.numel() for p in model.parameters())}


def main(argv: list[str] | None = None) -> int:
    from zero_bench.configs import MODELS
    from zero_core.testing import run_distributed

    p = argparse.ArgumentParser(prog="python -m zero_bench.async_checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="gpt2-small")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="zero-async-checkpoint-") as root:
        results = run_distributed(_worker, args.world, args.model, args.repeats, root, timeout=1800)
    print(f"{args.model}, {args.world} ranks, chunk stage 3, AdamW; medians of {args.repeats} saves\n")
    print("| rank | synchronous save s | asynchronous: blocked s | asynchronous: until complete s | staging MiB |")
    print("|---|---|---|---|---|")
    for rank, r in enumerate(results):
        print(f"| {rank} | {r['sync']:.3f} | {r['blocked']:.3f} | {r['total']:.3f} | {r['staged'] / 2**20:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
