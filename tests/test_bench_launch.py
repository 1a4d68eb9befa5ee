"""The bench's launcher and command line: a failed row names its ranks, how each ended and their last lines;
``--out`` takes a folder; the bench runs without matplotlib and rich; ``zero bench`` is the command zero-bench
registers with the ``zero`` CLI."""

from __future__ import annotations

import os
import signal
import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from zero_bench import command as bench_command  # noqa: E402
from zero_bench import main as bench_main  # noqa: E402
from zero_bench.configs import MODELS, BenchConfig  # noqa: E402
from zero_bench.launch import explain, launch, sigterm_raises  # noqa: E402
from zero_bench.plot import plot, plot_memory  # noqa: E402
from zero_core.cli._cli import COMMAND_GROUP  # noqa: E402
from zero_core.cli._cli import main as zero_main  # noqa: E402

# torchrun's summary when rank 1 aborted and torchrun then stopped rank 0 (the shape of the old flaky reference rows)
ABORT_SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
zero_bench.worker FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-25_02:50:36
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 30604)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 30604
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_02:50:36
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 30605)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 30605
=======================================================
"""


def _rank_logs(log_dir: Path, stderr: dict[int, str]) -> None:
    for rank, text in stderr.items():  # torchrun --log-dir --redirects 3 writes RUN/attempt_0/LOCAL_RANK/std{out,err}.log
        folder = log_dir / "run_abc" / "attempt_0" / str(rank)
        folder.mkdir(parents=True)
        (folder / "stderr.log").write_text(text)
        (folder / "stdout.log").write_text("")


def test_an_aborted_rank_is_named_first_with_its_signal_and_last_lines(tmp_path):
    _rank_logs(tmp_path, {0: "training\n", 1: "training\nterminate called without an active exception\n"})
    failure = explain(ABORT_SUMMARY, tmp_path, 1)
    assert failure["error"] == "rank 1 killed by SIGABRT: terminate called without an active exception"
    first, second = failure["log_tail"].split("\n  rank 0")
    assert first.startswith("  rank 1 (killed by SIGABRT), its last lines:") and "terminate called" in first
    assert second.startswith(" (killed by SIGTERM), its last lines:") and "training" in second


def test_a_rank_that_raised_is_named_with_its_exception(tmp_path):
    spec = {"model": MODELS["tiny"].options(), "steps": 2, "warmup": 1, "timeout_s": 60}
    record = launch(BenchConfig(name="bogus", kind="bogus"), spec, 2, 120.0, tmp_path,
                    pythonpath=Path(bench_main.__file__).resolve().parents[1])
    assert record["status"] == "failed"
    assert record["error"].startswith("rank ") and record["error"].endswith("ValueError: unknown configuration kind 'bogus'")
    assert "its last lines:" in record["log_tail"] and "raise ValueError" in record["log_tail"]


def test_out_is_a_folder_or_a_json_file(tmp_path):
    assert bench_main.parse_args(["--out", str(tmp_path)]).out == tmp_path / "latest.json"
    assert bench_main.parse_args(["--out", str(tmp_path / "run.json")]).out == tmp_path / "run.json"
    # this checkout's results folder, where the default points when the bench runs from a checkout
    assert bench_main.parse_args([]).out == Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "latest.json"


def test_no_matplotlib_means_no_plot_and_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert plot([], tmp_path / "latest.png", title="t") is False
    assert "matplotlib is not installed" in capsys.readouterr().out and not (tmp_path / "latest.png").exists()
    assert plot_memory([], tmp_path / "latest-memory.png", title="t") is False
    assert "no memory plot written" in capsys.readouterr().out and not (tmp_path / "latest-memory.png").exists()


def test_no_rich_means_plain_progress_lines(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich.progress", None)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # where the bar would be drawn
    progress = bench_main.Progress(1, plain=False)
    progress.start("ddp")
    progress.finish("ddp", {"status": "ok", "median_step_s": 0.05})
    progress.close()
    assert progress.bar is None and "[1/1] ddp ... 50.0 ms/step" in capsys.readouterr().out


@pytest.mark.parametrize("code, ending", [(1, "exit code 1"), (-6, "killed by SIGABRT"), (-9, "killed by SIGKILL")])
def test_torchrun_failing_on_its_own_is_reported(tmp_path, code, ending):
    failure = explain("torchrun: error: something\n", tmp_path, code)
    assert failure == {"error": f"torchrun {ending}", "log_tail": "torchrun: error: something"}


def test_sigterm_raises_inside_only_so_the_ranks_get_stopped():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped, sigterm_raises():
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs as soon as os.kill returns
    assert stopped.value.code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) is before


def test_every_model_preset_builds_its_architecture():
    import torch

    from zero_bench.configs import build_model
    from zero_bench.mlp import ThinMLP
    from zero_core.testing.gpt import GPT
    from zero_core.testing.llama import Llama

    for name, size in MODELS.items():
        with torch.device("meta"):
            model = build_model(size.options())
        assert isinstance(model, ThinMLP if size.block == "mlp" else Llama if size.ffn else GPT), name
        assert len(model.blocks) == size.layers, name
    with torch.device("meta"):
        moe = build_model(MODELS["moe-small"].options())
    # the fused experts, as transformers 5 stores Mixtral's: [experts, 2 * ffn, d_model] and [experts, d_model, ffn]
    assert moe.blocks[0].mlp.gate_up_proj.shape == (8, 1024, 256) and moe.blocks[0].mlp.down_proj.shape == (8, 256, 512)
    assert moe.blocks[0].self_attn.k_proj.weight.shape == (2 * 32, 256)  # grouped-query: 2 key/value heads of 32


def _install_bench_entry_points(monkeypatch, tmp_path) -> dict[str, dict[str, str]]:
    """zero-bench's entry points exactly as benchmarks/pyproject.toml declares them, as if it were installed."""
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "pyproject.toml").read_text())["project"]
    groups = {"console_scripts": project["scripts"], **project["entry-points"]}
    info = tmp_path / "zero_bench-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zero-bench\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items())
                                                   for group, points in groups.items()))
    monkeypatch.syspath_prepend(str(tmp_path))
    return groups


