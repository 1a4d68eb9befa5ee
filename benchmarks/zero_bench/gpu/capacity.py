"""What each system trains at fixed model sizes under one device budget (issue 48, item 8).

Systems: plain PyTorch, FSDP2 with ``CPUOffloadPolicy``, and zero with the ``gemini``
placement, without and with its disk tier. Each trains a GPT at d_model 2048 and depths
8, 16, 32 and 64 (0.5B to 3.3B parameters) for 3 steps under the same device budget. A
row per system and depth records tokens/s, the allocator's peaks, the host memory kept
per parameter, the bytes copied between host and device per step (and their rate, which
the driver sets against its measured copy bandwidth), for zero the bytes its tiers moved
per step, and for a depth that did not train whether it was *refused at planning* (zero's
``DeviceBudgetError`` or ``TierBudgetError``, before any parameter changed) or *failed
later* (out of memory, or an error, in the build, the setup or a step). Once a depth did
not train, a system's deeper ones are not attempted.

Models are built lazily: zero's under ``zero_core.lazy_init()`` (``shard()`` fills each
chunk's shard by replaying the initialisers), FSDP2's on the meta device, sharded, then
``to_empty`` on the host and initialised there, plain PyTorch's on the meta device, then
``to_empty`` on the device. No system builds a full fp32 copy of the model on the host first.

``run_capacity(dry_run=True)`` runs every code path on the CPU with a tiny model, depths
1, 2 and 4, and a stand-in budget for the systems without one of their own (plain
PyTorch and FSDP2 fit a depth iff its parameter count is at most 1 layer's worth; zero
plans under its real budget), so the section cannot rot while no GPU is at hand.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from zero_bench.host_memory import host_growth
from zero_core import ChunkPolicy, Precision, ZeroConfig, lazy_init, shard
from zero_core.testing.gpt import GPT, GPTConfig, SyntheticTokens, lm_loss
from zero_offload import GeminiConfig, TierBudgetError

STEPS = 3
FULL_SHAPE = {"vocab_size": 50257, "seq_len": 1024, "d_model": 2048, "n_head": 16}
FULL_BATCH = 4
DRY_SHAPE = {"vocab_size": 256, "seq_len": 32, "d_model": 64, "n_head": 4}
DRY_BATCH = 2
DRY_FIT_LAYERS = 1  # the dry run's stand-in budget for plain PyTorch and FSDP2: what this many layers take
FULL_DEPTHS = (8, 16, 32, 64)  # 0.5B, 0.9B, 1.7B and 3.3B parameters at d_model 2048
DRY_DEPTHS = (1, 2, 4)
HOST_SHARE = 0.5  # of physical RAM: attempts estimated above it are not made, and zero's host tier is capped at it
GEMINI_MARGIN = 0.1  # of the budget, kept out of gemini's plan for fragmentation and cuBLAS workspaces
DISK_SHARE = 0.5  # of the free space where the disk tier lives
# zero-gemini-disk's host budget: the gradients and master shards (8 bytes per parameter) and room to read and
# write the disk's files (two gather groups and three chunks' files: a few GiB at d_model 2048, where a chunk
# holds the 103M-parameter embedding); the optimizer states (8 bytes per parameter) go to disk
DISK_HOST_BYTES_PER_PARAM = 8
DISK_HOST_SLACK = 8 << 30
DRY_DISK_HOST_SLACK = 2 << 20
LR = 3e-4


@dataclass
class Trainer:
    """One built system: a training step on a batch of tokens, a close that frees what it holds, and
    zero's placement report where there is one."""

    step: Callable[[torch.Tensor], None]
    close: Callable[[], None]
    placement_report: Callable[[], dict[str, Any]] | None = None


@dataclass(frozen=True)
class Env:
    """What every attempt of the section shares."""

    device: torch.device
    dry_run: bool
    budget_gib: float
    shape: dict[str, int]
    batch: int
    host_cap: int  # bytes
    disk_dir: str
    disk_budget: int  # bytes

    def config(self, depth: int) -> GPTConfig:
        # activation checkpointing keeps activations small, so the model states decide the depth
        return GPTConfig(n_layer=depth, checkpoint=True, **self.shape)


