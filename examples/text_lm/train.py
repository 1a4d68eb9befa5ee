"""Train a byte-level GPT on the Python standard library's own sources with zero, on 2 CPU ranks.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/text_lm/train.py

Real text that ships with every Python (no download, no tokenizer), and the whole life
of a training job in one loop:

- the model is built under ``zero_core.lazy_init()`` and ``shard()`` materialises only
  this rank's shards;
- each step accumulates ``--accum`` micro-batches, all but the last under ``model.no_sync()``;
- gradients are clipped by their global norm (``zero_core.clip_grad_norm_``), printed;
- the validation loss (held-out files) is measured every ``--eval-every`` steps under
  ``torch.no_grad()`` with ``model.eval()``;
- a sharded checkpoint is saved every ``--checkpoint-every`` steps; ``--stop-after N``
  stops there as if the job were killed, and ``--resume`` continues from the checkpoint
  with the same losses as a run that never stopped;
- rank 0's step lines show the time elapsed, steps per second and the ETA; the summary, the total time;
- at the end the model is exported in the Hugging Face format, and rank 0 loads that
  export into a plain ``ByteGPT`` (no zero) and prints a sample of its text.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from byte_gpt import ByteGPT, ByteGPTConfig, next_byte_loss
from safetensors.torch import load_file
from stdlib_text import StdlibText, load_stdlib_text
from step_clock import StepClock, clock

import zero_core

CHECKPOINT_FILE = "zero_checkpoint.json"  # the metadata save_checkpoint writes last: present means complete
PROMPT = "    def __init__(self"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600, help="optimizer steps of the whole run (the schedule's length)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-batch")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step (gradient accumulation)")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=4e-3, help="peak learning rate (linear warm-up, then cosine to a tenth)")
    p.add_argument("--warmup", type=int, default=30, help="steps of linear warm-up")
    p.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm")
    p.add_argument("--eval-every", type=int, default=50, help="measure the validation loss every this many steps")
    p.add_argument("--eval-seqs", type=int, default=64, help="validation sequences (fixed windows of the held-out files)")
    p.add_argument("--checkpoint-every", type=int, default=200, help="save a sharded checkpoint every this many steps")
    p.add_argument("--stop-after", type=int, default=None,
                   help="save a checkpoint after this step and stop, as if the job were killed (then run with --resume)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out, if there is one")
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "zero-text-lm",
                   help="where the checkpoint (OUT/checkpoint) and the Hugging Face export (OUT/hf) go")
    p.add_argument("--corpus", default=None, help="a directory of .py files instead of the standard library's")
    p.add_argument("--train-mb", type=float, default=4.0, help="size of the training split, cut from the sorted files")
    p.add_argument("--sample-bytes", type=int, default=200, help="bytes of text to generate at the end")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="sampling temperature of that text (0: greedy, which a model this small soon repeats)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--json", type=Path, default=None, help="write the run's figures to this file (rank 0)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.stop_after is not None and not 0 < args.stop_after < args.steps:
        p.error(f"--stop-after {args.stop_after} must be between 1 and --steps - 1 ({args.steps - 1})")
    return args


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # ru_maxrss is in KiB on Linux


def schedule(args: argparse.Namespace) -> Callable[[int], float]:
    """The learning-rate factor of each step: linear warm-up, then a cosine down to a tenth."""

    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def mean_over_ranks(value: float, device: torch.device) -> float:
    total = torch.tensor([value], dtype=torch.float64, device=device)  # nccl reduces device tensors only
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-byte loss over this rank's windows, averaged over ranks (each holds as many)."""
    model.eval()
    losses = [next_byte_loss(model(batch), batch).item() for batch in windows.split(batch_size)]
    model.train()
    return mean_over_ranks(statistics.fmean(losses), windows.device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)

    data: StdlibText = load_stdlib_text(args.corpus, max_train_bytes=int(args.train_mb * 2**20))
    cfg = ByteGPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layer=args.layers, n_head=args.heads)
    torch.manual_seed(args.seed)
    with zero_core.lazy_init():  # meta tensors: no rank ever holds the whole model
        model = ByteGPT(cfg)
    num_params = model.num_params
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model, optimizer = zero_core.shard(model, optimizer)  # replays the initialisers into this rank's shards
    device = model.engine.device
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(args))

    per_rank = args.eval_seqs // world  # every rank runs the same number of forwards: they gather together
    if per_rank == 0:
        raise SystemExit(f"--eval-seqs {args.eval_seqs} leaves no validation sequence for each of the {world} ranks; "
                         f"pass --eval-seqs {world} or more")
    val = data.val_windows(per_rank * world, args.seq_len)[rank * per_rank:(rank + 1) * per_rank].to(device)
    ckpt = args.out / "checkpoint"
    history: dict[str, list] = {"train": [], "val": []}  # [step, loss, grad norm], [step, val loss]
    start = 0
    if args.resume and (ckpt / CHECKPOINT_FILE).exists():  # the same answer on every rank: a shared directory
        extra = zero_core.load_checkpoint(model, optimizer, ckpt)
        scheduler.load_state_dict(extra["scheduler"])
        start, history = extra["step"], extra["history"]
        say(f"resumed from {ckpt} at step {start}", flush=True)
    elif args.resume:
        say(f"no checkpoint in {ckpt} yet: starting from step 0", flush=True)

    def save_checkpoint(step: int) -> None:
        zero_core.save_checkpoint(model, optimizer, ckpt,
                                  extra={"step": step, "scheduler": scheduler.state_dict(), "history": history})
        say(f"step {step:4d}  saved a sharded checkpoint to {ckpt}", flush=True)

    tokens_per_step = args.batch_size * args.accum * args.seq_len * world
    say(f"corpus: {data.root}/*.py\n        {data.train_files} files for training ({len(data.train) / 2**20:.1f} MiB), "
        f"{data.val_files} held out for validation ({len(data.val) / 2**20:.1f} MiB)\n"
        f"model: ByteGPT {num_params / 1e6:.2f}M params (d_model={args.d_model}, layers={args.layers}, "
        f"seq_len={args.seq_len}), built lazily, ZeRO-3 over {world} {backend} ranks\n"
        f"step: {args.accum} micro-batches x {args.batch_size} sequences x {world} ranks = {tokens_per_step:,} tokens; "
        f"{args.steps} steps", flush=True)
    if start == 0:
        history["val"].append([0, evaluate(model, val, args.batch_size)])
        say(f"step    0  val {history['val'][-1][1]:.3f}  (ln 256 = {math.log(256):.3f}: a uniform guess)", flush=True)

    step_times: list[float] = []
    stop = args.stop_after if args.stop_after is not None else args.steps
    timer = StepClock(start, stop)
    for step in range(start, stop):
        t0 = time.perf_counter()
        loss_sum = 0.0
        for micro in range(args.accum):
            rows = data.train_batch(step, micro, args.batch_size * world, args.seq_len, seed=args.seed)
            tokens = rows[rank * args.batch_size:(rank + 1) * args.batch_size].to(device)
            # all but the last micro-batch only accumulate; the last backward reduces the sum once
            window = model.no_sync() if micro < args.accum - 1 else contextlib.nullcontext()
            with window:
                loss = next_byte_loss(model(tokens), tokens) / args.accum
                loss.backward()
            loss_sum += loss.item()
        norm = zero_core.clip_grad_norm_(model, max_norm=args.clip)  # the global norm, before clipping
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
        done = step + 1
        history["train"].append([done, mean_over_ranks(loss_sum, device), norm])
        line = (f"step {done:4d}  loss {history['train'][-1][1]:.3f}  grad-norm {norm:5.2f}  "
                f"lr {lr:.1e}  {tokens_per_step / step_times[-1]:6,.0f} tok/s")
        if done % args.eval_every == 0 or done == args.steps:
            history["val"].append([done, evaluate(model, val, args.batch_size)])
            say(f"{line}  val {history['val'][-1][1]:.3f}  {timer.status(done)}", flush=True)
        elif done % args.log_every == 0:
            say(f"{line}  {timer.status(done)}", flush=True)
        if done % args.checkpoint_every == 0 or done == stop:
            save_checkpoint(done)

    if stop < args.steps:
        say(f"stopped after step {stop} (--stop-after); run again with --resume to continue", flush=True)
    else:
        export = args.out / "hf"
        zero_core.save_full_state_dict(model, export)  # a directory: the Hugging Face format, streamed chunk by chunk
        say(f"exported to {export}: {', '.join(sorted(p.name for p in export.iterdir()))}", flush=True)
    summarise(args, model, history, step_times, tokens_per_step, num_params, time.perf_counter() - started)
    model.close()  # stop zero's helper thread before the process group goes away
    if rank == 0 and stop == args.steps:
        sample_from_export(args, cfg, data, history)
    dist.destroy_process_group()
    return 0


