"""The bench's measured collectives: each zero row carries its timed counters, and the per-kind table shows them.

The worker's ``comm_timing_per_step`` must agree with the exact counters of the same row (calls and bytes
of the steps after warm-up are identical in every step), and the report's table must show them beside
``zero_core.estimate``'s bytes. The references are counted, not timed, so they have no timing.
"""

from __future__ import annotations

import sys
from pathlib import Path

from zero_core.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from zero_bench.configs import MODELS, BenchConfig  # noqa: E402
from zero_bench.report import MiB, comm_table  # noqa: E402
from zero_bench.worker import run_config  # noqa: E402


def _rows(configs: list[dict]) -> list[dict | None]:
    # two warm-up steps: from the third on, stage 3 replays its gather sequences, so every timed step has the
    # same collectives (see [Note: replaying a repeated gather sequence])
    return [run_config(config, MODELS["tiny"].options(), steps=4, warmup=2) for config in configs]


def test_zero_rows_carry_timed_collectives_and_the_table_shows_them():
    configs = [BenchConfig(name="ddp", kind="ddp").as_dict(),
               BenchConfig(name="chunk-s3", kind="zero", strategy="chunk", stage=3).as_dict()]
    ddp, zero = ({"name": config["name"], "config": config, **record}  # as the bench's main() records a row
                 for config, record in zip(configs, run_distributed(_rows, 2, configs, timeout=300)[0]))
    assert ddp["status"] == zero["status"] == "ok"
    assert ddp["comm_timing_per_step"] is None
    timings = zero["comm_timing_per_step"]
    assert len(timings) == 2  # one per rank
    for timing in timings:
        assert set(timing) == set(zero["collectives_per_step"])
        for kind, counted in zero["collectives_per_step"].items():
            measured = timing[kind]
            assert (measured["calls"], measured["bytes_sent"]) == (counted["calls"], counted["bytes_sent"]), kind
            assert measured["timed_calls"] == measured["calls"] and measured["seconds"] > 0, kind
    lines = comm_table([ddp, zero]).splitlines()
    assert len(lines) == 2 + len(timings[0])  # header, rule, one line per kind of the zero row
    by_kind = {cells[1]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    for kind, cells in by_kind.items():
        assert cells[0] == "chunk-s3"
        assert float(cells[2]) == timings[0][kind]["calls"]
        assert cells[3] == f"{timings[0][kind]['bytes_sent'] / MiB:.3f}"
        predicted = zero["estimate"]["bytes_sent"].get(kind)
        assert cells[4] == ("–" if predicted is None else f"{predicted / MiB:.3f}")
    assert by_kind["all_gather"][4] == by_kind["all_gather"][3]  # the estimate is exact


def test_rows_carry_a_memory_timeline_that_adds_up(tmp_path):
    """Both rows sample one step after the timed ones: RSS, the allocator's in-use bytes and the system's own
    accounting by kind. Zero's kinds at the last sample are exactly its model states and idle buffers; the
    breakdown at the peak adds up to the RSS there; the table and the plot show them."""
    from zero_bench.plot import plot_memory
    from zero_bench.report import add_ratios, peak_table, table

    configs = [BenchConfig(name="ddp", kind="ddp").as_dict(),
               BenchConfig(name="chunk-s2", kind="zero", strategy="chunk", stage=2).as_dict()]
    ddp, zero = ({"name": config["name"], "config": config, **record}
                 for config, record in zip(configs, run_distributed(_rows, 2, configs, timeout=300)[0]))
    for row in (ddp, zero):
        assert row["status"] == "ok"
        for tl, at in zip(row["memory_timeline"], row["memory_at_peak"]):
            n = len(tl["t_s"])
            assert n >= 3 and len(tl["rss_mib"]) == len(tl["in_use_mib"]) == n
            assert [p for _, p in tl["phases"]] == ["zero_grad", "forward", "backward", "step", "end"]
            assert all(len(v) == n for v in tl["by_kind_mib"].values())
            parts = at["baseline"] + at["states"] + at["buffers"] + at["other"] + at["slack"]
            assert abs(parts - at["rss"]) < 1e-6 * at["rss"]
        assert all(p is not None and p > 0 for p in row["peak_in_use_mib"])
    kinds = zero["memory_timeline"][0]["by_kind_mib"]
    assert set(kinds) == {"params", "grads", "optimizer_states", "gathered", "gradient_buffers", "pool", "kept_copies"}
    state = zero["model_state_by_kind"][0]  # taken after the timed steps; the sampled step ends in the same state
    for kind in ("params", "grads", "optimizer_states"):
        assert kinds[kind][-1] == round(state[kind] / MiB, 2), kind
    assert kinds["gradient_buffers"][-1] == 0  # nothing is lent between steps
    assert kinds["pool"][-1] == 0  # and nothing idle is kept: see [Note: no idle buffers between steps]
    assert max(kinds["pool"]) > 0  # the backward and the step's all-gathers did reuse pooled buffers
    assert set(ddp["memory_timeline"][0]["by_kind_mib"]) == {"params", "grads", "optimizer_states"}
    add_ratios([ddp, zero])
    assert f"| {max(zero['peak_in_use_mib']):.0f} |" in table([ddp, zero]).splitlines()[3]
    lines = peak_table([ddp, zero]).splitlines()
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["ddp", "chunk-s2"]
    assert plot_memory([ddp, zero], tmp_path / "memory.png", title="tiny") and (tmp_path / "memory.png").stat().st_size > 10_000
