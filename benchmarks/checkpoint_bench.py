"""Seconds and peak RSS per rank of setup (eager vs lazy), sharded checkpoints and full state dicts.

Runs the demo GPT (``examples/train_gpt.py``'s defaults: 23.2M parameters, tied embeddings)
on N gloo ranks in fresh processes and prints a Markdown table; ``--json`` writes the figures.

    python benchmarks/checkpoint_bench.py                      # 2 ranks, glibc's default allocator
    python benchmarks/checkpoint_bench.py --live-memory        # freed memory returned to the OS at once

Peak RSS is each rank's high-water mark during the phase minus its resident memory just
before it (``/proc/self/clear_refs`` resets the mark), so it is what the phase itself added.
With glibc's default allocator freed blocks are often kept for reuse, so a later phase may
add less than it uses; ``--live-memory`` sets ``M_MMAP_THRESHOLD`` to 64 KiB so that every
large block is unmapped when freed and the figures are the phase's live peak.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zero_core import ChunkPolicy, ZeroConfig, lazy_init, load_checkpoint, save_checkpoint, save_full_state_dict, shard
from zero_core.testing import run_distributed
from zero_core.testing.gpt import GPT, GPTConfig, SyntheticTokens, lm_loss


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


class _Phase:
    """Times a phase (every rank, between barriers) and measures the RSS it added at its peak."""

    def __init__(self, results: dict, name: str) -> None:
        self.results, self.name = results, name

    def __enter__(self) -> _Phase:
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.rss = _status("VmRSS:")
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        dist.barrier()
        self.results[self.name] = {"seconds": time.perf_counter() - self.start,
                                   "peak_rss_added_mib": (_status("VmHWM:") - self.rss) / 2**20,
                                   "peak_rss_mib": _status("VmHWM:") / 2**20}


def _cfg(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_layer=args.layers,
                     n_head=args.heads)


def _build(args: argparse.Namespace, lazy: bool):
    torch.manual_seed(0)
    if lazy:
        with lazy_init():
            model = GPT(_cfg(args))
    else:
        model = GPT(_cfg(args))
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=args.chunk_size, search_interval=args.d_model))
    return shard(model, torch.optim.AdamW(model.parameters(), lr=6e-4), config=config)


def _worker(args: argparse.Namespace, directory: str) -> dict:
    if args.live_memory:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    small = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layer=1, n_head=2)
    with lazy_init():  # torch imports its meta kernels once per process; not part of any phase
        GPT(small)
    results: dict = {}
    rank, world = dist.get_rank(), dist.get_world_size()
    for lazy in (False, True):
        with _Phase(results, "setup, lazy" if lazy else "setup, eager"):
            model, opt = _build(args, lazy)
        if lazy:
            break
        model.close()
    data = SyntheticTokens(vocab_size=args.vocab, seq_len=args.seq_len)
    for step in range(2):  # optimizer states exist after a step
        tokens = data.batch(step, args.batch_size * world)[rank * args.batch_size:(rank + 1) * args.batch_size]
        opt.zero_grad(set_to_none=True)
        lm_loss(model(tokens), tokens).backward()
        opt.step()
    ckpt = Path(directory) / "sharded"
    with _Phase(results, "sharded checkpoint, save"):
        save_checkpoint(model, opt, ckpt)
    with _Phase(results, "full state dict, save (.safetensors, streamed)"):
        save_full_state_dict(model, Path(directory) / "model.safetensors")
    with _Phase(results, "full state dict, save (.pt)"):
        save_full_state_dict(model, Path(directory) / "model.pt")
    reference = model.full_parameters()
    model.close()
    fresh, fresh_opt = _build(args, lazy=True)
    with _Phase(results, "sharded checkpoint, load"):
        load_checkpoint(fresh, fresh_opt, ckpt)
    loaded = fresh.full_parameters()
    assert all(torch.equal(loaded[n], reference[n]) for n in reference), "the sharded checkpoint did not round-trip"
    with _Phase(results, "full state dict, load (.safetensors)"):
        fresh.load_full_state_dict(Path(directory) / "model.safetensors")
    with _Phase(results, "full state dict, load (.pt, memory-mapped)"):
        fresh.load_full_state_dict(Path(directory) / "model.pt")
    fresh.close()
    if rank == 0:
        sizes = {"sharded checkpoint": sum(p.stat().st_size for p in ckpt.iterdir()),
                 "model.safetensors": (Path(directory) / "model.safetensors").stat().st_size,
                 "model.pt": (Path(directory) / "model.pt").stat().st_size}
        results["bytes_on_disk"] = sizes
    results["model_params"] = sum(p.numel() for p in reference.values())
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--live-memory", action="store_true", help="return freed memory to the OS at once (M_MMAP_THRESHOLD)")
    p.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    directory = args.dir or tempfile.mkdtemp(prefix="zero-ckpt-bench-")
    try:
        per_rank = run_distributed(_worker, args.world_size, args, directory, timeout=1200)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    phases = [k for k, v in per_rank[0].items() if isinstance(v, dict) and "seconds" in v]
    print(f"demo GPT, {per_rank[0]['model_params'] / 1e6:.1f}M parameters, {args.world_size} gloo ranks, torch "
          f"{torch.__version__}, {'live memory (M_MMAP_THRESHOLD=64KiB)' if args.live_memory else 'glibc default allocator'}")
    print("| phase | seconds | peak RSS added per rank (MiB) | peak RSS per rank (MiB) |")
    print("|---|---|---|---|")
    for phase in phases:
        seconds = max(r[phase]["seconds"] for r in per_rank)
        added = " / ".join(f"{r[phase]['peak_rss_added_mib']:.0f}" for r in per_rank)
        peak = " / ".join(f"{r[phase]['peak_rss_mib']:.0f}" for r in per_rank)
        print(f"| {phase} | {seconds:.2f} | {added} | {peak} |")
    sizes = per_rank[0].get("bytes_on_disk", {})
    print("bytes on disk: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items()))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "per_rank": per_rank, "torch": torch.__version__,
                       "median_seconds": {ph: statistics.median(r[ph]["seconds"] for r in per_rank) for ph in phases}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
