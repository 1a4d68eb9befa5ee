"""The bench's host-overhead section (``zero bench --host-overhead``): its command line, its rows at every world
size, and, end to end on one rank at a tiny size, that every row trains the plain reference's model and the table
reports each row's ratios and host microseconds per block from the measured steps."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from zero_core.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from zero_bench import host_overhead  # noqa: E402
from zero_bench import main as bench_main  # noqa: E402
from zero_bench.configs import MODELS  # noqa: E402
from zero_bench.report import check_losses  # noqa: E402
from zero_bench.worker import run_config, zero_config  # noqa: E402

LAYERS = 4
MODEL = dataclasses.replace(MODELS[host_overhead.MODEL], layers=LAYERS).options()


def test_the_option_selects_the_section_and_its_defaults():
    args = bench_main.parse_args(["--host-overhead"])
    assert (args.model, args.steps, args.warmup, args.world_sizes) == ("mlp-48", 50, 10, [1, 2])
    assert args.out == Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "host-overhead.json"
    assert bench_main.parse_args([]).warmup == 2  # the rest of the bench keeps its own
    with pytest.raises(SystemExit):
        bench_main.parse_args(["--host-overhead", "--quick"])
    with pytest.raises(SystemExit):
        bench_main.parse_args(["--host-overhead", "--world-sizes", "1,x"])


def test_every_world_size_gets_the_plain_reference_the_zero_rows_and_fsdp2():
    names = [(c.name, c.kind, c.world_size) for c in host_overhead.configs((1, 2))]
    assert names == [("plain-1rank", "plain", 1), ("chunk-s2-1rank", "zero", 1), ("chunk-s3-1rank", "zero", 1),
                     ("tensor-s3-1rank", "zero", 1), ("fsdp2-1rank", "fsdp2", 1),
                     ("ddp-2ranks", "ddp", 2), ("chunk-s2-2ranks", "zero", 2), ("chunk-s3-2ranks", "zero", 2),
                     ("tensor-s3-2ranks", "zero", 2), ("fsdp2-2ranks", "fsdp2", 2)]


def _rows(configs: list[dict]) -> tuple[list[dict | None], int]:
    import torch

    from zero_bench.configs import build_model
    from zero_core import shard

    torch.set_num_threads(host_overhead.THREADS)  # as the section's launches do
    records = [run_config(config, MODEL, steps=4, warmup=2) for config in configs]
    model = build_model(MODEL)
    net, _ = shard(model, torch.optim.AdamW(model.parameters()), config=zero_config(configs[2], MODEL))
    chunks = len(net.engine.chunks)
    net.close()
    return records, chunks


def test_the_section_runs_end_to_end_and_reports_host_time_per_block():
    configs = [c.as_dict() for c in host_overhead.configs((1,))]
    assert configs[2]["name"] == "chunk-s3-1rank"
    records, chunks = run_distributed(_rows, 1, configs, timeout=120)[0]
    assert chunks == 1 + LAYERS + 2  # chunk stage 3: the embedding's, one per block, the head's weight's and bias's
    records = [{"name": c["name"], "config": c, **r} for c, r in zip(configs, records)]  # as main() records a row
    reference = check_losses(records, rtol=1e-4, rtol_16=3e-2)
    assert reference == "plain-1rank"
    assert [r["status"] for r in records] == ["ok"] * 5 and all(r["losses_agree"] for r in records)
    rows = host_overhead.summary(records, units=LAYERS)
    plain, fsdp2 = records[0]["median_step_s"], records[-1]["median_step_s"]
    for row, record in zip(rows, records):
        step = record["median_step_s"]
        assert row["name"] == record["name"] and row["step_s"] == step and row["reference"] == "plain-1rank"
        assert row["step_vs_plain"] == pytest.approx(step / plain) and row["step_vs_fsdp2"] == pytest.approx(step / fsdp2)
        expected = None if record["config"]["kind"] == "plain" else pytest.approx(1e6 * (step - plain) / LAYERS)
        assert row["host_us_per_unit"] == expected
        cpu = record["median_cpu_step_s"]  # rank 0's process CPU time: some, and its ratios beside the wall time's
        assert 0 < cpu and row["cpu_s"] == cpu
        assert row["cpu_vs_plain"] == pytest.approx(cpu / records[0]["median_cpu_step_s"])
        assert row["cpu_vs_fsdp2"] == pytest.approx(cpu / records[-1]["median_cpu_step_s"])
    lines = host_overhead.host_table(rows).splitlines()
    assert len(lines) == 2 + 5 and lines[2].startswith("| plain-1rank | 1 | ok |") and lines[2].endswith(" | – |")
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    assert cells[:3] == ["chunk-s2-1rank", "1", "ok"] and cells[9] == f"{rows[1]['host_us_per_unit']:.0f}"
    assert cells[6:9] == [f"{1000 * rows[1]['cpu_s']:.1f}", f"{rows[1]['cpu_vs_plain']:.2f}x", f"{rows[1]['cpu_vs_fsdp2']:.2f}x"]
    verdicts = [line.rsplit(": ", 1) for line in host_overhead.targets(rows)]
    assert [target for target, _ in verdicts] == [
        "chunk-s2 at 1 rank: step at most 1.3x plain PyTorch's", "chunk-s2 at 1 rank: step at most 0.3x FSDP2's",
        "chunk-s3 at 1 rank: step at most 1.5x plain PyTorch's", "chunk-s3 at 1 rank: step at most 0.3x FSDP2's"]
    for (_, verdict), (row, against) in zip(verdicts, [(rows[1], "plain"), (rows[1], "fsdp2"), (rows[2], "plain"),
                                                       (rows[2], "fsdp2")]):
        ratio, wall = row[f"cpu_vs_{against}"], row[f"step_vs_{against}"]  # judged on CPU time, wall time beside
        limit = host_overhead.TARGETS[row["name"].removesuffix("-1rank")][against]
        assert verdict == f"{ratio:.2f}x in CPU time ({wall:.2f}x in wall time), {'met' if ratio <= limit else 'not met'}"



def test_interleaved_host_cpu_script_prints_each_rows_cpu_time_and_python_calls():
    """``python -m zero_bench.host_cpu STEPS``: plain, stage 3 and stage 2 steps interleaved; each row's median CPU
    time against plain and the Python calls of one step (zero's rows make more calls than plain PyTorch's)."""
    import os
    import re
    import subprocess

    # its own interpreter, as users run it: call counts are of this script alone, whatever an earlier test of this
    # worker left imported or installed (a run in-process once counted 1.8 million calls for plain's step)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "zero_bench.host_cpu", "2"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    ratios = dict(re.findall(r"^(plain|s3|s2) +cpu/step +[\d.]+ ms +([\d.]+)x plain$", out, re.M))
    assert ratios.keys() == {"plain", "s3", "s2"} and ratios["plain"] == "1.00", out
    calls = {name: int(n) for name, n in re.findall(r"^(plain|s3|s2) +python calls/step (\d+)$", out, re.M)}
    assert calls.keys() == {"plain", "s3", "s2"} and calls["s3"] > calls["plain"] and calls["s2"] > calls["plain"], out
    phases = {name: dict(re.findall(r"(zero_grad|forward|backward|step) (\d+)", line)) for name, line in
              re.findall(r"^(plain|s3|s2) +python calls by phase (.*)$", out, re.M)}
    assert phases.keys() == calls.keys() and all(len(p) == 4 for p in phases.values()), out
    # plain PyTorch's backward runs no Python; zero's runs its gradient hooks
    assert int(phases["plain"]["backward"]) < int(phases["s3"]["backward"]), out


def test_grad_groups_trains_the_plain_model_hearing_of_gradients_once_per_group_and_backward():
    """``python -m zero_bench.grad_groups``: zero's signal (a hook per parameter, counted per group; alone and with
    zero's gradient buffers) and both per-group designs (parameters as views of one flat leaf per group; the model's
    own parameters with a signal on each group's inputs) train as plain PyTorch does and hear of gradients once per
    group and backward (mlp-48: the embedding, 48 blocks and the head; the embedding reads token
    ids, so the inputs design has no signal there)."""
    from zero_bench import grad_groups

    result = grad_groups.run(3, warmup=1)
    assert result["groups"] == {"plain": 0, "hooks": 50, "buffers": 50, "views": 50, "inputs": 50}, result
    assert result["signals"] == {"plain": 0, "hooks": 3 * 50, "buffers": 3 * 50, "views": 3 * 50,
                                 "inputs": 3 * 49}, result
    plain = result["losses"]["plain"]
    for kind in ("hooks", "buffers", "views", "inputs"):
        assert result["losses"][kind] == pytest.approx(plain, rel=1e-5), (kind, result["losses"])
    assert plain[0] > plain[-1] and all(s > 0 for s in result["seconds"].values()), result