@dataclass(frozen=True)
class System:
    name: str
    what: str  # for the method paragraph
    # Host bytes per parameter nothing else bounds: attempts whose estimate passes Env.host_cap are not made,
    # because a host that runs out kills the whole report, not just the attempt.
    host_bytes_per_param: int
    build: Callable[[GPTConfig, Env], Trainer]  # builds the model itself, lazily
    own_budget: bool = False  # plans under the device budget itself (zero): no stand-in in the dry run


# what became of an attempt
FIT, REFUSED, FAILED, SKIPPED = "fit", "refused at planning", "failed later", "not attempted"


@dataclass
class Attempt:
    depth: int
    status: str  # FIT, REFUSED, FAILED or SKIPPED
    detail: str = ""  # for a non-fit: where it stopped and why
    seconds: float = 0.0  # wall time of the whole attempt; 0 when it was not made
    measured: dict[str, Any] = field(default_factory=dict)


# -- the systems ----------------------------------------------------------------------------------------
def _initialise(model: GPT) -> None:
    """GPT's own initialisation, on a model whose storages are real but uninitialised (after ``to_empty``)."""
    with torch.no_grad():
        model.apply(GPT._init)
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.reset_parameters()
        for block in model.blocks:
            torch.nn.init.normal_(block.out.weight, std=0.02 / (2 * model.cfg.n_layer) ** 0.5)


def _build_plain(cfg: GPTConfig, env: Env) -> Trainer:
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=env.device)
    _initialise(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)

    def step(tokens: torch.Tensor) -> None:
        with torch.autocast(env.device.type, dtype=torch.bfloat16):
            loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Trainer(step, opt.state.clear)


def _build_fsdp2(cfg: GPTConfig, env: Env) -> Trainer:
    options = {
        "mesh": init_device_mesh(env.device.type, (1,)),
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy(pin_memory=env.device.type == "cuda"),
    }
    with torch.device("meta"):
        model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    model.to_empty(device="cpu")  # CPUOffloadPolicy keeps the sharded parameters on the host: materialised there
    _initialise(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)

    def step(tokens: torch.Tensor) -> None:
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Trainer(step, opt.state.clear)


def _zero_builder(*, disk: bool) -> Callable[[GPTConfig, Env], Trainer]:
    def build(cfg: GPTConfig, env: Env) -> Trainer:
        # with the disk tier, a host budget the optimizer states do not fit in: they go to disk
        slack = DRY_DISK_HOST_SLACK if env.dry_run else DISK_HOST_SLACK
        host = min(env.host_cap, DISK_HOST_BYTES_PER_PARAM * cfg.num_params + slack) if disk else env.host_cap
        options = GeminiConfig(
            device_budget_mb=env.budget_gib * 1024 * (1 - GEMINI_MARGIN),
            host_budget_mb=host / 2**20,
            disk_dir=env.disk_dir if disk else None,
            disk_budget_mb=env.disk_budget / 2**20 if disk else None,
            # the disk row measures streaming from disk: every chunk steps on the host, none in the device's headroom
            **({"margin_ratio": 0.0} if disk else {}),
        )
        config = ZeroConfig(strategy="chunk", stage=3, precision=Precision(compute="bf16"),
                            chunk=ChunkPolicy(search_interval=env.shape["d_model"]),
                            placement="gemini", placement_options=options)
        with lazy_init():  # shard() fills each chunk's shard by replaying the initialisers: no full copy first
            model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        zmodel, zopt = shard(model, opt, config=config)

        def step(tokens: torch.Tensor) -> None:
            loss = lm_loss(zmodel(tokens), tokens)
            zmodel.backward(loss)
            zopt.step()
            zopt.zero_grad(set_to_none=True)

        def close() -> None:
            zmodel.close()  # removes the disk tier's files too
            zopt.state.clear()

        return Trainer(step, close, zmodel.engine.placement.report)

    return build


