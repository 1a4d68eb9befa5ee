"""The loss-agreement check, the ratios and the Markdown table."""

from __future__ import annotations

import math
from typing import Any

from zero_bench.spread import rank_text, spread_s

MiB = 2**20
DATA_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def world_size(r: dict[str, Any]) -> int | None:
    """The ranks a record ran on (its own, for a mesh row or a reference at another size)."""
    return r.get("world_size") or r["config"].get("world_size")


def _references(records: list[dict[str, Any]]) -> dict[Any, dict[str, dict[str, Any]]]:
    """The reference rows that ran, by world size, then kind (``plain``: one rank, no wrapper; ``ddp``, ``fsdp2``)."""
    refs: dict[Any, dict[str, dict[str, Any]]] = {}
    for r in records:
        kind = r["config"]["kind"]
        if kind in ("plain", "ddp", "fsdp2") and r.get("median_step_s") is not None:
            refs.setdefault(world_size(r), {}).setdefault(kind, r)
    return refs


def check_losses(records: list[dict[str, Any]], *, rtol: float, rtol_16: float) -> str | None:
    """Mark every record ``losses_agree``; return the reference rows' names (plain PyTorch, else DDP, else
    FSDP2, at each world size, comma-separated; None: unchecked).

    Only plain PyTorch is a reference: a bug every zero row shared would pass against a zero row.
    A row is checked against the reference on its own ranks (the same global batch); a row whose
    world size no reference ran at is unchecked. A loss that is not finite never agrees.
    """
    ok = [r for r in records if r["status"] == "ok"]
    by_world = {}
    for world, refs in _references(ok).items():
        by_world[world] = refs.get("plain") or refs.get("ddp") or refs.get("fsdp2")
    used = []
    for r in records:
        reference = by_world.get(world_size(r))
        if r["status"] != "ok" or reference is None:
            r["losses_agree"] = None
            continue
        if not all(math.isfinite(x) for x in r["losses"]):
            r["losses_agree"], r["status"], r["max_loss_rel_diff"] = False, "WRONG LOSSES", float("nan")
            continue
        tol = rtol if r["config"]["precision"] == "fp32" else rtol_16
        worst = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], reference["losses"])), default=0.0)
        r["max_loss_rel_diff"] = worst
        r["losses_agree"] = len(r["losses"]) == len(reference["losses"]) and worst <= tol
        if not r["losses_agree"]:
            r["status"] = "WRONG LOSSES"
        if reference["name"] not in used:
            used.append(reference["name"])
    return ", ".join(used) or None


def add_ratios(records: list[dict[str, Any]]) -> None:
    """Step time and peak memory against DDP and FSDP2; measured state and traffic against theory."""
    refs = _references(records)
    for r in records:
        if r.get("median_step_s") is None:
            r["ratios"] = {}
            continue
        ddp, fsdp2 = (refs.get(world_size(r), {}).get(kind) for kind in ("ddp", "fsdp2"))
        mem = max(r["peak_memory_mib"])
        r["ratios"] = {
            "step_vs_ddp": _ratio(r["median_step_s"], ddp and ddp["median_step_s"]),
            "step_vs_fsdp2": _ratio(r["median_step_s"], fsdp2 and fsdp2["median_step_s"]),
            "memory_vs_ddp": _ratio(mem, ddp and max(ddp["peak_memory_mib"])),
            "memory_vs_fsdp2": _ratio(mem, fsdp2 and max(fsdp2["peak_memory_mib"])),
            "state_vs_theory": _ratio(max(r["model_state_bytes"]), r["theory"]["model_state_bytes"]),
            "sent_vs_theory": _ratio(max(r["bytes_sent_per_step"]), r["theory"]["bytes_sent"]),
        }


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def _calls(r: dict[str, Any]) -> str:
    calls = r.get("collective_calls_per_step") or {}
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "control": "ctl"}
    return " ".join(f"{short.get(k, k)} {v}" for k, v in sorted(calls.items(), key=lambda kv: list(short).index(kv[0])
                                                                  if kv[0] in short else 9))


def _groups(r: dict[str, Any]) -> str:
    """The largest rank's bytes sent per step by group: shard (AG + RS) / replicate (AR), in MiB."""
    groups = r.get("bytes_sent_by_group")
    if not groups:
        return "–"
    return f"{max(g['shard'] for g in groups) / MiB:.2f} / {max(g['replicate'] for g in groups) / MiB:.2f}"


