"""zero against torch DDP on the demo model, in one run, on the same ranks and data.

Each configuration trains in its own pair of torchrun-launched processes (so peak RSS
is per configuration), for the same number of steps. The table reports the median step
time after warm-up, tokens/s, peak RSS per rank, and the ratios to DDP; it fails when
the configurations' losses disagree, so a strategy that trains a different model shows
up as a failure instead of a fast row. fp32 runs must match DDP's losses within
``--loss-rtol``; 16-bit runs, which round differently by design, within ``--loss-rtol-16``.

    python benchmarks/compare_ddp.py --steps 20
    python benchmarks/compare_ddp.py --configs zero-s1,zero-s2 --d-model 768 --layers 12 --heads 12 --vocab 50304
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

CONFIGS = {
    "ddp": ["--mode", "ddp"],
    **{f"zero-s{stage}": ["--mode", "zero", "--stage", str(stage)] for stage in (1, 2, 3)},
    "zero-s3-static": ["--mode", "zero", "--stage", "3", "--static-graph"],
    **{f"zero-s{stage}-{precision}": ["--mode", "zero", "--stage", str(stage), "--precision", precision]
       for precision in ("bf16", "fp16") for stage in (1, 2, 3)},
    **{f"tensor-s{stage}": ["--mode", "zero", "--strategy", "tensor", "--stage", str(stage)] for stage in (1, 2, 3)},
    "tensor-s3-unbucketed": ["--mode", "zero", "--strategy", "tensor", "--stage", "3", "--comm", "torch"],
    "tensor-s3-bf16": ["--mode", "zero", "--strategy", "tensor", "--stage", "3", "--precision", "bf16"],
    # zero-offload on the demo model at 2 ranks (model states 16 B x 23.2M / 2 = 186 MB per rank; the warm-up
    # measures 153 MB of activations at the peak): everything on the host; Gemini with a device budget of the
    # activations plus half the model states (235 MiB); the same with a host budget below the model states
    # (100 MiB), the rest on disk under the system's temporary directory.
    "offload-static-full": ["--mode", "zero", "--placement", "static", "--placement-options",
                            json.dumps({"offload_optim_frac": 1.0, "offload_param_frac": 1.0})],
    "offload-gemini-half": ["--mode", "zero", "--placement", "gemini", "--placement-options",
                            json.dumps({"device_budget_mb": 235})],
    "offload-gemini-disk": ["--mode", "zero", "--placement", "gemini", "--placement-options",
                            json.dumps({"device_budget_mb": 235, "host_budget_mb": 100, "disk_dir": tempfile.gettempdir()})],
}
DEFAULT = ["ddp", "zero-s1", "zero-s2", "zero-s3", "zero-s3-static", "tensor-s3", "tensor-s3-unbucketed"]


def run(name: str, extra: list[str], args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           str(ROOT / "examples" / "train_gpt.py"), *extra, "--steps", str(args.steps), "--time-budget", "1e9",
           "--no-progress", "--log-every", "1000", "--json", str(out), *args.model_args]
    print(f"running {name}: {' '.join(cmd[3:])}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(out.read_text())


def table(results: dict[str, dict]) -> str:
    base = results["ddp"]
    rows = ["| config | step s (median) | tokens/s | peak RSS/rank MiB | step vs DDP | RSS vs DDP | bytes sent/step/rank "
            "| all-gathers/step | reduce-scatters/step | model-state bytes/rank | tiers device/host/disk MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        rss = max(r["peak_rss_mib"])
        comm = r["comm_last_step"]
        states = r["model_state_bytes"][0]
        sent = "n/a (DDP)" if comm is None else f"{sum(v['bytes_sent'] for k, v in comm.items() if k != 'control') / 2**20:.1f} MiB"
        held = "n/a (DDP)" if states is None else f"{sum(states[k] for k in ('params', 'grads', 'optimizer_states')) / 2**20:.1f} MiB"
        calls = ["n/a" if comm is None else str(comm.get(kind, {}).get("calls", 0)) for kind in ("all_gather", "reduce_scatter")]
        used = (r.get("placement_report") or {}).get("used")  # where an offloading policy placed shards, gradients, states
        tiers = "/".join(f"{used[t] / 2**20:.0f}" for t in ("device", "host", "disk")) if used else "n/a"
        rows.append(f"| {name} | {r['median_step_s']:.3f} | {r['tokens_per_s']:,.0f} | {rss:.0f} | "
                    f"{r['median_step_s'] / base['median_step_s']:.2f}x | {rss / max(base['peak_rss_mib']):.2f}x | {sent} | "
                    f"{calls[0]} | {calls[1]} | {held} | {tiers} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--configs", default=",".join(DEFAULT), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument("--loss-rtol", type=float, default=1e-4)
    p.add_argument("--loss-rtol-16", type=float, default=3e-2)
    args, model_args = p.parse_known_args()
    args.model_args = model_args
    names = ["ddp"] + [n for n in args.configs.split(",") if n != "ddp"]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown config(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, CONFIGS[name], args, Path(tmp)) for name in names}
    print()
    print(table(results))
    reference = results["ddp"]["losses"]
    def rtol(r: dict) -> float:
        return args.loss_rtol if r["precision"] == "fp32" else args.loss_rtol_16

    bad = [n for n, r in results.items()
           if any(abs(a - b) > rtol(r) * abs(b) for a, b in zip(r["losses"], reference))]
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "results": results}
    (RESULTS / "compare_ddp.json").write_text(json.dumps(record, indent=1))
    print(f"\nlosses agree with DDP within {args.loss_rtol} (fp32) / {args.loss_rtol_16} (16-bit): "
          f"{'yes' if not bad else 'NO: ' + ', '.join(bad)}")
    print(f"results written to {RESULTS / 'compare_ddp.json'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
