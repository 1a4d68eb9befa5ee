"""A weight sync out of a sharded trainer, three ways: time and peak memory of each, side by side.

Each rank shards the model (chunk strategy, stage 3), then rank 0 copies every parameter into a plain copy
of the model (the shape of a sync to an inference engine or an evaluator), three ways:

- ``gathered_parameters()``: every parameter whole at once on every rank, copied inside the context;
- ``full_parameters()``: every parameter whole, as CPU copies, one chunk gathered at a time;
- ``stream_full_parameters(bucket_mb=B, rank=0)``: buckets of at most B MiB, rank 0 only.

Time is the median of ``--repeats`` syncs; the peak is what each sync added at its worst moment, counted
exactly from the storages operators made (:class:`zero_core.testing.memory.LiveBytes`), per rank.

    python -m zero_bench.weight_sync --model gpt2-small --world 2 --bucket-mb 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

METHODS = ("gathered_parameters", "full_parameters", "stream_full_parameters")


@torch.no_grad()
def _sync(method: str, model: torch.nn.Module, plain: torch.nn.Module | None, bucket_mb: float) -> None:
    if method == "gathered_parameters":
        with model.gathered_parameters():
            if plain is not None:
                for name, param in model.named_parameters():
                    plain.get_parameter(name).copy_(param)
    elif method == "full_parameters":
        for name, value in model.full_parameters().items():
            if plain is not None:
                plain.get_parameter(name).copy_(value)
    else:
        for bucket in model.stream_full_parameters(bucket_mb=bucket_mb, rank=0):
            if plain is not None:
                for name, value in bucket:
                    plain.get_parameter(name).copy_(value)


def _worker(model_name: str, bucket_mb: float, repeats: int) -> dict[str, Any]:
    import torch.distributed as dist

    from zero_bench.configs import MODELS, build_model
    from zero_core import ZeroConfig, shard
    from zero_core.testing.memory import LiveBytes

    options = MODELS[model_name].options()
    torch.manual_seed(0)
    model = build_model(options)
    rank = dist.get_rank()
    plain = build_model(options) if rank == 0 else None
    model, _ = shard(model, torch.optim.AdamW(model.parameters()), config=ZeroConfig(stage=3))
    expected = model.full_parameters()
    out: dict[str, Any] = {"params": sum(v.numel() for v in expected.values()),
                           "param_bytes": sum(v.numel() * v.element_size() for v in expected.values())}
    for method in METHODS:
        times, peaks = [], []
        for _ in range(repeats):
            counter = LiveBytes()
            dist.barrier()
            start = time.perf_counter()
            with counter:
                _sync(method, model, plain, bucket_mb)
            times.append(time.perf_counter() - start)
            peaks.append(counter.peak)
        exact = plain is None or all(torch.equal(p, expected[n]) for n, p in plain.named_parameters() if n in expected)
        out[method] = {"seconds": statistics.median(times), "peak_bytes": max(peaks), "exact": exact}
        if plain is not None:
            with torch.no_grad():
                for p in plain.parameters():
                    p.zero_()  # the next method fills it again
    model.close()
    return out


def main(argv: list[str] | None = None) -> int:
    from zero_bench.configs import MODELS
    from zero_core.testing import run_distributed

    p = argparse.ArgumentParser(prog="python -m zero_bench.weight_sync", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="gpt2-small")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    results = run_distributed(_worker, args.world, args.model, args.bucket_mb, args.repeats, timeout=1800)
    head = results[0]
    print(f"{args.model}: {head['params'] / 1e6:.1f}M parameters ({head['param_bytes'] / 2**20:.1f} MiB), "
          f"{args.world} ranks, chunk stage 3, synced into a plain copy on rank 0; bucket {args.bucket_mb} MiB\n")
    ranks = " | ".join(f"peak MiB rank {r}" for r in range(args.world))
    print(f"| method | seconds (median of {args.repeats}) | {ranks} | rank 0's copy exact |")
    print("|---|---|" + "---|" * args.world + "---|")
    for method in METHODS:
        peaks = " | ".join(f"{r[method]['peak_bytes'] / 2**20:.1f}" for r in results)
        print(f"| `{method}` | {head[method]['seconds']:.3f} | {peaks} | {head[method]['exact']} |")
    return 0 if all(r[m]["exact"] for r in results for m in METHODS) else 1


if __name__ == "__main__":
    raise SystemExit(main())
