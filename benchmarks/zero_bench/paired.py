"""Two source trees' host cost per step, paired: one worker process per (row, tree), each taking one training step of
the bench's mlp-48 model per round in a shuffled order, so a change of load hits both trees alike.

    python -m zero_bench.paired BEFORE_TREE AFTER_TREE [--rounds N] [--process-group] [--stages 3,2]

A tree is a checkout (for example ``git archive REV | tar -x -C DIR``); each worker imports zero and ``zero_bench``
from its own tree. Prints each worker's median process CPU time per phase (zero_grad, forward with the loss,
backward, optimizer step), the median of the per-round after/before step ratios with their quartiles, and whether
the two trees' losses were bitwise identical at every step. ``host_cpu`` compares rows inside one process;
this compares trees.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

WARMUP = 5


def _pythonpath(tree: Path) -> str:
    sources = sorted(str(p) for p in (*tree.glob("packages/*/src"), *tree.glob("packages/strategies/*/src")))
    return os.pathsep.join([*sources, str(tree / "benchmarks")])


def _worker(stage: str, process_group: bool) -> None:
    """A step per line read on stdin; prints its phases' CPU seconds and the loss."""
    import tempfile
    import time

    import torch
    import torch.nn.functional as F

    if process_group:
        import torch.distributed as dist

        rendezvous = os.path.join(tempfile.mkdtemp(prefix="paired-"), "rendezvous")
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    from zero_bench.host_cpu import BATCH, SEQ, VOCAB, build

    torch.set_num_threads(1)
    model, opt = build(None if stage == "plain" else int(stage))
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    clock = time.process_time
    print("ready", flush=True)
    for _ in sys.stdin:
        a = clock()
        opt.zero_grad()
        b = clock()
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        c = clock()
        loss.backward()
        d = clock()
        opt.step()
        e = clock()
        print(b - a, c - b, d - c, e - d, loss.item(), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--process-group", action="store_true", help="each worker makes a one-rank gloo group first")
    p.add_argument("--stages", default="3,2", help="comma-separated stages ('plain' for plain PyTorch)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.process_group)
        return
    stages = args.stages.split(",")
    workers: dict[tuple[str, str], subprocess.Popen[str]] = {}
    for stage in stages:
        for name, tree in (("before", args.before), ("after", args.after)):
            env = dict(os.environ, PYTHONPATH=_pythonpath(tree.resolve()), OMP_NUM_THREADS="1")
            # this file, run as a script (-P: its folder stays off sys.path), so that a tree older than it still works;
            # zero and zero_bench come from the tree
            cmd = [sys.executable, "-P", str(Path(__file__).resolve()), str(tree), str(tree), "--worker", stage]
            proc = subprocess.Popen(cmd + (["--process-group"] if args.process_group else []), env=env,
                                    cwd=tree / "benchmarks", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert proc.stdin is not None and proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"the {name} worker of stage {stage} did not start ({tree})")
            workers[(stage, name)] = proc
    phases: dict[tuple[str, str], list[list[float]]] = {k: [] for k in workers}
    losses: dict[tuple[str, str], list[str]] = {k: [] for k in workers}
    order = list(workers)
    rng = random.Random(0)
    for i in range(WARMUP + args.rounds):
        rng.shuffle(order)
        for key in order:
            proc = workers[key]
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
            values = proc.stdout.readline().split()
            if i >= WARMUP:
                phases[key].append([float(v) for v in values[:4]])
            losses[key].append(values[4])
    for (stage, name), rows in phases.items():
        medians = [statistics.median(r[j] for r in rows) * 1e3 for j in range(4)]
        total = statistics.median(sum(r) for r in rows) * 1e3
        print(f"{stage:5s} {name:6s} step {total:6.2f} ms  zero_grad {medians[0]:5.2f} forward {medians[1]:5.2f} "
              f"backward {medians[2]:5.2f} step {medians[3]:5.2f}")
    for stage in stages:
        before, after = phases[(stage, "before")], phases[(stage, "after")]
        ratios = sorted(sum(y) / sum(x) for x, y in zip(before, after, strict=True))
        diff = statistics.median(sum(y) - sum(x) for x, y in zip(before, after, strict=True)) * 1e3
        print(f"{stage}: paired after-before median {diff:+.2f} ms, after/before median ratio "
              f"{statistics.median(ratios):.3f} (IQR {ratios[len(ratios) // 4]:.3f}-{ratios[3 * len(ratios) // 4]:.3f})")
        same = losses[(stage, "before")] == losses[(stage, "after")]
        print(f"{stage}: losses identical before/after over {WARMUP + args.rounds} steps: {same}")
    for proc in workers.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()


if __name__ == "__main__":
    main()