def _vs_estimate(r: dict[str, Any]) -> str:
    """``exact`` when the measured bytes (state by kind per rank, sent by collective) equal zero_core.estimate's."""
    predicted = r.get("estimate")
    if not predicted:
        return "–"
    # a kind the run never called is absent from its counters; the estimate lists it with 0 bytes
    sent = {k: v["bytes_sent"] for k, v in (r.get("collectives_per_step") or {}).items() if k in DATA_KINDS and v["calls"]}
    state_ok = r["model_state_by_kind"] == predicted["model_state_by_kind"]
    sent_ok = sent == {k: v for k, v in predicted["bytes_sent"].items() if (predicted.get("calls") or {}).get(k, v)}
    if state_ok and sent_ok:
        return "exact"
    wrong = ([] if state_ok else ["state"]) + ([] if sent_ok else ["sent"])
    groups = predicted.get("bytes_sent_by_group")
    told = "" if not groups else f" (est. {groups['shard'] / MiB:.2f} / {groups['replicate'] / MiB:.2f})"
    return "DIFFERS: " + ", ".join(wrong) + told


def _in_use(r: dict[str, Any]) -> str:
    """The allocator's peak in-use bytes over the sampled step, the largest rank (``–``: not measurable here)."""
    peaks = [p for p in r.get("peak_in_use_mib") or [] if p is not None]
    return f"{max(peaks):.0f}" if peaks else "–"


def _setup_peak(r: dict[str, Any]) -> str:
    """Rank 0's high-water mark when setup (building and sharding or wrapping the model) was done."""
    peaks = r.get("setup_peak_memory_mib") or [None]
    return "–" if peaks[0] is None else f"{peaks[0]:.0f}"