SYSTEMS = (
    System("torch", "plain PyTorch: the model on the device, `torch.autocast(bf16)`, fused AdamW", 4, _build_plain),
    # fp32 parameters, gradients and AdamW's two states on the host
    System("fsdp2-offload", "FSDP2: `fully_shard` per block and the root, `CPUOffloadPolicy(pin_memory=True on CUDA)`, "
           "`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, fused AdamW (steps on the host)",
           16, _build_fsdp2),
    # gemini's host tier is bounded by its own host_budget_mb
    System("zero-gemini", "zero: `ZeroConfig(strategy='chunk', stage=3, Precision(compute='bf16'), placement='gemini')`, "
           "`GeminiConfig` with the budgets above and defaults otherwise (margin_ratio=1: chunks that fit the headroom step on "
           "the device, the others on the host), "
           "fused AdamW",
           0, _zero_builder(disk=False), own_budget=True),
    System("zero-gemini-disk", "as zero-gemini, with the disk tier (`disk_dir`) and a host budget of "
           f"{DISK_HOST_BYTES_PER_PARAM} bytes per parameter plus {DISK_HOST_SLACK >> 30} GiB (2 MiB in a dry run) and "
           "margin_ratio=0 (every chunk steps on the host): past the host budget, optimizer states (and master shards) "
           "go to disk", 0, _zero_builder(disk=True), own_budget=True),
)


# -- one attempt -------------------------------------------------------------------------------------------
class CopyCounter(TorchDispatchMode):
    """Bytes every operator copies between the host and another device, as they cross the link."""

    def __init__(self) -> None:
        super().__init__()
        self.h2d = 0
        self.d2h = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        aten = torch.ops.aten
        if func is aten._to_copy.default:
            self._count(args[0], out, kwargs.get("non_blocking", False))
        elif func is aten.copy_.default or func is aten._foreach_copy_.default:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            pairs = zip(args[0], args[1]) if func is aten._foreach_copy_.default else [(args[0], args[1])]
            for dst, src in pairs:
                self._count(src, dst, non_blocking)
        return out

    def _count(self, src: Any, dst: Any, non_blocking: bool) -> None:
        if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)) or src.device.type == dst.device.type:
            return
        # A copy that also converts the dtype converts on the device when non-blocking and on the host when
        # blocking (torch's copy_kernel_cuda): converted on the source's side, the destination's dtype crosses.
        converted_before = (src.device.type == "cpu") != non_blocking
        nbytes = dst.numel() * (dst.element_size() if converted_before else src.element_size())
        if dst.device.type == "cpu":
            self.d2h += nbytes
        elif src.device.type == "cpu":
            self.h2d += nbytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and what caused it."""
    seen: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and all(current is not e for e in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def refused_at_planning(err: BaseException) -> bool:
    """Whether ``err`` is zero refusing the model before anything changed: gemini's ``DeviceBudgetError`` (a
    ``TierBudgetError``) from its plan, or a tier budget refusing a placement at setup."""
    return any(isinstance(e, TierBudgetError) for e in _chain(err))


def _out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is the allocator, or a CUDA library that could not allocate."""
    return any(isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
               or "alloc_failed" in str(e).lower() for e in _chain(err))


def _refusal(system: System, env: Env, params: int) -> str | None:
    """Why a depth is not attempted, if it is not: the dry run's stand-in budget, or the host cap."""
    if env.dry_run and not system.own_budget:
        limit = env.config(DRY_FIT_LAYERS).num_params
        if params > limit:
            return f"stand-in budget: {params:,} parameters > {limit:,} ({DRY_FIT_LAYERS} layer(s))"
    host = system.host_bytes_per_param * params
    if host > env.host_cap:
        return f"~{host / 2**30:.1f} GiB of host memory estimated, over the cap of {env.host_cap / 2**30:.1f} GiB"
    return None


