"""Training quality of the quantized comm backends against the exact one: ``python -m zero_bench.quantized_quality``.

The bench's small GPT (``tiny``: 2 layers, 128 wide, 2,048 tokens) and a Llama-shaped one of the same size learn the
bench's synthetic Markov chain for ``--steps`` steps on each of ``--worlds`` gloo ranks, once per comm backend (the
exact ``torch`` one first), from the same initial weights on the same global batches (``--global-batch``
sequences a step, split over the ranks), in fp32 or with ``--compute bf16``. Written to ``--out``: ``NAME.json``
(every loss, and the bytes each collective kind sent per step on rank 0) and ``NAME.md`` (the losses every ``--every``
steps, the final loss, the mean of the last 20 and their differences from the exact run).

Each rank runs one intra-op thread: the machine's cores are shared, and the figures are losses and bytes, not time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["MODELS", "main", "train"]

MODELS: dict[str, dict[str, Any]] = {
    # the bench's "tiny" GPT (zero_bench.configs.MODELS)
    "gpt-tiny": {"vocab": 2048, "d_model": 128, "layers": 2, "heads": 4, "seq_len": 64},
    # Llama's ratios at the same size: grouped-query attention (2 key/value heads), a SwiGLU MLP 344 wide
    "llama-tiny": {"vocab": 2048, "d_model": 128, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 344, "seq_len": 64},
}


def train(model: dict[str, Any], backends: list[str], *, steps: int, global_batch: int, lr: float, stage: int,
          compute: str | None = None) -> Any:
    """On every rank: train ``model`` once per backend; rank 0 returns each run's losses and bytes per step."""
    import torch
    import torch.distributed as dist

    import zero_comm_quantized.plugin
    from zero_bench.configs import build_model
    from zero_core import Precision, ZeroConfig, shard
    from zero_core.testing.gpt import SyntheticTokens, lm_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    local = global_batch // world
    data = SyntheticTokens(vocab_size=model["vocab"], seq_len=model["seq_len"])
    runs = {}
    for backend in backends:
        torch.manual_seed(0)
        net = build_model(model)
        optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
        config = ZeroConfig(stage=stage, comm_backend=backend, precision=Precision(compute=compute))
        net, optimizer = shard(net, optimizer, config=config, plugins=[zero_comm_quantized.plugin])
        losses = []
        start = time.process_time()
        for step in range(steps):
            tokens = data.batch(step, global_batch)[rank * local:(rank + 1) * local]
            optimizer.zero_grad(set_to_none=True)
            loss = lm_loss(net(tokens), tokens)
            net.backward(loss)
            optimizer.step()
            reported = loss.detach().clone()
            dist.all_reduce(reported)  # reporting only: outside the engine's counted traffic
            losses.append(reported.item() / world)
        stats = net.engine.comm.stats
        per_step = {kind.value: count.bytes_sent // max(stats.step_count, 1) for kind, count in stats.totals.items()}
        calls = {kind.value: count.calls // max(stats.step_count, 1) for kind, count in stats.totals.items()}
        runs[backend] = {"losses": losses, "bytes_per_step": per_step, "calls_per_step": calls,
                         "cpu_s": time.process_time() - start, "params": sum(p.numel() for p in net.parameters())}
        net.engine.close()
    return runs if rank == 0 else None


def _summary(results: dict[str, Any], every: int) -> str:
    lines = [f"# Quantized comm backends against the exact one ({results['when']})", "",
             f"{results['steps']} steps, global batch {results['global_batch']} sequences of "
             f"{results['models'][next(iter(results['models']))]['seq_len']} tokens, AdamW lr {results['lr']}, "
             f"stage {results['stage']}, {results['compute']} compute (fp32 masters), gloo on CPU, one thread per rank; "
             f"load before: {results['load_before']}, "
             f"after: {results['load_after']}.", ""]
    for key, runs in results["runs"].items():
        exact = runs[results["backends"][0]]
        lines += [f"## {key}", "", "| step | " + " | ".join(runs) + " |", "|---" * (len(runs) + 1) + "|"]
        marks = sorted({*range(0, results["steps"], every), results["steps"] - 1})
        for s in marks:
            lines.append(f"| {s} | " + " | ".join(f"{run['losses'][s]:.4f}" for run in runs.values()) + " |")
        lines += ["", "| backend | final loss | diff vs exact | mean of last 20 | diff vs exact | max abs diff over the "
                  "run | all-gather bytes/step | reduce-scatter bytes/step |", "|---|---|---|---|---|---|---|---|"]
        tail = min(20, results["steps"])
        for name, run in runs.items():
            final, mean = run["losses"][-1], sum(run["losses"][-tail:]) / tail
            ex_final, ex_mean = exact["losses"][-1], sum(exact["losses"][-tail:]) / tail
            worst = max(abs(a - b) for a, b in zip(run["losses"], exact["losses"]))
            b = run["bytes_per_step"]
            lines.append(f"| {name} | {final:.4f} | {final - ex_final:+.4f} ({(final - ex_final) / ex_final:+.2%}) | "
                         f"{mean:.4f} | {mean - ex_mean:+.4f} ({(mean - ex_mean) / ex_mean:+.2%}) | {worst:.4f} | "
                         f"{b.get('all_gather', 0):,} | {b.get('reduce_scatter', 0):,} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero_bench.quantized_quality", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["gpt-tiny"])
    parser.add_argument("--backends", nargs="+", default=["torch", "quantized"],
                        help="the first is the exact reference the others are compared with")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--compute", choices=("fp32", "bf16"), default="fp32",
                        help="the dtype forward and backward run in, which the exact backend gathers and reduces in")
    parser.add_argument("--name", default="quantized-quality", help="the files' stem")
    parser.add_argument("--every", type=int, default=20, help="the summary shows the losses every this many steps")
    parser.add_argument("--out", type=Path, required=True, help="folder for NAME.json and NAME.md")
    args = parser.parse_args(argv)
    for world in args.worlds:
        if args.global_batch % world:
            parser.error(f"--global-batch {args.global_batch} does not split over {world} ranks")
    os.environ.setdefault("ZERO_TEST_CORES", "1")  # one intra-op thread per rank, whatever the world size
    from zero_core.testing.distributed import run_distributed

    results: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": args.steps,
                               "global_batch": args.global_batch, "lr": args.lr, "stage": args.stage, "compute": args.compute,
                               "backends": args.backends, "models": {m: MODELS[m] for m in args.models},
                               "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()), "runs": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        for world in args.worlds:
            key = f"{name}, {world} ranks"
            print(f"{key}: {' then '.join(args.backends)}, {args.steps} steps each", file=sys.stderr, flush=True)
            runs = run_distributed(train, world, MODELS[name], args.backends, steps=args.steps,
                                   global_batch=args.global_batch, lr=args.lr, stage=args.stage,
                                   compute=None if args.compute == "fp32" else args.compute,
                                   timeout=max(600.0, 20.0 * args.steps * len(args.backends)))[0]
            results["runs"][key] = runs
            for backend, run in runs.items():
                print(f"  {backend}: final loss {run['losses'][-1]:.4f}, bytes/step {run['bytes_per_step']}",
                      file=sys.stderr, flush=True)
            results["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
            (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / f"{args.name}.md").write_text(_summary(results, args.every) + "\n")
    assert all(math.isfinite(x) for r in results["runs"].values() for run in r.values() for x in run["losses"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
