"""The command line and the order of the sections."""

from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from zero_bench.gpu.report import Report

_EPILOG = """\
examples:
  nox -s gpu -- --out gpu-report                 # on a GPU machine: about 8 minutes on one H100
  python -m zero_bench.gpu --out gpu-report      # the same without nox (zero installed, torch with CUDA)
  nox -s gpu -- --dry-run --out /tmp/dry          # every section on the CPU with tiny sizes (about a minute)"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    import zero_bench.gpu

    p = argparse.ArgumentParser(prog="python -m zero_bench.gpu", description=zero_bench.gpu.__doc__, epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for report.md and results.json")
    p.add_argument("--dry-run", action="store_true", help="CPU and gloo, tiny sizes: checks the command end to end")
    p.add_argument("--budget-s", type=float, default=540.0, help="sections that would start after this are skipped")
    p.add_argument("--device-budget-gib", type=float, default=8.0, help="device memory for the largest-model section")
    p.add_argument("--batch", type=int, default=8, help="sequences per step in the training section")
    p.add_argument("--steps", type=int, default=10, help="timed steps in the training section")
    p.add_argument("--skip", default="", help="comma-separated sections to leave out: "
                   "bandwidth, gloo, training, tests, disk, host-memory, capacity")
    p.add_argument("--capacity-systems", default="", help="comma-separated systems of the largest-model section "
                   "(default: all): torch, fsdp2-offload, zero-gemini, zero-gemini-disk")
    p.add_argument("--capacity-depths", default="", help="comma-separated GPT depths of the largest-model section "
                   "(default: 8,16,32,64 at d_model 2048; 1,2,4,8 in a dry run)")
    p.add_argument("--root", default=os.getcwd(), help="the zero checkout whose tests run (default: here)")
    return p.parse_args(argv)


def _init_process_group(device: torch.device, out: str) -> None:
    """World size 1 through a file rendezvous: no port to collide with a test running beside it."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    rendezvous = os.path.join(out, ".rendezvous")
    if os.path.exists(rendezvous):
        os.remove(rendezvous)
    options = {"device_id": device} if device.type == "cuda" else {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{rendezvous}", rank=0,
                            world_size=1, timeout=timedelta(minutes=3), **options)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("no CUDA device: run on a GPU machine, or pass --dry-run to check the command on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    report = Report(args.out, args.budget_s)
    # a hang still leaves every thread's stack in the log before the caller's own limit
    faulthandler.dump_traceback_later(args.budget_s + 45, exit=False)
    report.block("head", [f"# zero on one GPU ({time.strftime('%Y-%m-%d %H:%M')})"
                          + (" - DRY RUN (CPU, gloo, tiny sizes)" if args.dry_run else ""),
                          f"\ncommand: `python -m zero_bench.gpu {' '.join(sys.argv[1:] if argv is None else argv)}`"])
    _init_process_group(device, args.out)
    from zero_bench.gpu import cuda_tests, environment, training

    facts = report.section("environment", lambda: environment.environment(report, device)) or {}
    rows = [] if "bandwidth" in skip else report.section(
        "bandwidth", lambda: environment.bandwidth(report, device, args.dry_run)) or []
    if "gloo" not in skip:
        os.environ["ZERO_TEST_DEVICE"] = device.type
        report.section("gloo", lambda: environment.gloo_collectives(report))
    # the sections' deadlines share out the budget so that the later ones still run
    if "training" not in skip:
        report.section("training", lambda: training.run_training(
            report, device, args.dry_run, deadline_s=report.elapsed() + 0.25 * args.budget_s, batch=args.batch,
            timed=args.steps))
    if "tests" not in skip:
        # each test starts 1-4 rank processes: 8 workers keep 16 cores busy
        workers = 1 if args.dry_run or importlib.util.find_spec("xdist") is None else min(8, max(1, (os.cpu_count() or 1) // 2))
        report.section("tests", lambda: cuda_tests.run_cuda_tests(
            report, args.root, device.type, args.dry_run, deadline_s=report.elapsed() + 0.4 * args.budget_s,
            workers=workers))
    if "disk" not in skip:
        def disk_section() -> None:
            from zero_bench.gpu import disk

            # /var/tmp is on disk where /tmp may be memory (tmpfs)
            where = "/var/tmp" if os.path.isdir("/var/tmp") else args.out
            result = disk.disk_bandwidth(where, total_bytes=(16 if args.dry_run else 4096) << 20,
                                         file_bytes=(4 if args.dry_run else 256) << 20)
            report.results["sections"]["disk"] = result
            report.block("disk", disk.render(result))
        report.section("disk", disk_section)
    if "host-memory" not in skip:
        def host_memory() -> None:
            from zero_bench.gpu import host_per_param

            result = host_per_param.compare(dry_run=args.dry_run, device=device.type,
                                            budget_gib=args.device_budget_gib)
            report.results["sections"]["host memory"] = result
            report.block("host-memory", host_per_param.render(result))
        report.section("host-memory", host_memory)
    if "capacity" not in skip:
        def largest() -> None:
            from zero_bench.gpu import capacity

            result = capacity.run_capacity(device=device, dry_run=args.dry_run, budget_gib=args.device_budget_gib,
                                           deadline_s=max(30.0, args.budget_s - report.elapsed() - 15), log=report.log,
                                           systems=[s for s in args.capacity_systems.split(",") if s] or None,
                                           depths=[int(d) for d in args.capacity_depths.split(",") if d] or None)
            pinned = next((r["GB/s median"] for r in rows if r["direction"] == "H2D"), None)
            result["pinned_H2D_GBps"] = pinned
            report.results["sections"]["capacity"] = result
            report.block("capacity", capacity.render_capacity(result))
        report.section("capacity", largest)
    errors = report.results["errors"]
    report.block("end", [f"\ntotal wall time {report.elapsed():.0f} s; {len(errors)} error(s)"
                         + (": " + "; ".join(f"{e['section']}: {e['error'][:200]}" for e in errors) if errors else ""),
                         f"\nmachine: {facts.get('GPU', 'CPU (dry run)')}"])
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()
    if os.path.exists(os.path.join(args.out, ".rendezvous")):
        os.remove(os.path.join(args.out, ".rendezvous"))
    print(report.render(), flush=True)
    return 0
