"""The machine: ``zero env``, a matmul calibration, copy bandwidth, and gloo's CUDA collectives."""

from __future__ import annotations

import statistics
import subprocess
import time
from typing import Any

import torch
import torch.distributed as dist

from zero_bench.gpu.report import Report, table


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def environment(report: Report, device: torch.device) -> dict[str, Any]:
    from zero_core import environment_report

    env = environment_report()
    facts: dict[str, Any] = {"torch": env["torch"].get("version"), "CUDA build": env["torch"].get("cuda_build"),
                             "cuDNN": env["torch"].get("cudnn"), "NCCL": env["torch"].get("nccl"),
                             "python": env["python"]["version"], "platform": env["platform"],
                             "zero distributions": ", ".join(f"{d['name']} {d['version']}" for d in env["distributions"])
                             if isinstance(env["distributions"], list) else env["distributions"],
                             "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update({"GPU": props.name, "compute capability": f"{props.major}.{props.minor}",
                      "SMs": props.multi_processor_count, "GPU memory GiB": round(props.total_memory / 2**30, 1),
                      "driver": _nvidia_smi("driver_version"), "clocks / power": _nvidia_smi("clocks.max.sm,power.limit")})
        facts["bf16 matmul 8192^3 TFLOP/s"] = _matmul_tflops(device, 8192)
    report.results["sections"]["environment"] = {"facts": facts, "zero env": env}
    report.block("environment", ["\n## Environment\n", "From `zero env` (the full report is in results.json):\n",
                                 *table(["item", "value"], [[k, v] for k, v in facts.items()])])
    return facts


def _nvidia_smi(query: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        return f"<{type(err).__name__}: {err}>"


def _matmul_tflops(device: torch.device, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return round(2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12, 1)


def bandwidth(report: Report, device: torch.device, dry_run: bool) -> list[dict[str, Any]]:
    """Host<->device copies of one buffer, pinned and pageable; the offload path is compared with these."""
    mib = 8 if dry_run else 256
    nbytes, reps = mib * 2**20, 2 if dry_run else 10
    on_device = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    rows = []
    for pinned in (True, False) if device.type == "cuda" else (False,):
        host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=pinned).fill_(2.0)  # faults the pages in
        for direction in ("H2D", "D2H"):
            src, dst = (host, on_device) if direction == "H2D" else (on_device, host)
            times = []
            for _ in range(reps + 1):
                sync(device)
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=pinned)
                sync(device)
                times.append(time.perf_counter() - t0)
            times = times[1:]  # the first copy warms up
            rows.append({"memory": "pinned" if pinned else "pageable", "direction": direction, "MiB": mib,
                         "GB/s median": round(nbytes / 1e9 / statistics.median(times), 2),
                         "GB/s best": round(nbytes / 1e9 / min(times), 2)})
    report.results["sections"]["bandwidth"] = rows
    report.block("bandwidth", [
        "\n## Host <-> device copy bandwidth\n",
        f"{mib} MiB fp32 buffer, {reps} timed copies after one warm-up, wall clock around synchronize; pinned copies "
        "are `non_blocking`." + (" (Dry run: the 'device' is the CPU.)" if device.type != "cuda" else "") + "\n",
        *table(["memory", "direction", "GB/s (median)", "GB/s (best)"],
               [[r["memory"], r["direction"], r["GB/s median"], r["GB/s best"]] for r in rows])])
    return rows


# Each collective zero's torch backend issues, on the device under test, between 2 ranks over gloo.
_PROBES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "barrier")


def _probe_rank() -> dict[str, str]:
    from zero_core.testing import device_under_test

    device = torch.device("cuda", torch.cuda.current_device()) if device_under_test() == "cuda" else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, str] = {}
    for name in _PROBES:
        try:
            x = torch.arange(4 * world, dtype=torch.float32, device=device) + rank
            if name == "all_reduce":
                dist.all_reduce(x)
                ok = torch.equal(x.cpu(), (torch.arange(4.0 * world) * world + sum(range(world))))
            elif name == "broadcast":
                dist.broadcast(x, src=0)
                ok = torch.equal(x.cpu(), torch.arange(4.0 * world))
            elif name == "all_gather_into_tensor":
                y = torch.empty(4 * world * world, device=device)
                dist.all_gather_into_tensor(y, x)
                ok = torch.equal(y.cpu(), torch.cat([torch.arange(4.0 * world) + r for r in range(world)]))
            elif name == "reduce_scatter_tensor":
                y = torch.empty(4, device=device)
                dist.reduce_scatter_tensor(y, x)
                ok = torch.equal(y.cpu(), (torch.arange(4.0 * world) * world + sum(range(world)))[rank * 4:(rank + 1) * 4])
            elif name == "all_to_all_single":
                y = torch.empty_like(x)
                dist.all_to_all_single(y, x)
                ok = torch.equal(y.cpu(), torch.cat([torch.arange(4.0 * world)[rank * 4:(rank + 1) * 4] + r for r in range(world)]))
            else:
                dist.barrier()
                ok = True
            out[name] = "ok" if ok else "WRONG VALUES"
        except Exception as err:  # noqa: BLE001 - the point is to find which ones fail
            out[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return out


def gloo_collectives(report: Report) -> dict[str, str]:
    """Which collectives gloo runs on the device under test's tensors (ranks sharing one GPU use gloo)."""
    from zero_core.testing import device_under_test, run_distributed

    results = run_distributed(_probe_rank, 2, backend="gloo", timeout=120)
    merged = {name: results[0][name] if results[0][name] == results[1][name] else f"rank 0: {results[0][name]}; "
              f"rank 1: {results[1][name]}" for name in _PROBES}
    report.results["sections"]["gloo collectives"] = {"device": device_under_test(), "results": merged}
    report.block("gloo", ["\n## gloo collectives on the device under test\n",
                          f"2 ranks, gloo, {device_under_test()} tensors (ranks that share a GPU use gloo):\n",
                          *table(["collective", "result"], [[k, v] for k, v in merged.items()])])
    return merged