def _attempt(system: System, env: Env, depth: int) -> Attempt:
    cfg = env.config(depth)
    refusal = _refusal(system, env, cfg.num_params)
    if refusal is not None:
        # the stand-in plays the allocator: what a real run would do is fail while building
        return Attempt(depth, FAILED if refusal.startswith("stand-in") else SKIPPED, refusal)
    device = env.device
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, env.budget_gib * 2**30 / total), device)
        torch.cuda.reset_peak_memory_stats(device)
        # what earlier attempts left allocated counts against this one's budget: say so in the row
        measured_before = {"left_allocated_MiB": round(torch.cuda.memory_allocated(device) / 2**20, 1)}
    data = SyntheticTokens(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
    tokens = [data.batch(i, env.batch).to(device) for i in range(STEPS + 1)]
    start = time.perf_counter()
    measured: dict[str, Any] = dict(measured_before) if device.type == "cuda" else {}
    trainer: Trainer | None = None
    phase = "build"
    # host memory kept per parameter: build, setup and the first step (untimed for the median), see
    # [Note: host bytes per parameter] in zero_bench.host_memory
    window = contextlib.ExitStack()
    try:
        grown = window.enter_context(host_growth())
        torch.manual_seed(0)
        phase = "build and setup"
        trainer = system.build(cfg, env)  # built lazily, materialised where each system keeps it
        measured["setup_s"] = round(time.perf_counter() - start, 2)
        if device.type == "cuda":  # zero makes each master shard where gemini places it: see [Note: shards made where they live]
            measured["setup_peak_alloc_MiB"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        times = []
        for i in range(STEPS):
            phase = f"step {i + 1}"
            if i == 1:
                window.close()
                measured.update(grown.per_param(cfg.num_params))
                if trainer.placement_report is not None:
                    before = trainer.placement_report()
            _sync(device)
            t0 = time.perf_counter()
            trainer.step(tokens[i])
            _sync(device)
            times.append(time.perf_counter() - t0)
        step_s = statistics.median(times[1:])  # the first step warms up (gemini traces it)
        measured.update({"step_s": [round(t, 4) for t in times],
                         "tokens_per_s": round(env.batch * cfg.seq_len / step_s, 1)})
        if device.type == "cuda":
            measured["peak_alloc_MiB"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
            measured["peak_reserved_MiB"] = round(torch.cuda.max_memory_reserved(device) / 2**20, 1)
        if trainer.placement_report is not None:
            measured.update(_placement_per_step(before, trainer.placement_report(), STEPS - 1))
    except Exception as err:  # noqa: BLE001 - an attempt that fails is a row's data, not the section's end
        why = f"{phase}: {type(err).__name__}: {str(err)[:300]}"
        if refused_at_planning(err):
            return Attempt(depth, REFUSED, why, time.perf_counter() - start, measured)
        measured["out_of_memory"] = _out_of_memory(err)
        return Attempt(depth, FAILED, why, time.perf_counter() - start, measured)
    else:
        measured.update(_count_copies(trainer, tokens[STEPS], device, step_s))
        return Attempt(depth, FIT, seconds=time.perf_counter() - start, measured=measured)
    finally:
        window.close()  # an attempt that failed before its second step: the counting stops here
        if trainer is not None:
            try:
                trainer.close()
            except Exception as err:  # noqa: BLE001 - after a failed step a close may fail too; the next attempt is clean anyway
                measured["close_error"] = f"{type(err).__name__}: {str(err)[:200]}"


def _count_copies(trainer: Trainer, tokens: torch.Tensor, device: torch.device, step_s: float) -> dict[str, Any]:
    """One more step, untimed, with every host<->device copy counted (the counting costs Python time per operator)."""
    counter = CopyCounter()
    try:
        with counter:
            trainer.step(tokens)
        _sync(device)
    except Exception as err:  # noqa: BLE001 - the depth fit in 3 steps; only this figure is lost
        return {"copy_count_error": f"{type(err).__name__}: {str(err)[:200]}"}
    return {"h2d_MiB_per_step": round(counter.h2d / 2**20, 1), "d2h_MiB_per_step": round(counter.d2h / 2**20, 1),
            # on the CPU the device is the host: there is no link to measure
            "offload_GBps": None if device.type == "cpu" else round((counter.h2d + counter.d2h) / step_s / 1e9, 2)}


def _placement_per_step(before: dict[str, Any], after: dict[str, Any], steps: int) -> dict[str, Any]:
    """Tier moves (master shards, gradients, optimizer states) and disk traffic per step, from the report's counters."""
    moved = {part: round((after["bytes_moved"][part] - before["bytes_moved"][part]) / steps / 2**20, 1)
             for part in after["bytes_moved"]}
    disk = {kind: round((after[f"disk_bytes_{kind}"] - before[f"disk_bytes_{kind}"]) / steps / 2**20, 1)
            for kind in ("read", "written")}
    return {"tier_moves_MiB_per_step": moved, "disk_MiB_per_step": disk}


# -- the search ----------------------------------------------------------------------------------------------
def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        # pinned host blocks stay cached otherwise, and the next, deeper attempt pins more
        empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None)  # absent before torch 2.13
        if empty_host_cache is not None:
            empty_host_cache()


def _row(system: System, attempt: Attempt, params: int) -> dict[str, Any]:
    """One row of the table: a system at one depth."""
    return {"name": system.name, "depth": attempt.depth, "params": params, "status": attempt.status,
            "detail": attempt.detail or None, "seconds": round(attempt.seconds, 1), **attempt.measured}


def _sizes(system: System, env: Env, depths: Sequence[int], until: float, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The system at each depth, smallest first; once a depth did not train, the deeper ones are not attempted."""
    rows = []
    stopped: str | None = None
    seconds_per_param = 0.0  # of the last attempt, to tell whether the next one ends in time
    for depth in depths:
        params = env.config(depth).num_params
        if stopped is None and time.perf_counter() + seconds_per_param * params > until:
            stopped = "the section's time share would run out"
        if stopped is not None:
            rows.append(_row(system, Attempt(depth, SKIPPED, stopped), params))
            continue
        attempt = _attempt(system, env, depth)
        _release(env.device)
        rows.append(_row(system, attempt, params))
        log(f"capacity {system.name} depth {depth}: {attempt.status} in {attempt.seconds:.1f} s"
            + (f" ({attempt.measured['tokens_per_s']} tokens/s)" if attempt.status == FIT else f" ({attempt.detail})"))
        if attempt.status != FIT:
            stopped = f"depth {depth} did not train"
        elif attempt.seconds:
            seconds_per_param = attempt.seconds / params
    return rows


def run_capacity(*, device: torch.device, dry_run: bool, budget_gib: float, deadline_s: float,
                 log: Callable[[str], None], systems: Sequence[str] | None = None,
                 depths: Sequence[int] | None = None) -> dict[str, Any]:
    """Each system at each depth (default :data:`FULL_DEPTHS`, or :data:`DRY_DEPTHS` in a dry run) within an equal
    share of ``deadline_s`` (time a system leaves unused goes to the ones after it). ``systems``: the names to run
    (default: all of :data:`SYSTEMS`). Never raises: a system that fails says so in its rows."""
    start = time.perf_counter()
    shape, batch = (DRY_SHAPE, DRY_BATCH) if dry_run else (FULL_SHAPE, FULL_BATCH)
    depths = tuple(depths or (DRY_DEPTHS if dry_run else FULL_DEPTHS))
    result: dict[str, Any] = {"budget_gib": budget_gib, "dry_run": dry_run, "device": str(device), "depths": list(depths),
                              "shape": {**shape, "batch": batch, "steps": STEPS, "activation_checkpointing": True,
                                        "compute": "bf16", "master": "fp32", "optimizer": "AdamW"},
                              "systems": [], "rows": []}
    disk_dir = None
    try:
        # /var/tmp is on disk where /tmp may be memory (tmpfs), which the disk tier would only take from the host
        disk_dir = tempfile.mkdtemp(prefix="zero-capacity-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
        env = Env(device=device, dry_run=dry_run, budget_gib=budget_gib, shape=shape, batch=batch,
                  host_cap=int(HOST_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
                  disk_dir=disk_dir, disk_budget=int(DISK_SHARE * shutil.disk_usage(disk_dir).free))
        result.update({"host_cap_GiB": round(env.host_cap / 2**30, 1), "disk_budget_GiB": round(env.disk_budget / 2**30, 1),
                       "gemini_device_budget_MiB": round(budget_gib * 1024 * (1 - GEMINI_MARGIN), 1)})
        chosen = [s for s in SYSTEMS if systems is None or s.name in systems]
        unknown = set(systems or ()) - {s.name for s in SYSTEMS}
        if unknown:
            raise ValueError(f"unknown capacity systems {sorted(unknown)}; choose from {[s.name for s in SYSTEMS]}")
        for index, system in enumerate(chosen):
            result["systems"].append({"name": system.name, "what": system.what})
            left = deadline_s - (time.perf_counter() - start)
            until = time.perf_counter() + left / (len(chosen) - index)
            try:
                result["rows"] += _sizes(system, env, depths, until, log)
            except Exception as err:  # noqa: BLE001 - fail soft: the other systems still run
                result["systems"][-1]["error"] = f"{type(err).__name__}: {err}"
                _release(device)
    except Exception as err:  # noqa: BLE001 - fail soft: the report says why the section has no rows
        result["error"] = f"{type(err).__name__}: {err}"
    finally:
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


# -- the report ----------------------------------------------------------------------------------------------
def _cell(value: Any) -> str:
    return "n/a" if value is None else str(value)


def render_capacity(result: dict[str, Any]) -> list[str]:
    """The section's heading, its method, and one row per system and depth. Reads ``pinned_H2D_GBps`` when the
    driver has added its measured pinned host-to-device bandwidth, for the share of it the copies reach."""
    shape = result["shape"]
    pinned = result.get("pinned_H2D_GBps")
    lines = [
        "\n## Fixed model sizes under one device budget\n",
        f"Each system trains a GPT at depths {', '.join(map(str, result.get('depths', [])))} for {shape['steps']} steps "
        f"under {result['budget_gib']} GiB of device memory (`torch.cuda.set_per_process_memory_fraction`, set before "
        f"every attempt; gemini plans under {result.get('gemini_device_budget_MiB')} MiB, {GEMINI_MARGIN:.0%} less). "
        f"Shape: d_model {shape['d_model']}, {shape['n_head']} heads, sequence {shape['seq_len']}, vocabulary "
        f"{shape['vocab_size']}, batch {shape['batch']}, activation checkpointing on every block, bf16 compute, fp32 "
        "master parameters, AdamW. Models are built lazily (zero: `lazy_init()`, filled shard by shard; FSDP2: meta, "
        "`fully_shard`, `to_empty` on the host; plain: meta, `to_empty` on the device): no full host copy first. "
        "Once a depth does not train, a system's deeper ones are not attempted; nor are attempts estimated past "
        f"{result.get('host_cap_GiB')} GiB of host memory (half the RAM; zero's host tier is capped there too).",
        "",
        "- outcome: `fit`; `refused at planning` (zero's `DeviceBudgetError` or `TierBudgetError`, raised before any "
        "parameter changed); `failed later` (out of memory or an error in the build, the setup or a step); "
        "`not attempted`.",
        "- tokens/s and step s: the median of steps 2 and 3; peaks: the allocator's over build, setup and steps; "
        "setup peak: the allocator's over build and setup only (zero makes each master shard where gemini places it, "
        "in pinned host memory: at most about one chunk on the device).",
        "- host<->device GB/s: bytes copied between host and device, both directions, counted per operator on a 4th "
        "step, over the median step time"
        + (f"; share: of the pinned host-to-device bandwidth above ({pinned} GB/s)." if pinned else "."),
        "- host B/param: host memory kept per parameter after build, setup and the first step: the host tensors "
        "alive then (exact; fp32 AdamW's floor is 12) and the resident set's growth (what the machine pays: pinned "
        "blocks rounded up and cached, malloc's slack); see zero_bench.host_memory.",
        "- tier moves: what gemini's report counts as moved between tiers per step (master shards, gradients, optimizer "
        "states); the disk tier's reads and writes per step are in results.json (`disk_MiB_per_step`).",
        "",
        *(f"- {system['name']}: {system['what']}" + (f" **ERROR** `{system['error']}`" if system.get("error") else "")
          for system in result["systems"]),
        "",
    ]
    if result["dry_run"]:
        lines += ["**Dry run (CPU): the budget is a stand-in for plain PyTorch and FSDP2.** The CPU has no allocator "
                  f"cap, so for them a depth fits iff its parameter count is at most {DRY_FIT_LAYERS} layer(s)' worth; "
                  "zero plans under its own budget. The device is the host, so there are no peaks and no link to "
                  "measure. This checks the code path; the numbers mean nothing.", ""]
    if result.get("error"):
        lines += [f"**ERROR** `{result['error']}`", ""]
    header = ["system", "depth", "params (M)", "outcome", "tokens/s", "step s", "peak alloc MiB", "peak reserved MiB",
              "setup peak alloc MiB", "host<->device GB/s", "share", "host B/param (tensors / resident)", "tier moves MiB/step", "why not"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in result.get("rows", []):
        step_s, moves, rate = row.get("step_s"), row.get("tier_moves_MiB_per_step"), row.get("offload_GBps")
        cells = [row["name"], row["depth"], round(row["params"] / 1e6, 1), row["status"],
                 row.get("tokens_per_s"), None if step_s is None else round(statistics.median(step_s[1:]), 3),
                 row.get("peak_alloc_MiB"), row.get("peak_reserved_MiB"), row.get("setup_peak_alloc_MiB"), rate,
                 f"{rate / pinned:.0%}" if rate is not None and pinned else None,
                 None if row.get("host_B_per_param") is None else f"{row['host_B_per_param']} / {row.get('host_rss_B_per_param')}",
                 None if moves is None else round(sum(moves.values()), 1),
                 (row.get("detail") or "").replace("|", "/").replace("\n", " ") or None]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines
