"""GPT-2-medium-shaped bf16 training at world size 1: zero's strategies and stages against plain PyTorch and FSDP2."""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zero_bench.gpu.environment import sync
from zero_bench.gpu.report import Report, table
from zero_core.testing.gpt import GPT, GPTConfig, SyntheticTokens, lm_loss

LR = 3e-4
Step = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class Shape:
    config: GPTConfig
    batch: int
    warmup: int
    timed: int


def shape(dry_run: bool, *, batch: int = 8, warmup: int = 3, timed: int = 10) -> Shape:
    if dry_run:
        return Shape(config=GPTConfig(vocab_size=512, seq_len=64, d_model=64, n_layer=2, n_head=4), batch=2, warmup=1, timed=1)
    return Shape(config=GPTConfig(vocab_size=50257, seq_len=1024, d_model=1024, n_layer=24, n_head=16),
                 batch=batch, warmup=warmup, timed=timed)


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


@dataclass(frozen=True)
class System:
    """One row: ``build(model, device) -> (step, info, close)``."""

    name: str
    build: Callable[[torch.nn.Module, torch.device], tuple[Step, Callable[[], dict], Callable[[], None]]]
    note: str


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, *, autocast: str | None = None) -> Step:
    """A step of plain PyTorch: forward (under ``torch.autocast(autocast, bf16)`` if given), backward, step."""
    def step(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(autocast, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def torch_autocast(model: torch.nn.Module, device: torch.device):
    model.to(device)
    opt = make_optimizer(model.parameters())
    return plain_step(model, opt, autocast=device.type), dict, opt.state.clear


def torch_bf16_recipe(model: torch.nn.Module, device: torch.device, *, compile_blocks: bool = False):
    """zero's recipe by hand: fp32 master parameters step; a bf16 copy runs forward and backward."""
    master = model.to(device)
    compute = copy.deepcopy(master).to(torch.bfloat16)
    if compile_blocks:
        for block in compute.blocks:
            block.compile(backend=compile_backend(device))
    mp, cp = list(master.parameters()), list(compute.parameters())
    opt = make_optimizer(mp)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            torch._foreach_copy_(cp, mp)
        loss = lm_loss(compute(tokens), tokens)
        loss.backward()
        for m, c in zip(mp, cp):
            m.grad, c.grad = c.grad.float(), None
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def close() -> None:
        opt.state.clear()
        mp.clear(), cp.clear()

    return step, dict, close


def compile_backend(device: torch.device) -> str:
    """Inductor on a GPU; on the CPU (the dry run) ``aot_eager``, which checks the plumbing without a C++ build."""
    return "inductor" if device.type == "cuda" else "aot_eager"


def torch_bf16_recipe_compiled(model: torch.nn.Module, device: torch.device):
    """The hand-written recipe with each block of the bf16 compute copy compiled (``block.compile()``)."""
    step, info, close = torch_bf16_recipe(model, device, compile_blocks=True)
    return step, info, close


def fsdp2(model: torch.nn.Module, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model.to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = make_optimizer(model.parameters())
    return plain_step(model, opt), dict, opt.state.clear


def zero(strategy: str, stage: int, placement: str = "device", options: dict | None = None, *,
         compile_blocks: bool = False):
    def build(model: torch.nn.Module, device: torch.device):
        from zero_core import ChunkPolicy, Precision, ZeroConfig, shard

        placement_options: Any = options or {}
        if placement == "gemini":
            from zero_offload import GeminiConfig

            placement_options = GeminiConfig(**placement_options)
        config = ZeroConfig(strategy=strategy, stage=stage, precision=Precision(compute="bf16"), device=str(device),
                            chunk=ChunkPolicy(search_interval=model.cfg.d_model), placement=placement,
                            placement_options=placement_options)
        zmodel, zopt = shard(model, make_optimizer(model.parameters()), config=config)
        if compile_blocks:  # after shard(): each compiled block is one unit of gather (see [Note: torch.compile])
            for block in model.blocks:
                block.compile(backend=compile_backend(device))

        def step(tokens: torch.Tensor) -> torch.Tensor:
            loss = lm_loss(zmodel(tokens), tokens)
            zmodel.backward(loss)
            zopt.step()
            zopt.zero_grad(set_to_none=True)
            return loss.detach()

        def info() -> dict:
            out = {"chunks": len(zmodel.engine.chunks),
                   "model_state_MiB": {k: round(v / 2**20, 1) for k, v in zmodel.model_state_bytes().items()}}
            placement_report = getattr(zmodel.engine.placement, "report", None)
            if callable(placement_report):
                out["placement_report"] = placement_report()
            return out

        def close() -> None:
            zmodel.close()
            zopt.state.clear()

        return step, info, close
    return build


def systems(dry_run: bool) -> list[System]:
    # on the CPU there is no device memory to budget, so the dry run gives Gemini a nominal one
    gemini = {"device_budget_mb": 4096} if dry_run else {}
    return [
        System("torch-autocast", torch_autocast, "plain PyTorch, fp32 parameters, torch.autocast(bf16), AdamW"),
        System("torch-bf16-recipe", torch_bf16_recipe, "plain PyTorch, zero's recipe by hand: bf16 compute copy, fp32 masters"),
        System("fsdp2", fsdp2, "fully_shard per block + root, MixedPrecisionPolicy(bf16, reduce fp32)"),
        System("zero-chunk-s2", zero("chunk", 2), "ZeroConfig(strategy='chunk', stage=2, Precision(compute='bf16'))"),
        System("zero-chunk-s3", zero("chunk", 3), "ZeroConfig(strategy='chunk', stage=3, Precision(compute='bf16'))"),
        System("zero-tensor-s2", zero("tensor", 2), "ZeroConfig(strategy='tensor', stage=2, Precision(compute='bf16'))"),
        System("zero-tensor-s3", zero("tensor", 3), "ZeroConfig(strategy='tensor', stage=3, Precision(compute='bf16'))"),
        System("zero-chunk-s3-gemini", zero("chunk", 3, "gemini", gemini),
               "chunk, stage 3, placement='gemini' with GeminiConfig() defaults"),
        # last: compiling takes the longest, and a section past its deadline drops the rows it has not reached
        System("torch-bf16-recipe-compiled", torch_bf16_recipe_compiled,
               "the hand-written recipe, each block of the bf16 copy compiled (block.compile())"),
        System("zero-chunk-s3-compiled", zero("chunk", 3, compile_blocks=True),
               "zero-chunk-s3, each block compiled after shard() (block.compile())"),
    ]


def free_device(device: torch.device) -> float:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated(device) / 2**20
    return 0.0


def train(system: System, base: torch.nn.Module, batches: list[torch.Tensor], sh: Shape, device: torch.device,
          report: Report, deadline_s: float) -> dict[str, Any]:
    """Warm-up and timed steps of one system from a copy of the same fp32 model."""
    cuda = device.type == "cuda"
    res: dict[str, Any] = {"name": system.name, "note": system.note, "leftover_before_MiB": round(free_device(device), 1)}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    model = copy.deepcopy(base)
    close = None
    losses, times, issued = [], [], []
    try:
        step, info, close = system.build(model, device)
        sync(device)
        res["setup_s"] = round(time.perf_counter() - t0, 2)
        for i, tokens_cpu in enumerate(batches):
            if report.elapsed() > deadline_s:
                raise TimeoutError(f"stopped before step {i}: past {deadline_s:.0f} s; losses so far {losses}")
            if i == sh.warmup and cuda:
                res["peak_alloc_setup_and_warmup_MiB"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
                torch.cuda.reset_peak_memory_stats(device)
            tokens = tokens_cpu.to(device)
            sync(device)
            t1 = time.perf_counter()
            loss = step(tokens)
            # the host's time to issue the step (issue 47 item 3): where it nears the step's, the step is host-bound
            issued.append(time.perf_counter() - t1)
            value = float(loss)  # waits for the step
            sync(device)
            times.append(time.perf_counter() - t1)
            losses.append(value)
            if not math.isfinite(value):
                raise FloatingPointError(f"loss is {value} at step {i}")
        timed = times[sh.warmup:]
        median = statistics.median(timed)
        tokens_per_step = sh.batch * sh.config.seq_len
        res.update({"losses": losses, "step_ms_all": [round(t * 1e3, 2) for t in times],
                    "step_ms_median": round(median * 1e3, 2), "step_ms_min": round(min(timed) * 1e3, 2),
                    "host_issue_ms_median": round(statistics.median(issued[sh.warmup:]) * 1e3, 2),
                    "tokens_per_s": round(tokens_per_step / median)})
        if cuda:
            res["peak_alloc_steady_MiB"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
            res["peak_reserved_MiB"] = round(torch.cuda.max_memory_reserved(device) / 2**20, 1)
        res.update(info())
    finally:
        if close is not None:
            close()
        del model
        res["leftover_after_MiB"] = round(free_device(device), 1)
    return res


def render(results: dict[str, dict[str, Any]], sh: Shape, params: int, device: torch.device) -> list[str]:
    def rel(a: list[float] | None, b: list[float] | None) -> str:
        if not a or not b or len(a) != len(b):
            return ""
        return f"{max(abs(x - y) / abs(y) for x, y in zip(a, b)):.2e}"

    reference = results.get("torch-bf16-recipe", {}).get("losses")
    c = sh.config
    lines = ["\n## Training: GPT-2-medium shape, world size 1\n",
             f"`zero_core.testing.gpt.GPT`: {c.n_layer} layers, d={c.d_model}, {c.n_head} heads, vocab {c.vocab_size}, "
             f"seq {c.seq_len}, tied head, {params / 1e6:.1f}M parameters; batch {sh.batch} ({sh.batch * c.seq_len} "
             f"tokens per step); AdamW(lr={LR}, betas=(0.9, 0.95), weight_decay=0.1); {sh.warmup} warm-up + {sh.timed} "
             f"timed steps on {device}. Step time: wall clock from the batch on the device to the loss on the host. "
             "Host issue: from the same start until the step's code returned its loss tensor, before reading it: the "
             "host's time to issue the step's work (the whole step on the CPU; on a GPU, host-bound where it nears "
             "the step time). "
             "Peak allocated and reserved: over the timed steps. Loss agreement: the largest relative difference "
             "from the hand-written bf16 recipe (fp32 masters, bf16 compute), which is zero's recipe.\n"]
    rows = []
    for name, r in results.items():
        if "losses" not in r:
            rows.append([name, f"ERROR: {str(r.get('error'))[:150]}", "", "", "", "", "", "", ""])
            continue
        rows.append([name, r["step_ms_median"], r["step_ms_min"], r.get("host_issue_ms_median"), f"{r['tokens_per_s']:,}",
                     r.get("peak_alloc_steady_MiB"),
                     r.get("peak_reserved_MiB"), r["setup_s"], rel(r["losses"], reference)])
    lines += table(["system", "step ms (median)", "min", "host issue ms (median)", "tokens/s", "peak allocated MiB",
                    "peak reserved MiB",
                    "setup s", "max rel. loss diff vs bf16 recipe"], rows)
    lines += ["\nLosses per step (warm-up included):\n"]
    steps = sh.warmup + sh.timed
    lines += table(["system"] + [f"step {i}" for i in range(steps)],
                   [[n] + [f"{x:.5f}" for x in r["losses"]] for n, r in results.items() if "losses" in r])
    lines += ["\nSystems:\n"] + [f"- **{n}**: {r['note']}" for n, r in results.items()]
    lines += ["\nTargets (issue 47 item 6):\n"] + [f"- {line}" for line in judge(results)]
    return lines


# issue 47 item 6: (row, "recipe" or "fsdp2", at most this many times that row's step); compiled: tokens/s at least
STEP_TARGETS = (("zero-chunk-s2", "torch-bf16-recipe", 1.05), ("zero-chunk-s2", "fsdp2", 0.80),
                ("zero-chunk-s3", "torch-bf16-recipe", 1.10), ("zero-chunk-s3", "fsdp2", 0.80),
                ("zero-tensor-s3", "torch-bf16-recipe", 1.20))
COMPILED_TARGET = ("zero-chunk-s3-compiled", "torch-bf16-recipe-compiled", 0.95)


def judge(results: dict[str, dict[str, Any]]) -> list[str]:
    """Each target of issue 47 item 6, met or not, from the rows' median steps (a row that failed: not measured)."""
    def median(name: str) -> float | None:
        return results.get(name, {}).get("step_ms_median")

    out = []
    for row, against, most in STEP_TARGETS:
        a, b = median(row), median(against)
        if a is None or b is None:
            out.append(f"{row} at most {most}x {against}'s step: not measured")
        else:
            out.append(f"{row} at most {most}x {against}'s step: {a / b:.2f}x, {'met' if a / b <= most else 'not met'}")
    row, against, least = COMPILED_TARGET
    a, b = median(row), median(against)
    if a is None or b is None:
        out.append(f"{row} at least {least}x {against}'s tokens/s: not measured")
    else:
        out.append(f"{row} at least {least}x {against}'s tokens/s: {b / a:.2f}x, {'met' if b / a >= least else 'not met'}")
    return out


def sync_check(system: System, base: torch.nn.Module, batches: list[torch.Tensor], sh: Shape,
               device: torch.device) -> dict[str, Any]:
    """One step of ``system`` after its warm-up under ``torch.cuda.set_sync_debug_mode("error")`` (issue 47 item 3: no
    host-device synchronisation inside a training step, zero's own agreements and checks included): "ok", or the
    first synchronising call and the innermost frames of the library that made it."""
    if device.type != "cuda":
        return {"status": "not run: torch's sync debug mode watches CUDA only"}
    model = copy.deepcopy(base)
    close = None
    try:
        step, _, close = system.build(model, device)
        for tokens in batches[: sh.warmup + 1]:  # the first steps may plan (Gemini) and allocate
            float(step(tokens.to(device)))
        tokens = batches[-1].to(device)
        sync(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(tokens)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        sync(device)
        return {"status": "ok"}
    except RuntimeError as err:
        frames = [f"{f.filename.split('/src/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_tb(err.__traceback__)
                  if "zero_" in f.filename]
        return {"status": "synchronised", "error": str(err).splitlines()[0][:300], "frames": frames[-6:]}
    finally:
        if close is not None:
            close()
        del model
        free_device(device)


def run_training(report: Report, device: torch.device, dry_run: bool, deadline_s: float, **shape_options: Any) -> None:
    sh = shape(dry_run, **shape_options)
    torch.manual_seed(0)
    base = GPT(sh.config)  # fp32 on the CPU: every system starts from a copy
    data = SyntheticTokens(vocab_size=sh.config.vocab_size, seq_len=sh.config.seq_len, alphabet=64, seed=0)
    batches = [data.batch(s, sh.batch) for s in range(sh.warmup + sh.timed)]
    params = sum(p.numel() for p in base.parameters())
    results: dict[str, dict[str, Any]] = {}
    for system in systems(dry_run):
        report.log(f"   training {system.name}")
        try:
            results[system.name] = train(system, base, batches, sh, device, report, deadline_s)
        except Exception as err:  # noqa: BLE001 - one system's failure is a row of the table
            report.error(f"training {system.name}", err)
            results[system.name] = {"name": system.name, "note": system.note, "error": f"{type(err).__name__}: {err}"}
        report.results["sections"]["training"] = {"params": params, "systems": results}
        report.block("training", render(results, sh, params, device))
    checks = {}
    for system in systems(dry_run):
        if system.name in ("zero-chunk-s2", "zero-chunk-s3") and report.elapsed() <= deadline_s:
            report.log(f"   sync check {system.name}")
            checks[system.name] = sync_check(system, base, batches, sh, device)
    report.results["sections"]["training"]["sync check"] = checks
    lines = ["\nA step under `torch.cuda.set_sync_debug_mode(\"error\")` (after the warm-up):\n"]
    for name, check in checks.items():
        detail = f": {check['error']} at {' <- '.join(reversed(check['frames']))}" if "error" in check else ""
        lines.append(f"- {name}: {check['status']}{detail}")
    report.block("training", render(results, sh, params, device) + lines)