def summarise(args: argparse.Namespace, model: torch.nn.Module, history: dict[str, list], step_times: list[float],
              tokens_per_step: int, num_params: int, wall_s: float) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    stats = model.comm_stats
    sent = sum(count.bytes_sent for count in stats.totals.values())
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"peak_rss_mib": peak_rss_mib(), "bytes_sent": sent, "steps": stats.step_count})
    if rank != 0:
        return
    train, val = history["train"], history["val"]
    tokens_per_s = tokens_per_step / statistics.median(step_times) if step_times else float("nan")
    peaks = ", ".join(f"{r['peak_rss_mib']:.0f}" for r in per_rank)
    sent_per_step = ", ".join(f"{r['bytes_sent'] / max(1, r['steps']) / 2**20:.1f}" for r in per_rank)
    print(f"summary: {len(train)} steps ({len(step_times)} in this run, {clock(wall_s)} in all), {num_params / 1e6:.2f}M params, "
          f"train loss {train[0][1]:.3f} -> {train[-1][1]:.3f}, val loss {val[0][1]:.3f} -> {val[-1][1]:.3f}\n"
          f"         {tokens_per_s:,.0f} tokens/s, peak RSS per rank [{peaks}] MiB, sent per rank per step [{sent_per_step}] MiB",
          flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"world_size": world, "params": num_params, "train": train, "val": val,
                                         "tokens_per_s": tokens_per_s, "wall_s": wall_s, "peak_rss_mib": [r["peak_rss_mib"] for r in per_rank],
                                         "bytes_sent": [r["bytes_sent"] for r in per_rank]}, indent=1))


def sample_from_export(args: argparse.Namespace, cfg: ByteGPTConfig, data: StdlibText, history: dict[str, list]) -> None:
    """Rank 0 alone: the export is a plain state dict, so a plain model loads it strictly, without zero."""
    plain = ByteGPT(cfg)
    plain.load_state_dict(load_file(args.out / "hf" / "model.safetensors"), strict=True)
    plain.eval()
    windows = data.val_windows(args.eval_seqs // dist.get_world_size() * dist.get_world_size(), args.seq_len)
    with torch.no_grad():
        reloaded = statistics.fmean(next_byte_loss(plain(b), b).item() for b in windows.split(args.batch_size))
    print(f"reloaded the export into a plain ByteGPT: val loss {reloaded:.3f} (the sharded model's: {history['val'][-1][1]:.3f})")
    text = plain.generate(torch.tensor(list(PROMPT.encode())), args.sample_bytes, temperature=args.temperature, seed=args.seed)
    print(f"sample (temperature {args.temperature}, seed {args.seed}):\n" + bytes(text.tolist()).decode("utf-8", errors="replace").rstrip(),
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
