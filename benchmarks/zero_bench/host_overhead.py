"""The host-overhead section of the bench (``zero bench --host-overhead``): its rows and its table.

It trains the ``mlp-48`` model (48 blocks of Linear(32, 32) + LayerNorm + GELU, :mod:`zero_bench.mlp`),
whose arithmetic is negligible, so each row's step time above plain PyTorch's is the host work of the
framework: hooks, gathers and their bookkeeping, the optimizer's dispatch. At every world size it runs
plain PyTorch (one rank; DDP on more), zero's chunk strategy at stages 2 and 3 (one chunk per block), the
tensor strategy at stage 3 (one unit per parameter) and FSDP2 (``fully_shard`` on each block and the root),
each in its own launch as every bench row is. The table gives each row's step against the plain reference
of its world size and against FSDP2's, the same for rank 0's process CPU time per step, and the host time above
the plain reference per block and step. The one-rank targets are judged on CPU time, which leaves out a wait
for a core (at one rank the two are otherwise the same work: one thread, nothing to wait for); on a GPU it is the
host's work per step, which the wall time hides once the device is the slower. At two ranks the CPU time also
counts gloo's threads, and the wall time the ranks' waits on each other. Neither makes single launches
comparable on a machine whose speed changes from one launch to the next (a virtual machine's host takes its time
from the process's CPU time too: ``benchmarks/results/cpu-2026-12-04-host-light-9/``); ``zero_bench.host_cpu``
and ``zero_bench.paired`` interleave what they compare.
"""

from __future__ import annotations

from typing import Any

from zero_bench.configs import BenchConfig

__all__ = ["MODEL", "STEPS", "TARGETS", "THREADS", "WARMUP", "WORLD_SIZES", "configs", "host_table", "summary"]

MODEL = "mlp-48"
WORLD_SIZES = (1, 2)
STEPS, WARMUP = 50, 10  # a step is tens of ms, so many steps are cheap and the median is steadier
# One intra-op thread per rank at every world size: torchrun sets OMP_NUM_THREADS=1 for two ranks and more but not for
# one, and on a loaded machine a second thread per op costs more than the op (a 13 ms gelu was measured at load 13).
THREADS = 1
# issue 47 item 4, at one rank on CPU: the row's step at most this many times the plain reference's and FSDP2's
TARGETS = {"chunk-s3": {"plain": 1.5, "fsdp2": 0.3}, "chunk-s2": {"plain": 1.3, "fsdp2": 0.3}}
ZERO_ROWS = (("chunk", 2), ("chunk", 3), ("tensor", 3))


def _ranks(world: int) -> str:
    return f"{world}rank" if world == 1 else f"{world}ranks"


def configs(world_sizes: list[int] | tuple[int, ...] = WORLD_SIZES) -> list[BenchConfig]:
    """The section's rows, by world size: the plain reference (``plain`` on one rank, else ``ddp``), the zero rows, FSDP2."""
    rows = []
    for world in world_sizes:
        reference = "plain" if world == 1 else "ddp"
        rows.append(BenchConfig(name=f"{reference}-{_ranks(world)}", kind=reference, world_size=world))
        rows += [BenchConfig(name=f"{strategy}-s{stage}-{_ranks(world)}", kind="zero", strategy=strategy, stage=stage,
                             world_size=world) for strategy, stage in ZERO_ROWS]
        rows.append(BenchConfig(name=f"fsdp2-{_ranks(world)}", kind="fsdp2", world_size=world))
    return rows


def _step(r: dict[str, Any] | None) -> float | None:
    return None if r is None else r.get("median_step_s")


def _cpu(r: dict[str, Any] | None) -> float | None:
    return None if r is None else r.get("median_cpu_step_s")


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def summary(records: list[dict[str, Any]], units: int) -> list[dict[str, Any]]:
    """One entry per row: its step, its ratios to the plain reference and to FSDP2 at its world size, and the host
    microseconds per unit (block) and step above the plain reference (``None`` where a row or its reference did not run)."""
    plain: dict[int, dict[str, Any]] = {}
    fsdp2: dict[int, dict[str, Any]] = {}
    for r in records:
        kind, world = r["config"]["kind"], r["world_size"]
        if _step(r) is not None and kind in ("plain", "ddp"):
            plain.setdefault(world, r)
        elif _step(r) is not None and kind == "fsdp2":
            fsdp2.setdefault(world, r)
    out = []
    for r in records:
        world, step, cpu = r["world_size"], _step(r), _cpu(r)
        base, full = _step(plain.get(world)), _step(fsdp2.get(world))
        out.append({
            "name": r["name"], "world_size": world, "status": r["status"], "step_s": step,
            "reference": plain[world]["name"] if world in plain else None,
            "step_vs_plain": _ratio(step, base), "step_vs_fsdp2": _ratio(step, full),
            "cpu_s": cpu, "cpu_vs_plain": _ratio(cpu, _cpu(plain.get(world))),
            "cpu_vs_fsdp2": _ratio(cpu, _cpu(fsdp2.get(world))),
            "host_us_per_unit": None if step is None or base is None or r["config"]["kind"] in ("plain", "ddp")
            else 1e6 * (step - base) / units,
            "units": units})
    return out


def _cell(value: float | None, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def host_table(rows: list[dict[str, Any]]) -> str:
    """:func:`summary`'s rows as Markdown."""
    head = ("| config | ranks | status | step ms | vs plain | vs FSDP2 | CPU ms | CPU vs plain | CPU vs FSDP2 "
            "| host µs/unit/step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in rows:
        cpu = s.get("cpu_s")
        lines.append(f"| {s['name']} | {s['world_size']} | {s['status']} | {_cell(s['step_s'] and 1000 * s['step_s'], '.1f')} "
                     f"| {_cell(s['step_vs_plain'], '.2f', 'x')} | {_cell(s['step_vs_fsdp2'], '.2f', 'x')} "
                     f"| {_cell(cpu and 1000 * cpu, '.1f')} | {_cell(s.get('cpu_vs_plain'), '.2f', 'x')} "
                     f"| {_cell(s.get('cpu_vs_fsdp2'), '.2f', 'x')} | {_cell(s['host_us_per_unit'], '.0f')} |")
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets at one rank, each with the measured CPU-time ratio (the wall-time one beside it) and
    whether it is met; on the wall-time ratio where a record has no CPU time (a bench before it was measured)."""
    lines = []
    for s in rows:
        name = s["name"].removesuffix("-1rank")
        if s["world_size"] != 1 or name not in TARGETS:
            continue
        for against, limit in TARGETS[name].items():
            wall, cpu = s[f"step_vs_{against}"], s.get(f"cpu_vs_{against}")
            got = wall if cpu is None else cpu
            verdict = "not measured" if got is None else ("met" if got <= limit else "not met")
            measured = (f"{_cell(wall, '.2f', 'x')} (wall time)" if cpu is None
                        else f"{_cell(cpu, '.2f', 'x')} in CPU time ({_cell(wall, '.2f', 'x')} in wall time)")
            lines.append(f"{name} at 1 rank: step at most {limit:.1f}x {'plain PyTorch' if against == 'plain' else 'FSDP2'}'s: "
                         f"{measured}, {verdict}")
    return lines
