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
    return [run_config(config, MODELS["tiny"].options(), steps=3, warmup=1) for config in configs]


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
