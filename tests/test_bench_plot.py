"""The bench a user reads at a glance: ``--repeat`` launches, each row's spread and place, and a plot whose memory
axis is the model state zero changes, one panel per world size, with a legend and an axis that covers every bar.

One real run at the quick size (two rows, two launches each) is rendered and the figure inspected; the ranking
rule is checked on rows whose spreads are chosen to overlap or not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from zero_bench import main as bench_main  # noqa: E402
from zero_bench.spread import add_ranks, merge_repeats, rank_text  # noqa: E402

MiB = 2**20


def _row(name: str, low: float, median: float, high: float, world: int = 2) -> dict:
    return {"name": name, "world_size": world, "median_step_s": median, "step_spread_s": [low, high]}


def test_places_are_a_range_exactly_where_spreads_overlap():
    rows = [_row("a", 1.0, 1.1, 1.2), _row("b", 1.15, 1.3, 1.4), _row("c", 2.0, 2.1, 2.2), _row("d", 0.1, 0.2, 0.3, world=1),
            {"name": "failed", "world_size": 2, "median_step_s": None}]
    add_ranks(rows)
    # a and b overlap (1.15 <= 1.2): either may be first; c is third whatever happens; d is alone on its ranks
    assert [rank_text(r) for r in rows] == ["1-2", "1-2", "3", "1", "–"]


def test_merged_repeats_pool_the_timed_steps_and_a_failed_launch_fails_the_row():
    one = {"name": "r", "status": "ok", "median_step_s": 2.0, "step_times_s": [9.0, 1.0, 2.0, 3.0], "tokens_per_s": 100.0,
           "peak_memory_mib": [10.0], "losses": [1.0]}
    two = {**one, "median_step_s": 5.0, "step_times_s": [9.0, 4.0, 5.0, 6.0]}
    merged = merge_repeats([one, two], warmup=1)
    assert merged["median_step_s"] == 3.5  # the median of 1..6: the warm-up steps (9.0) left out
    assert merged["step_spread_s"] == [2.0, 5.0]  # quartiles 2.25 and 4.75, widened to each launch's median
    assert merged["tokens_per_s"] == pytest.approx(100.0 * 2.0 / 3.5) and merged["losses_repeat_identical"]
    assert [r["median_step_s"] for r in merged["repeats"]] == [2.0, 5.0]
    assert "median_cpu_step_s" not in merged  # launches that measured no CPU time (a bench before it did)
    cpu = merge_repeats([{**one, "cpu_times_s": [8.0, 1.0, 1.0, 2.0]}, {**two, "cpu_times_s": [8.0, 3.0, 4.0, 4.0]}], warmup=1)
    assert cpu["median_cpu_step_s"] == 2.5  # pooled as the wall times are: the median of 1, 1, 2, 3, 4, 4
    failed = merge_repeats([one, {**two, "median_step_s": None, "status": "failed", "error": "rank 1 exited"}], warmup=1)
    assert failed["status"] == "failed" and failed["error"] == "repeat 2 of 2: rank 1 exited"


def test_a_quick_run_with_repeats_plots_model_state_against_step_time(tmp_path, capsys):
    from zero_bench.plot import figure

    status = bench_main.main(["--quick", "--strategies", "chunk", "--stages", "3", "--policies", "device", "--comms", "torch",
                              "--references", "ddp", "--meshes", "", "--repeat", "2", "--steps", "3", "--warmup", "1",
                              "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "(repeat 2/2)" in out and "of 2 launches each, interleaved" in out
    assert out.splitlines()[[i for i, line in enumerate(out.splitlines()) if line.startswith("config ")][0]].split()[:4] == \
        ["config", "status", "step", "ms"] and " place " in out
    result = json.loads((tmp_path / "latest.json").read_text())
    assert result["repeat"] == 2
    records = result["records"]
    assert [r["name"] for r in records] == ["ddp", "chunk-s3"]
    for r in records:
        assert len(r["repeats"]) == 2 and r["losses_repeat_identical"], r["name"]
        low, high = r["step_spread_s"]
        assert low <= r["median_step_s"] <= high and all(low <= x["median_step_s"] <= high for x in r["repeats"])
        assert r["rank"][0] <= r["rank"][1]
    assert (tmp_path / "latest.png").stat().st_size > 10_000 and (tmp_path / "latest-memory.png").stat().st_size > 10_000

    fig = figure(records, title="quick")
    (ax,) = fig.axes  # one world size: one panel
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == [f"{i}  {r['name']}  (place {rank_text(r)})" for i, r in enumerate(records, 1)]
    assert "model-state MiB per rank" in ax.get_xlabel() and ax.get_title().startswith("2 ranks")
    bottom, top = ax.get_ylim()
    assert bottom == 0 and top >= max(1000 * r["step_spread_s"][1] for r in records)
    left, right = ax.get_xlim()
    states = [max(r["model_state_bytes"]) / MiB for r in records]
    assert left == 0 and right > max(states)
    assert states[1] < 0.6 * states[0]  # stage 3 holds about half of DDP's state at 2 ranks: the axis shows it
    # a row at another world size gets a panel of its own
    assert len(figure([*records, {**records[1], "world_size": 4}], title="two").axes) == 2