def peak_table(records: list[dict[str, Any]]) -> str:
    """Where each row's peak goes (rank 0, the sample of highest RSS in the sampled step; MiB): the process at
    start, the model states the ZeRO formulas count, the system's other buffers, activations and temporaries,
    and the allocator's slack (held from the system, not lent). The columns add up to the RSS at that sample. The
    last column is the high-water mark when setup was done, which the peak column of :func:`table` includes."""
    head = ("| config | RSS at peak | at start | model states | buffers | activations, other | allocator slack "
            "| peak in use | buffers by kind | setup peak |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        at = (r.get("memory_at_peak") or [None])[0]
        if not at:
            continue
        buffers = ", ".join(f"{k[5:]} {v:.0f}" for k, v in at.items()
                            if k.startswith("kind:") and k[5:] not in ("params", "grads", "optimizer_states") and v >= 0.5)
        rows.append(f"| {r['name']} | {at['rss']:.0f} | {at['baseline']:.0f} | {at['states']:.0f} | {at['buffers']:.0f} "
                    f"| {at['other']:.0f} | {at['slack']:.0f} | {at['peak_in_use']:.0f} | {buffers or '–'} "
                    f"| {_setup_peak(r)} |")
    return "\n".join(rows)


def _spread(r: dict[str, Any]) -> str:
    low, high = spread_s(r)
    return f"{1000 * low:.1f}-{1000 * high:.1f}"


def table(records: list[dict[str, Any]]) -> str:
    """One row per configuration, in run order (references, strategies by stage, variants, then mesh rows)."""
    head = ("| config | status | step ms | spread ms | place | tokens/s | peak mem/rank MiB | peak in use MiB | above start "
            "| step vs DDP | step vs FSDP2 | mem vs DDP | mem vs FSDP2 | model state/rank MiB | state vs theory "
            "| sent/step/rank MiB | sent vs theory | shard / replicate MiB | vs estimate | collectives/step |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        if r.get("median_step_s") is None:
            rows.append(f"| {r['name']} | {r['status']}: {r.get('error') or ''} |" + " |" * 18)
            continue
        q = r["ratios"]
        above = max(p - s for p, s in zip(r["peak_memory_mib"], r["start_memory_mib"]))
        rows.append(
            f"| {r['name']} | {r['status']} | {1000 * r['median_step_s']:.1f} | {_spread(r)} | {rank_text(r)} | {r['tokens_per_s']:,.0f} "
            f"| {max(r['peak_memory_mib']):.0f} | {_in_use(r)} | {above:.0f} | {_x(q['step_vs_ddp'])} | {_x(q['step_vs_fsdp2'])} "
            f"| {_x(q['memory_vs_ddp'])} | {_x(q['memory_vs_fsdp2'])} | {max(r['model_state_bytes']) / MiB:.2f} | {_x(q['state_vs_theory'])} "
            f"| {max(r['bytes_sent_per_step']) / MiB:.2f} | {_x(q['sent_vs_theory'])} | {_groups(r)} | {_vs_estimate(r)} | {_calls(r)} |")
    return "\n".join(rows)


COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "control", "object")


def _measured(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def comm_table(records: list[dict[str, Any]]) -> str:
    """The zero rows' collectives by kind on rank 0, per step (means over the steps after warm-up): calls, MiB sent
    beside ``zero_core.estimate``'s prediction, and the measured time, latency and bandwidths (``CommStats.table``'s
    columns). The references' collectives are counted, not timed, so they have no rows here."""
    head = ("| config | collective | calls | sent MiB | estimate MiB | ms | latency ms | algbw GB/s | busbw GB/s "
            "| blocked ms |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        timing = (r.get("comm_timing_per_step") or [None])[0]
        if not timing:
            continue
        predicted = (r.get("estimate") or {}).get("bytes_sent") or {}
        for kind in sorted(timing, key=lambda k: COMM_KINDS.index(k) if k in COMM_KINDS else len(COMM_KINDS)):
            v = timing[kind]
            estimate = "–" if kind not in predicted else f"{predicted[kind] / MiB:.3f}"
            rows.append(
                f"| {r['name']} | {kind} | {v['calls']:g} | {v['bytes_sent'] / MiB:.3f} | {estimate} "
                f"| {_measured(1000 * v['seconds'] if v['timed_calls'] else None, '.2f')} | {_measured(v['latency_ms'], '.3f')} "
                f"| {_measured(v['algbw_gbps'], '.3g')} | {_measured(v['busbw_gbps'], '.3g')} "
                f"| {_measured(1000 * v['blocked_seconds'] if v['timed_calls'] else None, '.2f')} |")
    return "\n".join(rows)


TERMINAL_WIDTH = 120
# The terminal's columns: what a row costs (step time, against the references) and what zero changes (model-state
# bytes and traffic per rank, against the ZeRO formulas). The rest is in the Markdown file and under --wide.
COMPACT_HEAD = ("config", "status", "step ms", "place", "x DDP", "x FSDP2", "peak MiB", "state MiB", "x theory", "sent MiB",
                "x theory", "estimate")
_RIGHT = {"step ms", "place", "x DDP", "x FSDP2", "peak MiB", "state MiB", "x theory", "sent MiB"}


def _compact_row(r: dict[str, Any]) -> list[str]:
    if r.get("median_step_s") is None:
        return [r["name"], r["status"], *("–" for _ in COMPACT_HEAD[2:])]
    q = r["ratios"]
    estimate = _vs_estimate(r).split(" (est.")[0]  # the estimate's figures are in the full table
    return [r["name"], r["status"], f"{1000 * r['median_step_s']:.1f}", rank_text(r), _x(q["step_vs_ddp"]), _x(q["step_vs_fsdp2"]),
            f"{max(r['peak_memory_mib']):.0f}", f"{max(r['model_state_bytes']) / MiB:.2f}", _x(q["state_vs_theory"]),
            f"{max(r['bytes_sent_per_step']) / MiB:.2f}", _x(q["sent_vs_theory"]), estimate]


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def compact_table(records: list[dict[str, Any]], width: int = TERMINAL_WIDTH) -> str:
    """The rows of :func:`table` in the 12 columns a terminal of ``width`` shows without wrapping: aligned plain
    text; a config name, status or estimate too long for the room left is cut with an ellipsis."""
    rows = [list(COMPACT_HEAD), *(_compact_row(r) for r in records)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COMPACT_HEAD))]
    gap = 2
    # Over the width: narrow the text columns (config, status, estimate), the widest first, down to their heading.
    cuttable = [0, 1, len(COMPACT_HEAD) - 1]
    while sum(widths) + gap * (len(widths) - 1) > width:
        widest = max(cuttable, key=lambda i: widths[i] - len(COMPACT_HEAD[i]))
        if widths[widest] <= len(COMPACT_HEAD[widest]):
            break  # nothing left to narrow: the numbers need this much
        widths[widest] -= 1
    lines = []
    for row in rows:
        cells = [_cut(cell, w).rjust(w) if COMPACT_HEAD[i] in _RIGHT else _cut(cell, w).ljust(w)
                 for i, (cell, w) in enumerate(zip(row, widths, strict=True))]
        lines.append((" " * gap).join(cells).rstrip())
    return "\n".join(lines)