def test_zero_bench_is_the_command_zero_bench_registers(tmp_path, monkeypatch, capsys):
    groups = _install_bench_entry_points(monkeypatch, tmp_path)
    assert groups[COMMAND_GROUP] == {"bench": "zero_bench.command:bench"}
    assert groups["console_scripts"] == {"zero-bench": "zero_bench.command:main"}
    assert zero_main(["--help"]) == 0
    top = " ".join(capsys.readouterr().out.split())  # argparse wraps the help lines
    assert "bench run the benchmark of every strategy and policy against DDP and FSDP2" in top and "(from zero-bench)" in top
    assert zero_main(["bench", "--help"]) == 0  # the bench's own options, passed through
    out = capsys.readouterr().out
    assert "usage: zero bench" in out and "--quick" in out and "--compare" in out
    assert zero_main(["bench", "--no-such-option"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --no-such-option" in err and err.count("error:") == 1


def test_the_console_script_is_the_same_command(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_command.main(["--help"])
    assert exc.value.code == 0 and "usage: zero-bench" in capsys.readouterr().out


def test_the_terminal_table_fits_120_columns_and_wide_prints_every_column(tmp_path, monkeypatch, capsys):
    """A saved CPU run's rows plus a failed row with a long name and error: the default output's table fits a
    120-column terminal and points at the Markdown file; --wide prints the full 20-column table there too."""
    import json

    saved = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "cpu-2026-12-02-host-overhead" / "run1.json"
    result = json.loads(saved.read_text())
    for key in ("host_overhead", "world_sizes"):  # the plain bench's result: no host-overhead section
        result.pop(key)
    long_name = "chunk-s3-2ranks-gemini-bucketed-fp16-reshard-after-forward"
    result["records"].append({**result["records"][-1], "name": long_name, "status": "failed",
                              "error": "rank 1 exited with SIGABRT " * 5, "median_step_s": None})
    monkeypatch.setattr(bench_main, "run", lambda args: result)
    monkeypatch.setattr(bench_main, "plot", lambda *a, **k: False)
    monkeypatch.setattr(bench_main, "plot_memory", lambda *a, **k: False)

    bench_main.main(["--out", str(tmp_path)])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("config ", *(r["name"][:10] for r in result["records"])))]
    assert len(rows) == len(result["records"]) + 1, out  # the heading and every row, a failed one included
    assert max(map(len, rows)) <= 120, "\n".join(line for line in rows if len(line) > 120)
    assert any(line.startswith("chunk-s3-2ranks-g") and "…" in line and "failed" in line for line in rows), rows
    assert f"All 20 columns, the collectives by kind and where the peak goes: {tmp_path / 'latest.md'} (or --wide)" in out
    assert "| step vs DDP |" not in out and "| step vs DDP |" in (tmp_path / "latest.md").read_text()

    bench_main.main(["--out", str(tmp_path), "--wide"])
    wide = capsys.readouterr().out
    assert "| config | status | step ms | spread ms | place | tokens/s |" in wide and "| collectives/step |" in wide and "(or --wide)" not in wide
