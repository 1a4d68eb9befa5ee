#!/usr/bin/env python3
"""zero's first GPU check: environment, host<->device bandwidth, GPT-2-medium training under
plain PyTorch, FSDP2 and zero (chunk/tensor, stages 2/3, Gemini offload), and the CUDA-only unit test.

World size 1 (one process), NCCL. Every section runs in its own try/except; the report is
rewritten after each section (report.md, results.json under --out), so a timeout keeps what ran.

    python3 gpu_check.py --out $OUT                 # on the GPU machine
    python gpu_check.py --dry-run --out /tmp/x      # CPU, gloo, tiny model, to catch typos

Not library code: kept beside its report as the record of the first GPU run (see README.md here).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import traceback
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
T_START = time.perf_counter()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny model, 1+1 steps")
    p.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "out")))
    p.add_argument("--budget-s", type=float, default=330.0, help="skip sections that would start after this many seconds")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--force-shims", action="store_true", help="replace the *_single collectives even if torch has them")
    p.add_argument("--only", default="", help="comma-separated config names to run (default: all)")
    p.add_argument("--no-pytest", action="store_true")
    p.add_argument("--hard-deadline-s", type=float, default=420.0, help="stop a running config's steps after this")
    p.add_argument("--hang-dump-s", type=float, default=450.0, help="faulthandler dumps every thread's stack after this")
    return p.parse_args()


ARGS = parse_args()
if ARGS.force_shims:
    os.environ["GPUSHIM_FORCE"] = "1"
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("LOCAL_WORLD_SIZE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, HERE)
import gpushim  # noqa: E402  (before zero: installs the *_single shims where torch lacks them)

RESULTS: dict = {"sections": {}, "errors": [], "shims": list(gpushim.INSTALLED)}
REPORT: dict[str, list[str]] = {}  # blocks in the order first written; a block can be rewritten in place
CURRENT = ["head"]
CUDA = torch.cuda.is_available() and not ARGS.dry_run
DEV = torch.device("cuda", 0) if CUDA else torch.device("cpu")
os.makedirs(ARGS.out, exist_ok=True)


def elapsed() -> float:
    return time.perf_counter() - T_START


def log(msg: str) -> None:
    print(f"[{elapsed():7.1f}s] {msg}", flush=True)


def md(line: str = "", key: str | None = None) -> None:
    REPORT.setdefault(key or CURRENT[0], []).append(line)


def render() -> str:
    return "\n".join(line for block in REPORT.values() for line in block)


def flush_report() -> None:
    with open(os.path.join(ARGS.out, "report.md"), "w") as f:
        f.write(render() + "\n")
    with open(os.path.join(ARGS.out, "results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def record_error(section: str, err: BaseException) -> str:
    tb = traceback.format_exc()
    tail = "\n".join(tb.strip().splitlines()[-25:])
    RESULTS["errors"].append({"section": section, "error": f"{type(err).__name__}: {err}", "traceback": tb})
    log(f"ERROR in {section}: {type(err).__name__}: {err}\n{tb}")
    return tail


def section(name: str):
    """Decorator: run the function in try/except, time-gated, and note its result or traceback in the report."""
    def wrap(fn):
        def run(*a, **kw):
            if elapsed() > ARGS.budget_s:
                log(f"skipping {name}: past the time budget ({ARGS.budget_s:.0f}s)")
                RESULTS["sections"][name] = {"skipped": "time budget"}
                md(f"\n## {name}\n\nskipped: past the time budget ({ARGS.budget_s:.0f} s)")
                flush_report()
                return None
            log(f"== {name}")
            CURRENT[0] = name
            t0 = time.perf_counter()
            try:
                out = fn(*a, **kw)
            except BaseException as err:  # noqa: BLE001 - keep going, report it
                if isinstance(err, KeyboardInterrupt):
                    raise
                tail = record_error(name, err)
                RESULTS["sections"][name] = {"error": f"{type(err).__name__}: {err}"}
                md(f"\n## {name}\n\n**ERROR** `{type(err).__name__}: {str(err)[:500]}`\n\n```text\n{tail}\n```")
                out = None
            log(f"== {name} done in {time.perf_counter() - t0:.1f}s")
            flush_report()
            return out
        return run
    return wrap


def sh(cmd: list[str], timeout: float = 20) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout.strip()
    except Exception as err:  # noqa: BLE001
        return f"<{type(err).__name__}: {err}>"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


# ----------------------------------------------------------------------------------------------------------
@section("1. environment")
def environment() -> None:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch.version.cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if CUDA else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if CUDA else None,
        "dry_run": ARGS.dry_run,
        "cpu_count": os.cpu_count(),
        "shims": list(gpushim.INSTALLED),
    }
    if CUDA:
        props = torch.cuda.get_device_properties(0)
        env.update({
            "gpu": torch.cuda.get_device_name(0),
            "capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "driver": sh(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
            "nvidia-smi": sh(["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,power.limit", "--format=csv,noheader"]),
        })
    try:
        import zero_core
        env["zero_core"] = f"{zero_core.__version__} from {os.path.dirname(zero_core.__file__)}"
        import importlib.metadata as md_
        env["zero entry points"] = sorted(f"{e.name}={e.value}" for e in md_.entry_points(group="zero"))
    except Exception as err:  # noqa: BLE001
        env["zero_core"] = f"import failed: {type(err).__name__}: {err}"
        record_error("1. environment (zero import)", err)
    # torch >= 2.12 APIs the snapshot uses (found by grepping the snapshot against torch 2.11's sources)
    env["torch has natively"] = dict(gpushim.NATIVE)
    try:
        from torch.distributed.tensor._ops._pointwise_ops import _register_single_dim_pointwise  # noqa: F401
        env["_register_single_dim_pointwise"] = "present"
    except ImportError:
        env["_register_single_dim_pointwise"] = "absent (zero_core._dtensor_ops skips registering fused SGD/Adagrad rules)"
    # calibration: a bf16 matmul
    if CUDA:
        n = 8192
        a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        sync()
        env["bf16 matmul 8192^3 TFLOP/s"] = round(2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12, 1)
        del a, b
        torch.cuda.empty_cache()
    RESULTS["sections"]["environment"] = env
    md("\n## 1. Environment\n")
    md("| item | value |")
    md("|---|---|")
    for k, v in env.items():
        md(f"| {k} | {v} |")


# ----------------------------------------------------------------------------------------------------------
@section("2. host<->device copy bandwidth")
def bandwidth() -> None:
    mib = 256 if CUDA else 8
    nbytes = mib * 2**20
    reps = 10 if CUDA else 2
    dev = torch.empty(nbytes // 4, dtype=torch.float32, device=DEV).fill_(1.0)
    rows = []
    for pinned in (True, False):
        if pinned and not CUDA:
            continue
        host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=pinned)
        host.fill_(2.0)  # touch the pages (pageable memory is faulted in here, not in the timed copies)
        for direction in ("H2D", "D2H"):
            src, dst = (host, dev) if direction == "H2D" else (dev, host)
            times = []
            for _ in range(reps + 1):
                sync()
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=pinned)
                sync()
                times.append(time.perf_counter() - t0)
            times = times[1:]
            row = {"memory": "pinned" if pinned else "pageable", "direction": direction, "MiB": mib,
                   "GB/s median": nbytes / 1e9 / statistics.median(times), "GB/s best": nbytes / 1e9 / min(times)}
            rows.append(row)
            log(f"   {row}")
        del host
    if CUDA:  # device to device for reference
        other = torch.empty_like(dev)
        times = []
        for _ in range(reps + 1):
            sync()
            t0 = time.perf_counter()
            other.copy_(dev)
            sync()
            times.append(time.perf_counter() - t0)
        times = times[1:]
        rows.append({"memory": "device", "direction": "D2D (read+write counted)", "MiB": mib,
                     "GB/s median": 2 * nbytes / 1e9 / statistics.median(times), "GB/s best": 2 * nbytes / 1e9 / min(times)})
        del other
    del dev
    if CUDA:
        torch.cuda.empty_cache()
    RESULTS["sections"]["bandwidth"] = rows
    md("\n## 2. Host <-> device copy bandwidth\n")
    md(f"{mib} MiB fp32 buffer, {reps} timed copies after 1 warm-up, wall clock around `torch.cuda.synchronize()`; "
       "pinned copies use `non_blocking=True`.\n")
    md("| memory | direction | GB/s (median) | GB/s (best) |")
    md("|---|---|---|---|")
    for r in rows:
        md(f"| {r['memory']} | {r['direction']} | {r['GB/s median']:.1f} | {r['GB/s best']:.1f} |")


# ----------------------------------------------------------------------------------------------------------
# Training
from zero_core.testing.gpt import GPT, GPTConfig, SyntheticTokens, lm_loss  # noqa: E402

if ARGS.dry_run:
    GCFG = GPTConfig(vocab_size=512, seq_len=64, d_model=64, n_layer=2, n_head=4)
    BATCH = 2
else:
    GCFG = GPTConfig(vocab_size=50257, seq_len=1024, d_model=1024, n_layer=24, n_head=16)
    BATCH = ARGS.batch
WARMUP, TIMED = (1, 1) if ARGS.dry_run else (ARGS.warmup, ARGS.steps)
LR = 3e-4
STEP_RESULTS: dict[str, dict] = {}
BASE: dict = {}


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def prepare_base() -> None:
    t0 = time.perf_counter()
    torch.manual_seed(0)
    BASE["model"] = GPT(GCFG)  # on the CPU, fp32: every config starts from a deep copy
    data = SyntheticTokens(vocab_size=GCFG.vocab_size, seq_len=GCFG.seq_len, alphabet=64, seed=0)
    BASE["batches"] = [data.batch(s, BATCH) for s in range(WARMUP + TIMED)]
    BASE["params"] = sum(p.numel() for p in BASE["model"].parameters())
    log(f"base model {BASE['params'] / 1e6:.1f}M params, {len(BASE['batches'])} batches of {BATCH}x{GCFG.seq_len} "
        f"built in {time.perf_counter() - t0:.1f}s")


def free_device() -> float:
    gc.collect()
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated() / 2**20
    return 0.0


class Runner:
    """One configuration: build(model) -> (step_fn, extra_info_fn, close_fn)."""

    def __init__(self, name: str, build, note: str, profile: bool = False) -> None:
        self.name, self.build, self.note, self.profile = name, build, note, profile


def profile_step(step, tokens) -> dict:
    """One more step (after the timed ones, not in the losses) under torch.profiler: GPU busy time vs wall."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    sync()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        float(step(tokens))
        sync()
        wall = time.perf_counter() - t0
    ka = prof.key_averages()
    dev_us = sum(getattr(e, "self_device_time_total", 0) for e in ka)
    kernels = sum(e.count for e in ka if getattr(e, "self_device_time_total", 0) > 0)
    cpu_ops = sum(e.count for e in ka)
    top_cpu = ka.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=50)
    top_dev = ka.table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=50) if CUDA else ""
    import re

    def footer(kind: str) -> float | None:  # torch's own totals (annotation ranges such as ZeRO::* are not double counted)
        m = re.search(rf"Self {kind} time total: ([\d.]+)(us|ms|s)\b", top_cpu)
        return None if m is None else round(float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)], 1)

    return {"profile": {"wall_ms_under_profiler": round(wall * 1e3, 1), "self_cuda_total_ms": footer("CUDA"),
                        "self_cpu_total_ms": footer("CPU"),
                        "sum_self_device_ms_incl_annotations": round(dev_us / 1e3, 1),
                        "ops_with_device_time": kernels, "profiled_ops": cpu_ops},
            "profile_top_cpu": top_cpu, "profile_top_device": top_dev}


