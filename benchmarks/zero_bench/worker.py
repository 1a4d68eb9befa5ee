"""One configuration on every rank: build, train, measure. Launched by torchrun, one process per rank.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m zero_bench.worker --spec JSON --out PATH

:func:`run_config` is the per-rank body (also called by the tests through ``run_distributed``); it
returns rank 0's record with every rank's figures gathered in, and ``None`` on the other ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zero_bench.configs import build_model
from zero_bench.counting import Counter, count_ddp, count_fsdp2
from zero_bench.mlp import block_params
from zero_bench.teardown import destroy_process_group_checked
from zero_bench.timeline import MemoryProbe, MemoryTimeline, breakdown_at_peak
from zero_core import ChunkPolicy, CommStats, ConfigError, LossScale, Precision, ZeroConfig, estimate, shard
from zero_core.chunks.chunk import to_local
from zero_core.testing.gpt import SyntheticTokens, lm_loss

DATA_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def peak_memory_reset(device: torch.device) -> None:
    """Start the peak-memory window here (after imports and the process group)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):  # "5" resets the resident-set high-water mark (Linux)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def current_memory_mib(device: torch.device) -> float:
    """Allocated bytes on CUDA; the resident set of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def peak_memory_mib(device: torch.device) -> float:
    """The allocator's peak on CUDA; the resident-set high-water mark of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def device_mesh(device: torch.device, shape: list[int]) -> Any:
    """The ``DeviceMesh`` a mesh row shards over: ``(replicate, shard)``, or ``(shard,)``, over every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh(device.type, tuple(shape), mesh_dim_names=names)


def by_group(comm: dict[str, dict[str, int]]) -> dict[str, int]:
    """Bytes sent by group: ``shard`` (all-gathers and reduce-scatters), ``replicate`` (all-reduces)."""
    sent = {k: v["bytes_sent"] for k, v in comm.items()}
    return {"shard": sent.get("all_gather", 0) + sent.get("reduce_scatter", 0), "replicate": sent.get("all_reduce", 0)}


def zero_config(config: dict[str, Any], model: dict[str, Any]) -> ZeroConfig:
    precision = config["precision"]
    # The thin MLP (58K parameters) would be one chunk under the search's 1M-element floor, and the search may pack
    # several blocks into one; a block's size gives a chunk per block, the unit FSDP2 wraps, as the host-overhead rows
    # compare (the embedding and the head's weight and bias are larger or apart, so they get chunks of their own).
    chunking = {"chunk_size": block_params(model["d_model"])} if model.get("block") == "mlp" else {}
    return ZeroConfig(strategy=config["strategy"], stage=config["stage"], comm_backend=config["comm"],
                      placement=config["placement"], placement_options=config["placement_options"],
                      precision=Precision(compute=None if precision == "fp32" else precision,
                                          loss_scale=LossScale() if precision == "fp16" else None),
                      chunk=ChunkPolicy(search_interval=model["d_model"], **chunking))


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def reference_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameters, gradients and optimizer states a DDP or FSDP2 rank holds (each storage once)."""
    params = [_local(p) for p in model.parameters()]
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    states = [_local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": _storage_bytes(params), "grads": _storage_bytes(grads), "optimizer_states": _storage_bytes(states)}


def zero_tiers(model: Any) -> dict[str, int]:
    """Model-state bytes by tier: the tiered policies' own accounting, else each chunk's tier."""
    engine = model.engine
    report = getattr(engine.placement, "report", None)
    held = model.model_state_bytes()
    total = held["params"] + held["grads"] + held["optimizer_states"]
    if report is not None:
        used = {k: int(v) for k, v in report()["used"].items()}
        # the tiers account shard-sized parts; the full buffers stages 1 and 2 keep are on the device
        used["device"] += total - sum(used.values())
        return used
    tiers = {"device": 0, "host": 0, "disk": 0}
    state = engine.optimizer.state
    for chunk in engine.chunks:  # the shard-sized parts; a kept full buffer (a shard may be its view) is the device's
        part = chunk.shard.numel() * chunk.shard.element_size()
        if chunk.requires_grad and any(s.param.grad is not None for s in chunk.segments):
            part += chunk.shard.numel() * chunk.shard.element_size()
        part += sum(to_local(v).numel() * v.element_size() for s in chunk.segments for v in state.get(s.param, {}).values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        tiers[chunk.tier.value] += part
    tiers["device"] += total - sum(tiers.values())
    return tiers


def reference_accounting(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """A DDP or FSDP2 rank's model states now (FSDP2's gathered parameters are not among them: they count as ``other``)."""
    return reference_state_bytes(model, optimizer)


def _one_step(net: Any, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, kind: str, mark: Any = None) -> torch.Tensor:
    mark = mark or (lambda phase: None)
    mark("zero_grad")
    optimizer.zero_grad(set_to_none=True)
    mark("forward")
    loss = lm_loss(net(tokens), tokens)
    mark("backward")
    if kind == "zero":
        net.backward(loss)
    else:
        loss.backward()
    mark("step")
    optimizer.step()
    mark("end")
    return loss


def _not_applicable(exc: BaseException) -> bool:
    """A configuration refused for its options on this machine (a config or budget error), not a failure."""
    return isinstance(exc, ConfigError) or type(exc).__name__ == "TierBudgetError"


def run_config(config: dict[str, Any], model: dict[str, Any], *, steps: int, warmup: int, lr: float = 1e-3) -> dict | None:
    """Train ``config`` for ``steps`` steps on the process group that is up; rank 0 gets the record."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    peak_memory_reset(device)
    at_start = current_memory_mib(device)  # the interpreter, torch and the process group: the same for every row
    probe = MemoryProbe(device)
    start_rss, (start_in_use, start_held) = probe.rss(), probe.allocator_bytes()
    data = SyntheticTokens(vocab_size=model["vocab"], seq_len=model["seq_len"])
    torch.manual_seed(0)
    net = build_model(model)
    params = sum(p.numel() for p in net.parameters())
    kind = config["kind"]
    counter = Counter(world)
    record: dict[str, Any] = {"status": "ok", "error": None}
    try:
        if kind == "zero":
            zcfg = zero_config(config, model)
            optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
            mesh = config.get("mesh")
            predicted = estimate(net, world_size=world, mesh_shape=None if mesh is None else tuple(mesh), config=zcfg,
                                 optimizer=optimizer)
            net, optimizer = shard(net, optimizer, config=zcfg, **({} if mesh is None else {"mesh": device_mesh(device, mesh)}))
        elif kind == "plain":
            if world != 1:  # nothing would average the gradients: each rank would train a model of its own
                raise ValueError(f"the plain reference trains on one rank, not {world}; use ddp on {world} ranks")
            optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
        elif kind == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(net.to(device), gradient_as_bucket_view=True)
            count_ddp(net, counter)
            optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
        elif kind == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            net = net.to(device)
            for block in net.blocks:
                fully_shard(block)
            fully_shard(net)
            optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
        else:
            raise ValueError(f"unknown configuration kind {kind!r}")
    except Exception as exc:
        refused = exc
    else:
        refused = None
    setup_peak = peak_memory_mib(device)  # the high-water mark is monotone: this much of it is the setup's
    # Every rank learns whether any rank refused, before anyone starts a step that would wait for it.
    verdicts: list[Any] = [None] * world
    dist.all_gather_object(verdicts, None if refused is None else (type(refused).__name__, str(refused), _not_applicable(refused)))
    failures = [v for v in verdicts if v is not None]
    if failures:
        name, message, applicable = failures[0]
        if refused is not None and not applicable:
            raise refused
        if not all(v[2] for v in failures):
            raise RuntimeError(f"another rank failed at setup with {name}: {message}")
        record.update(status="not applicable", error=f"{name}: {message}")
        return record if rank == 0 else None
    losses, times, cpu_times, step_peaks = [], [], [], []
    for step in range(steps):
        tokens = data.batch(step, model["batch_size"] * world)[rank * model["batch_size"]:(rank + 1) * model["batch_size"]]
        tokens = tokens.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0, c0 = time.perf_counter(), time.process_time()
        with count_fsdp2(counter) if kind == "fsdp2" else contextlib.nullcontext():
            loss = _one_step(net, optimizer, tokens, kind)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        # the process's CPU time (every thread of it): a launch that waited for a core shows it in its wall time only
        cpu_times.append(time.process_time() - c0)
        step_peaks.append(peak_memory_mib(device))
        counter.end_step()
        reported = loss.detach().float().reshape(1)
        dist.all_reduce(reported)
        losses.append(reported.item() / world)
    timing = None  # the references' collectives are counted, not timed
    if kind == "zero":
        comm = net.comm_stats.summary()
        # the steps the median step time is over (the window keeps the last 256)
        steady_steps = list(net.comm_stats.steps)[-(len(times) - warmup if len(times) > warmup else len(times)):]
        timing = net.comm_stats.timed_summary(CommStats.combine(steady_steps), steps=len(steady_steps))
        state = net.model_state_bytes()
        state = {k: state[k] for k in ("params", "grads", "optimizer_states")}
        tiers = zero_tiers(net)
    else:
        comm = counter.steps[-1]
        state = reference_state_bytes(net, optimizer)
        tiers = {"device": sum(state.values()), "host": 0, "disk": 0}
    # One more step, untimed and not among the losses, sampled for the memory timeline (after warm-up, so
    # every buffer and optimizer state exists; the sampling hooks are never installed during the timed steps).
    tokens = data.batch(steps, model["batch_size"] * world)[rank * model["batch_size"]:(rank + 1) * model["batch_size"]]
    accounting = net.memory_by_kind if kind == "zero" else (lambda: reference_accounting(net, optimizer))
    with MemoryTimeline(probe, accounting, optimizer) as sampler:
        _one_step(net, optimizer, tokens.to(device), kind, sampler.mark)
    timeline = sampler.as_dict(start_rss=start_rss, start_in_use=start_in_use, start_held=start_held)
    probe.close()
    mine = {"peak_memory_mib": peak_memory_mib(device), "start_memory_mib": at_start, "model_state": state, "tiers": tiers, "comm": comm,
            "comm_timing": timing, "timeline": timeline, "setup_peak": setup_peak, "step_peaks": step_peaks}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if kind == "zero":
        net.close()
    if rank != 0:
        return None
    steady = times[warmup:] if len(times) > warmup else times
    median = statistics.median(steady)
    cpu_steady = cpu_times[warmup:] if len(cpu_times) > warmup else cpu_times
    theory = reference_theory(kind, params, world) if kind != "zero" else {
        "model_state_bytes": predicted.formula["model_state_bytes"], "bytes_sent": predicted.formula["bytes_sent"]}
    record.update({
        "world_size": world,
        "losses": losses,
        "step_times_s": times,
        "median_step_s": median,
        "cpu_times_s": cpu_times,  # rank 0's process CPU time per step
        "median_cpu_step_s": statistics.median(cpu_steady),
        "tokens_per_s": model["batch_size"] * model["seq_len"] * world / median,
        "peak_memory_mib": [r["peak_memory_mib"] for r in everyone],
        "start_memory_mib": [r["start_memory_mib"] for r in everyone],
        "model_state_bytes": [sum(r["model_state"].values()) for r in everyone],
        "setup_peak_memory_mib": [r["setup_peak"] for r in everyone],
        "peak_memory_by_step_mib": [r["step_peaks"] for r in everyone],
        "peak_in_use_mib": [None if r["timeline"]["in_use_mib"] is None else max(r["timeline"]["in_use_mib"]) for r in everyone],
        "memory_timeline": [r["timeline"] for r in everyone],
        "memory_at_peak": [breakdown_at_peak(r["timeline"]) for r in everyone],
        "model_state_by_kind": [r["model_state"] for r in everyone],
        "model_state_by_tier": [r["tiers"] for r in everyone],
        "bytes_sent_per_step": [sum(v["bytes_sent"] for k, v in r["comm"].items() if k in DATA_KINDS) for r in everyone],
        "control_bytes_per_step": [sum(v["bytes_sent"] for k, v in r["comm"].items() if k not in DATA_KINDS) for r in everyone],
        "bytes_sent_by_group": [by_group(r["comm"]) for r in everyone],
        "collective_calls_per_step": {k: v["calls"] for k, v in everyone[0]["comm"].items()},
        "collectives_per_step": everyone[0]["comm"],
        "comm_timing_per_step": None if kind != "zero" else [r["comm_timing"] for r in everyone],
        "theory": theory,
        "estimate": None if kind != "zero" else {
            "model_state_by_kind": list(predicted.per_rank), "model_state_by_tier": None if predicted.tiers is None else list(predicted.tiers),
            "bytes_sent": predicted.bytes_sent, "bytes_sent_by_group": predicted.bytes_sent_by_group, "calls": predicted.calls,
            "padded_params": predicted.padded_params, "mesh_shape": list(predicted.mesh_shape)},
    })
    return record


def reference_theory(kind: str, params: int, world: int) -> dict[str, int]:
    """The ZeRO paper's formulas for the references (Adam, fp32): DDP is plain data
    parallelism (16 Psi per rank, one ring all-reduce of the gradients), FSDP2 is ZeRO-3
    (16 Psi / N per rank; two all-gathers of the parameters and one reduce-scatter of the gradients)."""
    if kind in ("ddp", "plain"):  # plain PyTorch on one rank holds what DDP holds and sends nothing
        return {"model_state_bytes": 16 * params, "bytes_sent": round(2 * (world - 1) / world * 4 * params)}
    return {"model_state_bytes": round(16 * params / world), "bytes_sent": round(3 * (world - 1) / world * 4 * params)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one bench configuration; launch with torchrun")
    p.add_argument("--spec", required=True, help="JSON: config, model, steps, warmup")
    p.add_argument("--out", required=True, help="where rank 0 writes its record (JSON)")
    args = p.parse_args(argv)
    spec = json.loads(args.spec)
    if spec.get("threads"):  # torchrun sets OMP_NUM_THREADS=1 for 2 ranks and more, not for one: the same for every size
        torch.set_num_threads(spec["threads"])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=spec.get("timeout_s", 300)))
    try:
        record = run_config(spec["config"], spec["model"], steps=spec["steps"], warmup=spec["warmup"])
        if record is not None:
            record["backend"] = backend
            with open(args.out, "w") as f:
                json.dump(record, f)
    except BaseException:
        dist.destroy_process_group()  # the error is the news; the teardown check would only hide it
        raise
    destroy_process_group_checked()  # its threads, left running, could abort the exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
