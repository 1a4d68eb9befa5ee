"""Host memory per parameter of fp32-master AdamW: zero's gemini against FSDP2 + ``CPUOffloadPolicy`` on the same
model in the same run (issue 48, item 4). Works on the CPU as well as on a GPU.

Each system runs in a process of its own (a fresh resident set to grow from) through the capacity section's
attempt: built lazily, set up, 3 steps and a 4th with its copies counted, host memory measured over build, setup
and the first step (see [Note: host bytes per parameter] in ``zero_bench.host_memory``). The default model is
GPT-2-small's shape (124M parameters) at sequence 128 and batch 1, small enough to step on a CPU.

    python -m zero_bench.gpu.host_per_param            # the CPU, or the GPU when there is one
    python -m zero_bench.gpu.host_per_param --dry-run  # a tiny model, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

SHAPE = {"vocab_size": 50257, "seq_len": 128, "d_model": 768, "n_head": 12}  # 124M parameters at depth 12
DEPTH, BATCH = 12, 1
DRY_SHAPE, DRY_DEPTH = {"vocab_size": 256, "seq_len": 32, "d_model": 64, "n_head": 4}, 2
SYSTEMS = ("fsdp2-offload", "zero-gemini")
FIELDS = ("host_B_per_param", "host_peak_B_per_param", "host_rss_B_per_param", "host_peak_rss_B_per_param")


def measure_one(name: str, *, device: torch.device, shape: dict[str, int], depth: int, batch: int,
                budget_gib: float) -> dict[str, Any]:
    """One system in this process (its process group set up by the caller): the capacity section's row."""
    from zero_bench.gpu import capacity

    system = next(s for s in capacity.SYSTEMS if s.name == name)
    disk_dir = tempfile.mkdtemp(prefix="zero-host-per-param-")
    env = capacity.Env(device=device, dry_run=False, budget_gib=budget_gib, shape=shape, batch=batch,
                       host_cap=int(capacity.HOST_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
                       disk_dir=disk_dir, disk_budget=0)
    attempt = capacity._attempt(system, env, depth)
    return {"name": name, "params": env.config(depth).num_params, "status": attempt.status, "detail": attempt.detail,
            **{k: attempt.measured.get(k) for k in (*FIELDS, "tokens_per_s")}}


def compare(*, dry_run: bool = False, device: str | None = None, budget_gib: float = 4.0,
            systems: Sequence[str] = SYSTEMS, timeout_s: float = 900) -> dict[str, Any]:
    """Each system in a fresh process; rows with host bytes per parameter (tensors at the end and at the peak,
    exact; the resident set's growth at the end and at the peak)."""
    device = device or ("cuda" if torch.cuda.is_available() and not dry_run else "cpu")
    rows = []
    if dry_run and torch.distributed.is_initialized():  # inside the report's dry run: in this process, no spawn
        for name in systems:
            rows.append(measure_one(name, device=torch.device(device), shape=DRY_SHAPE, depth=DRY_DEPTH, batch=2,
                                    budget_gib=budget_gib))
        systems = ()
    for name in systems:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "row.json")
            cmd = [sys.executable, "-m", "zero_bench.gpu.host_per_param", "--one", name, "--json-out", out,
                   "--device", device, "--device-budget-gib", str(budget_gib)] + (["--dry-run"] if dry_run else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            if proc.returncode == 0 and os.path.exists(out):
                with open(out) as f:
                    rows.append(json.load(f))
            else:
                rows.append({"name": name, "status": "error", "detail": (proc.stderr or proc.stdout)[-500:]})
    shape, depth = (DRY_SHAPE, DRY_DEPTH) if dry_run else (SHAPE, DEPTH)
    return {"device": device, "dry_run": dry_run, "shape": {**shape, "n_layer": depth, "batch": 2 if dry_run else BATCH},
            "rows": rows}


def render(result: dict[str, Any]) -> list[str]:
    shape = result["shape"]
    lines = ["\n## Host memory per parameter\n",
             f"fp32-master AdamW on a GPT (d_model {shape['d_model']}, {shape['n_layer']} layers, vocabulary "
             f"{shape['vocab_size']}, sequence {shape['seq_len']}, batch {shape['batch']}; device {result['device']}), "
             "each system in a fresh process, measured over build, setup and the first step "
             "(`zero_bench.gpu.host_per_param`). Tensors: the host storages made then, exact, alive at the end and at "
             "their peak; resident: the resident set's growth, at the end and at its peak. The floor is 12 bytes "
             "(the fp32 master and AdamW's two moments).",
             "", "| system | params (M) | outcome | tensors B/param | tensors at peak | resident B/param | resident at peak |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        params = row.get("params")
        lines.append("| " + " | ".join(str(v) if v is not None else "n/a" for v in (
            row["name"], None if params is None else round(params / 1e6, 1), row["status"],
            *(row.get(k) for k in FIELDS))) + " |")
        if row["status"] != "fit":
            lines.append(f"\n{row['name']}: {str(row.get('detail'))[:300]}\n")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zero_bench.gpu.host_per_param", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="a tiny model")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    p.add_argument("--device-budget-gib", type=float, default=4.0, help="gemini's device budget (and the cap on CUDA)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process: one system
    p.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one is None:
        result = compare(dry_run=args.dry_run, device=args.device, budget_gib=args.device_budget_gib)
        print("\n".join(render(result)))
        print(json.dumps(result, indent=1))
        return 0 if all(r["status"] == "fit" for r in result["rows"]) else 1
    device = torch.device(args.device if args.device != "cuda" else "cuda:0")
    shape, depth, batch = (DRY_SHAPE, DRY_DEPTH, 2) if args.dry_run else (SHAPE, DEPTH, BATCH)
    with tempfile.TemporaryDirectory() as tmp:
        # world size 1 through a file rendezvous (FSDP2 needs a process group): no port to collide with
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                             init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0, world_size=1)
        row = measure_one(args.one, device=device, shape=shape, depth=depth, batch=batch, budget_gib=args.device_budget_gib)
        torch.distributed.destroy_process_group()
    with open(args.json_out, "w") as f:
        json.dump(row, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