def train(runner: Runner) -> dict:
    left = free_device()
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    res: dict = {"name": runner.name, "note": runner.note, "leftover_before_MiB": round(left, 1)}
    t0 = time.perf_counter()
    model = copy.deepcopy(BASE["model"])
    step = info = close = None
    losses, times, launch = [], [], []
    try:
        step, info, close = runner.build(model)
        sync()
        res["setup_s"] = round(time.perf_counter() - t0, 2)
        res["after_setup_alloc_MiB"] = round(torch.cuda.memory_allocated() / 2**20, 1) if CUDA else None
        for i, tokens_cpu in enumerate(BASE["batches"]):
            if elapsed() > ARGS.hard_deadline_s:
                res["partial_losses"], res["partial_step_ms"] = losses, [round(t * 1e3, 2) for t in times]
                raise TimeoutError(f"stopped before step {i}: past the hard deadline ({ARGS.hard_deadline_s:.0f}s); "
                                   f"losses so far {losses}, step ms {res['partial_step_ms']}")
            if i == WARMUP and CUDA:
                res["peak_alloc_setup_and_warmup_MiB"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
                res["peak_reserved_setup_and_warmup_MiB"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
                res["alloc_before_timed_MiB"] = round(torch.cuda.memory_allocated() / 2**20, 1)
                torch.cuda.reset_peak_memory_stats()
            tokens = tokens_cpu.to(DEV)
            sync()
            t1 = time.perf_counter()
            loss = step(tokens)
            launch.append(time.perf_counter() - t1)  # the host side: step() returned, nothing waited for by us
            value = float(loss)  # synchronises
            sync()
            times.append(time.perf_counter() - t1)
            losses.append(value)
            log(f"   {runner.name} step {i} loss {value:.5f} {times[-1] * 1e3:.1f} ms")
            if not math.isfinite(value):
                raise FloatingPointError(f"loss is {value} at step {i}")
        timed = times[WARMUP:]
        med = statistics.median(timed)
        res.update({
            "losses": losses, "step_ms_all": [round(t * 1e3, 2) for t in times],
            "step_ms_median": round(med * 1e3, 2), "step_ms_min": round(min(timed) * 1e3, 2),
            "step_ms_mean": round(statistics.fmean(timed) * 1e3, 2),
            "host_return_ms_median": round(statistics.median(launch[WARMUP:]) * 1e3, 2),
            "tokens_per_s": round(BATCH * GCFG.seq_len / med),
            "tflops_6N": round(6 * BASE["params"] * BATCH * GCFG.seq_len / med / 1e12, 1),
            "host_rss_MiB": round(rss_mib()),
        })
        if CUDA:
            res["peak_alloc_steady_MiB"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
            res["peak_reserved_MiB"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)  # since the last reset
            res["alloc_end_MiB"] = round(torch.cuda.memory_allocated() / 2**20, 1)
        if runner.profile and elapsed() < ARGS.budget_s:
            try:
                res.update(profile_step(step, BASE["batches"][-1].to(DEV)))
            except Exception as err:  # noqa: BLE001
                res["profile_error"] = f"{type(err).__name__}: {err}"
                record_error(f"{runner.name} profile", err)
        try:
            res.update(info() or {})
        except Exception as err:  # noqa: BLE001
            res["info_error"] = f"{type(err).__name__}: {err}"
            record_error(f"{runner.name} info", err)
    finally:
        try:
            if close is not None:
                close()
        except Exception as err:  # noqa: BLE001
            res["close_error"] = f"{type(err).__name__}: {err}"
            record_error(f"{runner.name} close", err)
        del model, step, info, close
        res["leftover_after_MiB"] = round(free_device(), 1)
        res["leftover_reserved_after_MiB"] = round(torch.cuda.memory_reserved() / 2**20, 1) if CUDA else None
    return res


# -- plain PyTorch ---------------------------------------------------------------------------------------------
def build_torch_autocast(model):
    model.to(DEV)
    opt = make_optimizer(model.parameters())

    def step(tokens):
        with torch.autocast(DEV.type, dtype=torch.bfloat16):
            loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def close():
        opt.state.clear()

    return step, lambda: {}, close


def build_torch_bf16_recipe(model):
    """zero's recipe by hand: an fp32 master model steps; a bf16 copy runs forward and backward; grads go fp32."""
    master = model.to(DEV)
    compute = copy.deepcopy(master).to(torch.bfloat16)
    mp, cp = list(master.parameters()), list(compute.parameters())
    opt = make_optimizer(mp)

    def step(tokens):
        with torch.no_grad():
            torch._foreach_copy_(cp, mp)
        loss = lm_loss(compute(tokens), tokens)
        loss.backward()
        for m, c in zip(mp, cp):
            m.grad = c.grad.float()
            c.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def close():
        opt.state.clear()
        mp.clear(), cp.clear()

    return step, lambda: {}, close


def build_fsdp2(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(DEV.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model.to(DEV)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = make_optimizer(model.parameters())

    def step(tokens):
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def close():
        opt.state.clear()

    return step, lambda: {}, close


# -- zero -----------------------------------------------------------------------------------------------------
def zero_builder(strategy: str, stage: int, placement: str = "device", options=None):
    def build(model):
        from zero_core import ChunkPolicy, Precision, ZeroConfig, shard

        if placement == "gemini":
            from zero_offload import GeminiConfig
            options_ = GeminiConfig(**(options or {}))
        else:
            options_ = options or {}
        config = ZeroConfig(strategy=strategy, stage=stage, precision=Precision(compute="bf16"),
                            chunk=ChunkPolicy(search_interval=GCFG.d_model), placement=placement,
                            placement_options=options_)
        opt = make_optimizer(model.parameters())
        zmodel, zopt = shard(model, opt, config=config)

        def step(tokens):
            loss = lm_loss(zmodel(tokens), tokens)
            zmodel.backward(loss)
            zopt.step()
            zopt.zero_grad(set_to_none=True)
            return loss.detach()

        def info():
            engine = zmodel._zero_engine
            out = {"chunks": len(engine.chunks),
                   "model_state_MiB": {k: round(v / 2**20, 1) for k, v in zmodel.model_state_bytes().items()},
                   "memory_by_kind_MiB": {k: round(v / 2**20, 1) for k, v in zmodel.memory_by_kind().items()}}
            rep = getattr(engine.placement, "report", None)
            if callable(rep):
                r = rep()
                out["placement_report"] = {k: r[k] for k in list(r)[:12]} if isinstance(r, dict) else str(r)[:2000]
            return out

        def close():
            zmodel.close()
            zopt.state.clear()

        return step, info, close
    return build


CONFIGS = [
    Runner("torch-autocast", build_torch_autocast, "plain PyTorch, fp32 params, torch.autocast(bf16), AdamW"),
    Runner("torch-bf16-recipe", build_torch_bf16_recipe,
           "plain PyTorch, zero's recipe by hand: bf16 compute copy, fp32 masters and grads, AdamW", profile=True),
    Runner("fsdp2", build_fsdp2, "fully_shard per block + root, MixedPrecisionPolicy(bf16, reduce fp32)", profile=True),
    Runner("zero-chunk-s1", zero_builder("chunk", 1), "ZeroConfig(strategy='chunk', stage=1, Precision(compute='bf16'))"),
    Runner("zero-chunk-s2", zero_builder("chunk", 2), "ZeroConfig(strategy='chunk', stage=2, Precision(compute='bf16'))",
           profile=True),
    Runner("zero-chunk-s3", zero_builder("chunk", 3), "ZeroConfig(strategy='chunk', stage=3, Precision(compute='bf16'))",
           profile=True),
    Runner("zero-tensor-s2", zero_builder("tensor", 2), "ZeroConfig(strategy='tensor', stage=2, Precision(compute='bf16'))"),
    Runner("zero-tensor-s3", zero_builder("tensor", 3), "ZeroConfig(strategy='tensor', stage=3, Precision(compute='bf16'))",
           profile=True),
    Runner("zero-chunk-s3-gemini", zero_builder("chunk", 3, "gemini", {} if CUDA else {"device_budget_mb": 4096}),
           "chunk, stage 3, placement='gemini', GeminiConfig() defaults (margin_ratio=0: optimizer states step on the host)"),
    Runner("zero-chunk-s3-gemini-m1", zero_builder("chunk", 3, "gemini", {"margin_ratio": 1.0} if CUDA else
                                                   {"device_budget_mb": 4096, "margin_ratio": 1.0}),
           "chunk, stage 3, placement='gemini', GeminiConfig(margin_ratio=1.0)"),
]


def run_config(runner: Runner) -> None:
    @section(f"3. train {runner.name}")
    def go():
        res = train(runner)
        STEP_RESULTS[runner.name] = res
        RESULTS["sections"][f"train {runner.name}"] = res
        log(f"   {runner.name}: median step {res['step_ms_median']} ms, {res['tokens_per_s']:,} tokens/s")
    go()
    if runner.name not in STEP_RESULTS:
        STEP_RESULTS[runner.name] = {"name": runner.name, "note": runner.note, "error": RESULTS["sections"].get(
            f"3. train {runner.name}", {}).get("error", "see errors")}


def training_table() -> None:
    def rel(a, b):
        return max(abs(x - y) / abs(y) for x, y in zip(a, b)) if a and b and len(a) == len(b) else None

    REPORT["3. table"] = []
    CURRENT[0] = "3. table"
    ref_a = STEP_RESULTS.get("torch-autocast", {}).get("losses")
    ref_b = STEP_RESULTS.get("torch-bf16-recipe", {}).get("losses")
    md("\n## 3. Training: GPT-2-medium shape\n")
    md(f"`zero_core.testing.gpt.GPT`: {GCFG.n_layer} layers, d={GCFG.d_model}, {GCFG.n_head} heads, vocab "
       f"{GCFG.vocab_size}, seq {GCFG.seq_len}, tied head, {BASE.get('params', 0) / 1e6:.1f}M params; batch {BATCH} "
       f"({BATCH * GCFG.seq_len} tokens/step); AdamW(lr={LR}, betas=(0.9, 0.95), wd=0.1, torch default foreach); "
       f"SyntheticTokens(alphabet=64, seed=0); {WARMUP} warm-up + {TIMED} timed steps; world size 1 "
       f"({'NCCL' if CUDA else 'gloo'}). Step time = wall clock from the batch on the device to `loss.item()` + "
       "synchronize. Peak steady = `max_memory_allocated` over the timed steps (reset after warm-up); "
       "peak setup+warm-up = `max_memory_allocated` from the config's start (after freeing the previous one) to the end of warm-up, building/sharding included; reserved = "
       "`max_memory_reserved` over the timed steps. TFLOP/s counts 6 x params x tokens only.\n")
    md("| config | step ms (median) | min | tokens/s | TFLOP/s (6N) | peak alloc steady MiB | peak alloc setup+warm-up MiB "
       "| peak reserved MiB | setup s | max rel loss diff vs autocast | vs bf16 recipe | leftover alloc after free MiB "
       "| host-side ms until step() returns (median) |")
    md("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in STEP_RESULTS.items():
        if "losses" not in r:
            md(f"| {name} | ERROR: {str(r.get('error'))[:150]} | | | | | | | | | | | |")
            continue
        da, db = rel(r["losses"], ref_a), rel(r["losses"], ref_b)
        r["max_rel_loss_diff_vs_autocast"], r["max_rel_loss_diff_vs_bf16_recipe"] = da, db
        md(f"| {name} | {r['step_ms_median']} | {r['step_ms_min']} | {r['tokens_per_s']:,} | {r['tflops_6N']} | "
           f"{r.get('peak_alloc_steady_MiB')} | {r.get('peak_alloc_setup_and_warmup_MiB')} | {r.get('peak_reserved_MiB')} | "
           f"{r['setup_s']} | {'' if da is None else f'{da:.2e}'} | {'' if db is None else f'{db:.2e}'} | "
           f"{r.get('leftover_after_MiB')} | {r.get('host_return_ms_median')} |")
    md("\nLosses per step (all steps, warm-up included):\n")
    md("| config | " + " | ".join(f"step {i}" for i in range(WARMUP + TIMED)) + " |")
    md("|---|" + "---|" * (WARMUP + TIMED))
    for name, r in STEP_RESULTS.items():
        if "losses" in r:
            md(f"| {name} | " + " | ".join(f"{x:.5f}" for x in r["losses"]) + " |")
    md("\nStep times, ms (all steps):\n")
    md("| config | " + " | ".join(f"step {i}" for i in range(WARMUP + TIMED)) + " |")
    md("|---|" + "---|" * (WARMUP + TIMED))
    for name, r in STEP_RESULTS.items():
        if "step_ms_all" in r:
            md(f"| {name} | " + " | ".join(str(x) for x in r["step_ms_all"]) + " |")
    profs = [(n, r) for n, r in STEP_RESULTS.items() if "profile" in r]
    if profs:
        md("\nOne extra step under `torch.profiler` (after the timed steps; not in the losses), with "
           "the totals torch's profiler prints under its tables; wall includes profiler overhead:\n")
        md("| config | wall ms (profiled) | self CUDA total ms (GPU work) | self CPU total ms (host work) "
           "| ops with device time | profiled ops (CPU+device events) |")
        md("|---|---|---|---|---|---|")
        for n, r in profs:
            pr = r["profile"]
            md(f"| {n} | {pr['wall_ms_under_profiler']} | {pr['self_cuda_total_ms']} | {pr['self_cpu_total_ms']} "
               f"| {pr['ops_with_device_time']} | {pr['profiled_ops']} |")
        for n, r in profs:
            md(f"\n<details><summary>{n}: top ops by self CPU time, then by self device time</summary>\n\n```text\n"
               f"{r['profile_top_cpu']}\n{r['profile_top_device']}\n```\n</details>")
    extra = [(n, r) for n, r in STEP_RESULTS.items() if "model_state_MiB" in r or "info_error" in r or "close_error" in r]
    if extra:
        md("\nzero's own accounting after the last step:\n")
        for n, r in extra:
            md(f"- **{n}**: chunks {r.get('chunks')}, model_state_bytes (MiB) {r.get('model_state_MiB')}, "
               f"memory_by_kind (MiB) {r.get('memory_by_kind_MiB')}, host RSS {r.get('host_rss_MiB')} MiB"
               + (f", placement report {json.dumps(r.get('placement_report'), default=str)[:1500]}" if r.get("placement_report") else "")
               + (f", info error {r['info_error']}" if "info_error" in r else "")
               + (f", close error {r['close_error']}" if "close_error" in r else ""))
    flush_report()


# ----------------------------------------------------------------------------------------------------------
@section("4. CUDA-only unit tests (pytest)")
def run_pytest() -> None:
    test = os.path.join(HERE, "packages", "offload", "tests", "test_offload_units.py")
    env = dict(os.environ)
    # shimsite/sitecustomize.py installs the shims in every process, the ranks the tests spawn included
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "shimsite"), HERE]
                                        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
           os.path.join(HERE, "pyproject.toml"), "--rootdir", HERE, test, "-ra"]
    if not ARGS.dry_run:
        cmd += ["-o", "timeout=120"]
    log("   " + " ".join(cmd))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=HERE)
    out = proc.stdout + proc.stderr
    with open(os.path.join(ARGS.out, "pytest.txt"), "w") as f:
        f.write(out)
    tail = "\n".join(out.strip().splitlines()[-60:])
    RESULTS["sections"]["pytest"] = {"rc": proc.returncode, "seconds": round(time.perf_counter() - t0, 1), "tail": tail}
    md("\n## 4. Unit tests on the GPU machine\n")
    md(f"`{' '.join(os.path.relpath(c, HERE) if c.startswith(HERE) else c for c in cmd)}` (cwd: the driver's folder) -> rc "
       f"{proc.returncode} in {time.perf_counter() - t0:.1f} s. Tail:\n\n```text\n{tail}\n```")


# ----------------------------------------------------------------------------------------------------------
@section("0. process group")
def init_pg() -> None:
    if CUDA:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", timeout=timedelta(minutes=3), device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", timeout=timedelta(minutes=3))
    RESULTS["sections"]["process group"] = {"backend": dist.get_backend(), "world": dist.get_world_size()}
    # the shims themselves, on this backend (zero's torch backend short-circuits every collective at world size 1)
    out = torch.empty(4, device=DEV)
    dist.all_gather_single(out, torch.arange(4.0, device=DEV))
    rs = torch.empty(4, device=DEV)
    dist.reduce_scatter_single(rs, torch.arange(4.0, device=DEV), op=dist.ReduceOp.SUM)
    ok = out.tolist() == [0, 1, 2, 3] and rs.tolist() == [0, 1, 2, 3]
    RESULTS["sections"]["process group"]["shim self-test"] = ok
    md(f"\n## 0. Process group\n\nbackend {dist.get_backend()}, world size {dist.get_world_size()}; "
       f"all_gather_single / reduce_scatter_single called directly: {'ok' if ok else 'WRONG VALUES'}; shims: "
       f"{gpushim.INSTALLED or 'none needed'}")


def main() -> None:
    import faulthandler
    faulthandler.dump_traceback_later(ARGS.hang_dump_s, exit=False)
    if not ARGS.dry_run:
        torch.set_num_threads(min(16, os.cpu_count() or 1))
    else:
        torch.set_num_threads(1)
    md(f"# zero GPU check ({time.strftime('%Y-%m-%d %H:%M:%S')}){' - DRY RUN (CPU, gloo, tiny model)' if ARGS.dry_run else ''}\n")
    md(f"command line: `{' '.join(sys.argv)}`")
    init_pg()
    environment()
    bandwidth()
    section("3. prepare model and data")(prepare_base)()
    only = {s for s in ARGS.only.split(",") if s}
    first = [r for r in CONFIGS if "gemini" not in r.name and (not only or r.name in only)]
    later = [r for r in CONFIGS if "gemini" in r.name and (not only or r.name in only)]
    if "model" in BASE:
        for runner in first:
            run_config(runner)
        training_table()
    if not ARGS.no_pytest:
        run_pytest()
    if "model" in BASE and later:
        for runner in later:
            run_config(runner)
        training_table()
    CURRENT[0] = "end"
    md(f"\ntotal wall time {elapsed():.1f} s; errors: {len(RESULTS['errors'])}")
    if RESULTS["errors"]:
        md("\n## Errors (traceback tails)\n")
        for e in RESULTS["errors"]:
            md(f"### {e['section']}: `{e['error'][:300]}`\n\n```text\n" + "\n".join(e["traceback"].strip().splitlines()[-25:]) + "\n```")
    flush_report()
    print("\n\n" + render(), flush=True)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


if __name__ == "__main__":
    main()
