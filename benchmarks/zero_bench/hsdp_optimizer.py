"""HSDP with optimizer states sharded across the replicas, against plain HSDP: memory, traffic and time per step.

Each rank shards the model over a ``(R, S)`` device mesh (chunk strategy, stage 3, AdamW), once with
``ZeroConfig(shard_optimizer_across_replicas=False)`` and once with ``True``, and trains ``--steps`` steps on the
same batches. Per rank it reports the model-state bytes it holds (exact, from the storages) beside
:func:`zero_core.estimate`'s prediction, the bytes and calls of each collective in the last step (the run's own
counters), and the median step time after the first. The losses of the two runs must agree.

    python -m zero_bench.hsdp_optimizer --model gpt2-small --mesh 2x2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch


def _worker(model_name: str, mesh_shape: tuple[int, int], steps: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from zero_bench.configs import MODELS, build_model
    from zero_core import ChunkPolicy, ZeroConfig, estimate, shard

    options = MODELS[model_name].options()
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for across in (False, True):
        torch.manual_seed(0)
        model = build_model(options)
        config = ZeroConfig(stage=3, chunk=ChunkPolicy(search_interval=options["d_model"]),
                            shard_optimizer_across_replicas=across)
        predicted = estimate(model, mesh_shape=mesh_shape, config=config)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device, mesh_shape, mesh_dim_names=("replicate", "shard"))
        model, opt = shard(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config=config, mesh=mesh)
        losses, times = [], []
        for step in range(steps):
            tokens = torch.randint(0, options["vocab"], (options["batch_size"], options["seq_len"] + 1),
                                   generator=torch.Generator().manual_seed(1000 * step + rank)).to(model.engine.device)
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        held = model.model_state_bytes()
        engine = model.engine
        out[str(across)] = {
            "params": sum(p.numel() for p in model.parameters()),
            "held": {k: held[k] for k in ("params", "grads", "optimizer_states")},
            "predicted": predicted.per_rank[rank], "formula": predicted.formula,
            "by_group": predicted.bytes_sent_by_group,
            "last_step": engine.comm.stats.summary(engine.comm.stats.steps[-1]),
            "seconds": statistics.median(times[1:]) if len(times) > 1 else times[0], "losses": losses}
        model.close()
    return out


def _mesh(text: str) -> tuple[int, int]:
    r, _, s = text.partition("x")
    return int(r), int(s)


def main(argv: list[str] | None = None) -> int:
    from zero_bench.configs import MODELS
    from zero_core.testing import run_distributed

    p = argparse.ArgumentParser(prog="python -m zero_bench.hsdp_optimizer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="gpt2-small")
    p.add_argument("--mesh", type=_mesh, default=(2, 2), help="RxS: R replicas, each sharding over S ranks")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    world = args.mesh[0] * args.mesh[1]
    results = run_distributed(_worker, world, args.model, args.mesh, args.steps, timeout=3600)
    mib = 2**20
    head = results[0]["False"]
    print(f"{args.model}: {head['params'] / 1e6:.1f}M parameters, mesh {args.mesh[0]}x{args.mesh[1]} ({world} ranks), "
          f"chunk stage 3, AdamW, fp32; rank 0, last of {args.steps} steps\n")
    print("| shard_optimizer_across_replicas | params MiB | grads MiB | optimizer MiB | held MiB | estimate MiB "
          "| formula MiB | all_gather MiB (calls) | reduce_scatter MiB (calls) | all_reduce MiB (calls) "
          "| across replicas MiB | step s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    agree = True
    for key in ("False", "True"):
        r = results[0][key]
        held, step = r["held"], r["last_step"]

        def cell(kind: str, step: dict[str, Any] = step) -> str:
            c = step.get(kind)
            return "-" if c is None else f"{c['bytes_sent'] / mib:.1f} ({c['calls']})"

        agree &= all(res[key]["held"] == res[key]["predicted"] for res in results)
        print(f"| {key} | {held['params'] / mib:.1f} | {held['grads'] / mib:.1f} | {held['optimizer_states'] / mib:.1f} "
              f"| {sum(held.values()) / mib:.1f} | {sum(r['predicted'].values()) / mib:.1f} "
              f"| {r['formula']['model_state_bytes'] / mib:.1f} | {cell('all_gather')} | {cell('reduce_scatter')} "
              f"| {cell('all_reduce')} | {r['by_group']['replicate'] / mib:.1f} | {r['seconds']:.2f} |")
    same = all(res["True"]["losses"] == res["False"]["losses"] for res in results)
    diff = max(abs(a - b) for res in results for a, b in zip(res["True"]["losses"], res["False"]["losses"]))
    print(f"\nheld == estimate on every rank: {agree}; largest loss difference between the two runs: {diff:.3g} "
          f"(bit-identical: {same})")
    return 0 if agree and diff <= 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
