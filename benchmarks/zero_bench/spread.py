"""Repeats of one row, their spread, and the order of the rows where the spread allows one.

A row's step time moved 20-30% between two runs of the same bench on a shared machine, so one launch
per row cannot rank rows. ``--repeat N`` launches every row N times, interleaved (all rows once, then
all again), so drift of the machine lands on every row alike. :func:`merge_repeats` folds a row's
launches into one record: the median over every timed step of every launch, and a spread that spans
the steps' interquartile range widened to take in each launch's own median (a launch that ran slow
throughout shows as a wider bar, not as a hidden outlier). :func:`add_ranks` then gives each row, among
the rows on the same ranks, the range of places its spread allows: ``2`` when its bar overlaps no
other, ``2-4`` when it overlaps the bars of the rows that could be third and fourth.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["add_ranks", "merge_repeats", "rank_text", "spread_s"]


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def merge_repeats(launches: list[dict[str, Any]], *, warmup: int) -> dict[str, Any]:
    """One record from the launches of one row (the first launch's record, with the pooled timing).

    A row fails when any launch failed (the failing launch's record, saying which repeat): a row that
    fails one time in three is not a row to rank. The deterministic fields (losses, model-state bytes,
    bytes sent, collective calls) are the first launch's; ``losses_repeat_identical`` says whether every
    launch trained the same losses.
    """
    if not launches:
        raise ValueError("merge_repeats needs at least one launch of the row")
    for i, launch in enumerate(launches):
        if launch.get("median_step_s") is None:
            failed = dict(launch)
            if len(launches) > 1:
                failed["error"] = f"repeat {i + 1} of {len(launches)}: {failed.get('error') or failed['status']}"
            return failed
    record = dict(launches[0])
    steady = [t for launch in launches for t in (launch["step_times_s"][warmup:] or launch["step_times_s"])]
    medians = [launch["median_step_s"] for launch in launches]
    median = statistics.median(steady)
    q1, q3 = _quartiles(steady)
    record["repeats"] = [{"median_step_s": launch["median_step_s"], "step_times_s": launch["step_times_s"],
                          "peak_memory_mib": launch["peak_memory_mib"]} for launch in launches]
    record["median_step_s"] = median
    cpu: list[float] = []
    for launch in launches:
        cpu_times = launch.get("cpu_times_s") or []
        cpu += cpu_times[warmup:] or cpu_times
    if cpu:  # rank 0's process CPU time per step (records of older benches have none)
        record["median_cpu_step_s"] = statistics.median(cpu)
    record["step_spread_s"] = [min(q1, *medians), max(q3, *medians)]
    record["tokens_per_s"] = launches[0]["tokens_per_s"] * launches[0]["median_step_s"] / median
    record["losses_repeat_identical"] = all(launch.get("losses") == launches[0].get("losses") for launch in launches)
    return record


def spread_s(r: dict[str, Any]) -> tuple[float, float]:
    """A record's step-time spread (low, high) in seconds: the median alone for a record of one step."""
    low, high = r.get("step_spread_s") or (r["median_step_s"], r["median_step_s"])
    return low, high


def add_ranks(records: list[dict[str, Any]]) -> None:
    """Set ``rank`` = [best, worst] on every timed record: the places (1 = fastest) its spread allows among the
    timed records on the same number of ranks. Best counts the rows whose whole spread is faster; worst, the
    rows whose spread reaches at or below this row's slowest."""
    timed = [r for r in records if r.get("median_step_s") is not None]
    for r in records:
        r.pop("rank", None)
    for r in timed:
        low, high = spread_s(r)
        peers = [p for p in timed if p["world_size"] == r["world_size"] and p is not r]
        best = 1 + sum(spread_s(p)[1] < low for p in peers)
        worst = 1 + sum(spread_s(p)[0] <= high for p in peers)
        r["rank"] = [best, worst]


def rank_text(r: dict[str, Any]) -> str:
    """``3``, or ``2-4`` where the spread overlaps other rows'; ``–`` for a row without a time."""
    rank = r.get("rank")
    if not rank:
        return "–"
    best, worst = rank
    return str(best) if best == worst else f"{best}-{worst}"
