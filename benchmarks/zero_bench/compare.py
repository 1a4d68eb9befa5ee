"""Compare a bench run with a saved baseline and flag regressions.

Timing and peak memory are noisy, so they regress past ``threshold`` (a fraction: 0.10 is 10%
slower or larger). Model-state bytes, bytes sent and collective calls are deterministic, so any
increase is a regression. A configuration that ran in the baseline but fails or trains a
different model now is a regression too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"no bench results at {path}; run `nox -s bench` first, or pass the path of a saved run") from None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{path} is not a bench results file (JSON error: {exc})") from None
    if not isinstance(data, dict) or "records" not in data:
        raise SystemExit(f"{path} is not a bench results file (no 'records'); it must be a benchmarks/results/*.json")
    return data


def comparable(baseline: dict[str, Any], latest: dict[str, Any]) -> None:
    """Refuse to compare runs of another model, world size, step count, backend or torch."""
    keys = [("model", lambda d: d["model"]), ("world size", lambda d: d["world_size"]), ("steps", lambda d: d["steps"]),
            ("backend", lambda d: d["machine"]["backend"]), ("torch", lambda d: d["machine"]["torch"])]
    for what, get in keys:
        if get(baseline) != get(latest):
            raise SystemExit(f"the baseline ran with another {what} ({get(baseline)} vs {get(latest)} now); "
                             "rerun the bench with the baseline's options, or save a new baseline with --save-baseline")


def compare(baseline: dict[str, Any], latest: dict[str, Any], *, threshold: float) -> tuple[str, list[str]]:
    """A Markdown table of latest/baseline per configuration, and the regressions found."""
    comparable(baseline, latest)
    base = {r["name"]: r for r in baseline["records"]}
    rows = ["| config | step time | peak memory | model state | bytes sent | verdict |", "|---|---|---|---|---|---|"]
    regressions: list[str] = []
    for r in latest["records"]:
        b = base.get(r["name"])
        if b is None or b.get("median_step_s") is None:
            rows.append(f"| {r['name']} | new | | | | – |")
            continue
        if r.get("median_step_s") is None or r["status"] != "ok":
            regressions.append(f"{r['name']}: {r['status']} (ran in the baseline)")
            rows.append(f"| {r['name']} | | | | | REGRESSION: {r['status']} |")
            continue
        found = []
        step = r["median_step_s"] / b["median_step_s"]
        mem = max(r["peak_memory_mib"]) / max(b["peak_memory_mib"])
        state = max(r["model_state_bytes"]) / max(max(b["model_state_bytes"]), 1)
        sent = max(r["bytes_sent_per_step"]) / max(max(b["bytes_sent_per_step"]), 1)
        if step > 1 + threshold:
            found.append(f"step time {step:.2f}x")
        if mem > 1 + threshold:
            found.append(f"peak memory {mem:.2f}x")
        if max(r["model_state_bytes"]) > max(b["model_state_bytes"]):
            found.append(f"model state {state:.3f}x")
        if max(r["bytes_sent_per_step"]) > max(b["bytes_sent_per_step"]):
            found.append(f"bytes sent {sent:.3f}x")
        for kind, calls in (r.get("collective_calls_per_step") or {}).items():
            before = (b.get("collective_calls_per_step") or {}).get(kind, 0)
            if kind != "control" and calls > before:
                found.append(f"{kind} calls {before} -> {calls}")
        regressions += [f"{r['name']}: {f}" for f in found]
        rows.append(f"| {r['name']} | {step:.2f}x | {mem:.2f}x | {state:.3f}x | {sent:.3f}x | "
                    f"{'REGRESSION: ' + ', '.join(found) if found else 'ok'} |")
    for name in sorted(base.keys() - {r["name"] for r in latest["records"]}):
        if base[name].get("median_step_s") is not None:  # it ran before: a plugin that stopped loading is a regression
            regressions.append(f"{name}: ran in the baseline, missing now")
        rows.append(f"| {name} | not run | | | | {'REGRESSION: missing' if base[name].get('median_step_s') else '–'} |")
    return "\n".join(rows), regressions
