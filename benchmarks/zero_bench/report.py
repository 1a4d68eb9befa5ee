"""The loss-agreement check, the ratios and the Markdown table."""

from __future__ import annotations

import math
from typing import Any

MiB = 2**20


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def check_losses(records: list[dict[str, Any]], *, rtol: float, rtol_16: float) -> str | None:
    """Mark every record ``losses_agree``; return the reference row's name (DDP, else FSDP2; None: unchecked).

    Only plain PyTorch is a reference: a bug every zero row shared would pass against a zero row.
    A loss that is not finite never agrees.
    """
    ok = [r for r in records if r["status"] == "ok"]
    reference = next((r for name in ("ddp", "fsdp2") for r in ok if r["name"] == name), None)
    for r in records:
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
    return None if reference is None else reference["name"]


def add_ratios(records: list[dict[str, Any]]) -> None:
    """Step time and peak memory against DDP and FSDP2; measured state and traffic against theory."""
    by_name = {r["name"]: r for r in records if r.get("median_step_s") is not None}
    ddp, fsdp2 = by_name.get("ddp"), by_name.get("fsdp2")
    for r in records:
        if r.get("median_step_s") is None:
            r["ratios"] = {}
            continue
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


def table(records: list[dict[str, Any]]) -> str:
    """One row per configuration, in run order (references, strategies by stage, then variants)."""
    head = ("| config | status | step ms | tokens/s | peak mem/rank MiB | above start | step vs DDP | step vs FSDP2 | mem vs DDP | mem vs FSDP2 "
            "| model state/rank MiB | state vs theory | sent/step/rank MiB | sent vs theory | collectives/step |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        if r.get("median_step_s") is None:
            rows.append(f"| {r['name']} | {r['status']}: {r.get('error') or ''} |" + " |" * 13)
            continue
        q = r["ratios"]
        above = max(p - s for p, s in zip(r["peak_memory_mib"], r["start_memory_mib"]))
        rows.append(
            f"| {r['name']} | {r['status']} | {1000 * r['median_step_s']:.1f} | {r['tokens_per_s']:,.0f} "
            f"| {max(r['peak_memory_mib']):.0f} | {above:.0f} | {_x(q['step_vs_ddp'])} | {_x(q['step_vs_fsdp2'])} | {_x(q['memory_vs_ddp'])} "
            f"| {_x(q['memory_vs_fsdp2'])} | {max(r['model_state_bytes']) / MiB:.2f} | {_x(q['state_vs_theory'])} "
            f"| {max(r['bytes_sent_per_step']) / MiB:.2f} | {_x(q['sent_vs_theory'])} | {_calls(r)} |")
    return "\n".join(rows)
