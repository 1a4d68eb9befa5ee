"""Host CPU time and Python calls per step on the bench's mlp-48 model at one rank: plain PyTorch, zero chunk
stage 3 and stage 2 (one chunk per block), trained side by side with their steps interleaved (plain, s3, s2, plain,
...), so load changes hit all three alike. Prints the median process CPU time per step of each, its ratio to plain,
the same for the step's zero_grad, forward and backward alone (``zero_bench.grad_groups`` measures those of other
designs), and the Python function calls of one step (cProfile, load-independent), in all and by phase (zero_grad,
forward with the loss, backward, optimizer step).

    python -m zero_bench.host_cpu [STEPS] [--process-group] [-v]

``--process-group`` first makes a one-rank gloo process group, as ``torchrun`` and the bench's workers do: zero's
sharded parameters are then DTensors (plain PyTorch's stay tensors), which is how users train.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from zero_bench.mlp import ThinMLP, block_params
from zero_core import ChunkPolicy, ZeroConfig, shard

VOCAB, WIDTH, LAYERS, BATCH, SEQ = 64, 32, 48, 4, 16


def build(stage: int | None):
    torch.manual_seed(0)
    model = ThinMLP(vocab=VOCAB, width=WIDTH, layers=LAYERS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if stage is None:
        return model, opt
    return shard(model, opt, config=ZeroConfig(stage=stage, chunk=ChunkPolicy(search_interval=WIDTH,
                                                                               chunk_size=block_params(WIDTH))))


def step(model, opt, tokens):
    opt.zero_grad()
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    return loss.item()


def phase_calls(model, opt, tokens) -> dict[str, int]:
    """The Python function calls of each phase of one step (cProfile's ``total_calls``, a profiler per phase)."""
    calls: dict[str, int] = {}

    def profiled(name, fn):
        prof = cProfile.Profile()
        prof.enable()
        result = fn()
        prof.disable()
        calls[name] = pstats.Stats(prof).total_calls  # type: ignore[attr-defined]
        return result

    profiled("zero_grad", opt.zero_grad)
    loss = profiled("forward", lambda: F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB),
                                                      tokens[:, 1:].reshape(-1)))
    profiled("backward", loss.backward)
    profiled("step", opt.step)
    return calls


def main() -> None:
    torch.set_num_threads(1)
    numbers = [a for a in sys.argv[1:] if a.isdigit()]
    steps = int(numbers[0]) if numbers else 30
    if "--process-group" in sys.argv:
        import os
        import tempfile

        import torch.distributed as dist
        rendezvous = os.path.join(tempfile.mkdtemp(prefix="host-cpu-"), "rendezvous")
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    rows = {"plain": build(None), "s3": build(3), "s2": build(2)}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(steps + 5)]
    for m, o in rows.values():  # warm-up
        for b in batches[:5]:
            step(m, o, b)
    cpu: dict[str, list[float]] = {k: [] for k in rows}
    # zero_grad, forward with the loss, backward (what zero_bench.grad_groups compares), then the whole step
    passes: dict[str, list[float]] = {k: [] for k in rows}
    for b in batches[5:]:
        for name, (m, o) in rows.items():
            t = time.process_time()
            o.zero_grad()
            loss = F.cross_entropy(m(b[:, :-1]).reshape(-1, VOCAB), b[:, 1:].reshape(-1))
            loss.backward()
            passes[name].append(time.process_time() - t)
            o.step()
            loss.item()
            cpu[name].append(time.process_time() - t)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    for k, v in med.items():
        print(f"{k:6s} cpu/step {v * 1e3:7.2f} ms  {v / med['plain']:.2f}x plain")
    med_passes = {k: statistics.median(v) for k, v in passes.items()}
    for k, v in med_passes.items():
        print(f"{k:6s} zero_grad+forward+backward cpu/step {v * 1e3:7.2f} ms  {v / med_passes['plain']:.2f}x plain")
    for name, (m, o) in rows.items():
        prof = cProfile.Profile()
        prof.enable()
        step(m, o, batches[0])
        prof.disable()
        stats = pstats.Stats(prof)
        print(f"{name:6s} python calls/step {stats.total_calls}")  # type: ignore[attr-defined]
        by_phase = phase_calls(m, o, batches[1])
        print(f"{name:6s} python calls by phase " + " ".join(f"{k} {v}" for k, v in by_phase.items()))
        if "-v" in sys.argv and name != "plain":
            stats.sort_stats("tottime").print_stats(25)
    for m, _ in rows.values():
        if hasattr(m, "close"):
            m.close()
    if "--process-group" in sys.argv:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
