"""Train a GPT-style model with zero (or torch DDP, for comparison) on synthetic data.

Launch it the way torchrun launches any script, one process per rank:

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_gpt.py

Rank 0 shows a progress display with the loss, tokens/s, steps/s, memory per rank, the elapsed time and
the ETA when rich is installed (``pip install 'zero-core[examples]'``) and stdout is a terminal, plain log lines
otherwise; every run ends with one summary line. ``--json PATH`` also writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zero_core import (
    ChunkPolicy,
    LossScale,
    Precision,
    ZeroConfig,
    lazy_init,
    load_checkpoint,
    save_checkpoint,
    save_full_state_dict,
    shard,
)
from zero_core.testing.gpt import GPT, GPTConfig, SyntheticTokens, lm_loss

if TYPE_CHECKING:
    from rich.progress import Progress


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["zero", "ddp"], default="zero", help="zero (any strategy) or torch DDP")
    p.add_argument("--strategy", default="chunk", help="zero shard strategy plugin name (chunk, tensor, ...)")
    p.add_argument("--comm", default=None, help="zero comm backend plugin name (default: the strategy's choice)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="reduce-scatter bucket MiB for bucketing backends")
    p.add_argument("--stage", type=int, choices=[1, 2, 3], default=3, help="ZeRO stage")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="compute dtype (16-bit runs keep fp32 master weights; fp16 scales the loss)")
    p.add_argument("--steps", type=int, default=200, help="most optimizer steps to run")
    p.add_argument("--time-budget", type=float, default=100.0, help="stop after this many seconds of training")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=10, help="steps of linear learning-rate warm-up")
    p.add_argument("--alphabet", type=int, default=64, help="tokens the synthetic Markov chain uses")
    p.add_argument("--chunk-size", type=int, default=None, help="elements per chunk (default: searched)")
    p.add_argument("--static-graph", action="store_true", help="skip the all-gather agreement rounds")
    p.add_argument("--placement", default="device", help="placement policy plugin name (device, host, static, gemini, ...)")
    p.add_argument("--placement-options", default="{}", type=json.loads,
                   help='the policy\'s options as JSON, e.g. \'{"device_budget_mb": 96, "disk_dir": "/tmp/zero"}\'')
    p.add_argument("--lazy", action="store_true", help="build the model under zero_core.lazy_init() (no full copy per rank)")
    p.add_argument("--checkpoint-dir", default=None, help="save a sharded checkpoint here at the end of the run")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also save it every this many steps (0: at the end only)")
    p.add_argument("--resume", default=None, help="load this sharded checkpoint first and continue from its step")
    p.add_argument("--save-full", default=None, help="write the full state dict here at the end (.safetensors streams it)")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--json", default=None, help="write the run's figures to this file (rank 0)")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress display")
    return p.parse_args(argv)


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident memory of this process in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        current = peak
    return current, peak


def progress_display(description: str, *, total: int) -> Progress | None:
    """A started rich progress bar with one task, or None when rich is not installed (plain lines then)."""
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    except ImportError:  # rich is optional: the zero-core[examples] extra
        return None
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    progress.start()
    progress.add_task(description, total=total, info="")
    return progress


def clock(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour; ``?`` before anything is measured."""
    if seconds != seconds or seconds == float("inf"):
        return "?"
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()  # the summary's total time: setup, training and saving
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_layer=args.layers, n_head=args.heads)
    data = SyntheticTokens(vocab_size=args.vocab, seq_len=args.seq_len, alphabet=args.alphabet)
    torch.manual_seed(0)
    if args.lazy and args.mode == "zero":
        with lazy_init():  # parameters are materialised shard by shard by shard(), with the same values
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    stats = None
    if args.mode == "zero":
        precision = Precision(compute=None if args.precision == "fp32" else args.precision,
                              loss_scale=LossScale() if args.precision == "fp16" else None)
        config = ZeroConfig(strategy=args.strategy, stage=args.stage, precision=precision,
                            chunk=ChunkPolicy(chunk_size=args.chunk_size, search_interval=args.d_model),
                            static_graph=args.static_graph, comm_backend=args.comm, reduce_bucket_mb=args.bucket_mb,
                            placement=args.placement, placement_options=args.placement_options)
        model, optimizer = shard(model, optimizer, config=config)
        stats = model.comm_stats
    else:
        if args.precision != "fp32":
            raise SystemExit("--mode ddp runs in fp32 only; it is the reference the zero runs are compared with")
        model = torch.nn.parallel.DistributedDataParallel(model.to(device))
    setup_peak = rss_mib()[1]
    # An ordinary scheduler: zero re-points the optimizer in place, so schedulers just work.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / max(1, args.warmup)))
    first_step = 0
    if args.resume and args.mode == "zero":
        extra = load_checkpoint(model, optimizer, args.resume)  # at any world size, strategy or chunk size
        scheduler.load_state_dict(extra["scheduler"])
        first_step = extra["step"]
        if first_step >= args.steps:
            raise SystemExit(f"the checkpoint at {args.resume} is at step {first_step}; pass --steps above it to train on")
        if rank == 0:
            print(f"resumed from {args.resume} at step {first_step}", flush=True)

    def save(step: int) -> None:
        if args.checkpoint_dir and args.mode == "zero":
            save_checkpoint(model, optimizer, args.checkpoint_dir, extra={"step": step, "scheduler": scheduler.state_dict()})

    progress = None
    if rank == 0 and not args.no_progress and sys.stdout.isatty():
        progress = progress_display(f"{args.mode} x{world}", total=args.steps)
        if progress is None:
            print("rich is not installed, so plain log lines follow (pip install 'zero-core[examples]' for a progress bar)",
                  flush=True)

    if rank == 0:
        n = cfg.num_params
        what = f"stage={args.stage} precision={args.precision} " if args.mode == "zero" else ""
        print(f"mode={args.mode} {what}ranks={world} backend={backend} params={n / 1e6:.1f}M tied embeddings "
              f"tokens/step={args.batch_size * args.seq_len * world} loss floor={data.floor:.3f}", flush=True)
    losses, step_times = [], []
    start = time.perf_counter()
    for step in range(first_step, args.steps):
        t0 = time.perf_counter()
        tokens = data.batch(step, args.batch_size * world)[rank * args.batch_size:(rank + 1) * args.batch_size].to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(tokens), tokens)
        if args.mode == "zero":
            model.backward(loss)  # scales the loss when fp16 needs it; plain loss.backward() otherwise
        else:
            loss.backward()
        optimizer.step()
        scheduler.step()
        reported = loss.detach().float()
        dist.all_reduce(reported)
        losses.append(reported.item() / world)
        step_times.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - start
        out_of_time = torch.tensor([elapsed > args.time_budget], dtype=torch.uint8)
        dist.all_reduce(out_of_time, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        last = bool(out_of_time.item()) or step == args.steps - 1
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and not last:
            save(step + 1)
        if step % args.log_every == 0 or last:
            mem = [None] * world
            dist.all_gather_object(mem, rss_mib())
            if rank == 0:
                tps = args.batch_size * args.seq_len * world / statistics.median(step_times[-args.log_every:])
                # this run's steps over its wall time (logging included); the ETA is to --steps
                rate = len(losses) / elapsed
                info = (f"loss {losses[-1]:.3f}  {tps:,.0f} tok/s  {rate:.2f} steps/s  rss/rank "
                        + " ".join(f"{m[0]:.0f}" for m in mem) + " MiB")
                if progress is not None:
                    progress.update(progress.task_ids[0], completed=step + 1, info=info)
                else:
                    left = (args.steps - step - 1) / rate
                    print(f"step {step:4d}  {info}  elapsed {clock(elapsed)}  ETA {clock(left)}", flush=True)
        if last:
            break
    if progress is not None:
        progress.stop()
    save(step + 1)
    if args.save_full and args.mode == "zero":
        save_full_state_dict(model, args.save_full)

    steady = step_times[2:] if len(step_times) > 4 else step_times
    step_time = statistics.median(steady)
    peaks = [None] * world
    dist.all_gather_object(peaks, {"peak_rss_mib": rss_mib()[1], "setup_peak_rss_mib": setup_peak,
                                   "model_state_bytes": model.model_state_bytes() if args.mode == "zero" else None})
    result = {
        "mode": args.mode, "strategy": args.strategy if args.mode == "zero" else "ddp", "world_size": world,
        "comm": model.engine.reduce_comm.name if args.mode == "zero" else "ddp",
        "stage": args.stage if args.mode == "zero" else None, "precision": args.precision,
        "backend": backend, "params": cfg.num_params, "steps": len(losses), "losses": losses,
        "median_step_s": step_time, "tokens_per_s": args.batch_size * args.seq_len * world / step_time,
        "peak_rss_mib": [p["peak_rss_mib"] for p in peaks], "setup_peak_rss_mib": [p["setup_peak_rss_mib"] for p in peaks],
        "model_state_bytes": [p["model_state_bytes"] for p in peaks],
        "comm_last_step": stats.summary() if stats is not None else None,
        "placement": args.placement if args.mode == "zero" else None,
        "placement_report": getattr(model.engine.placement, "report", dict)() if args.mode == "zero" else None,
        "torch": torch.__version__,
    }
    if rank == 0:
        what = f"stage={args.stage} precision={args.precision} " if args.mode == "zero" else ""
        print(f"summary: mode={args.mode} {what}ranks={world} params={cfg.num_params / 1e6:.1f}M steps={len(losses)} "
              f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (floor {data.floor:.3f}) "
              f"tokens/s={result['tokens_per_s']:,.0f} step={step_time:.3f}s "
              f"peak_rss/rank=[{', '.join(f'{p:.0f}' for p in result['peak_rss_mib'])}] MiB "
              f"time={clock(time.perf_counter() - started)}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    if args.mode == "zero":
        model.close()  # stop zero's helper thread before the process group goes away
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
