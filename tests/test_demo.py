"""The demo script runs under torchrun on 2 CPU ranks and prints its summary (tiny model, 3 steps)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("stage", "precision"), [(3, "fp32"), (2, "fp16")])
def test_demo_trains_and_summarises(tmp_path, stage, precision):
    out = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_gpt.py"), "--steps", "3", "--vocab", "257", "--d-model", "32",
           "--layers", "2", "--heads", "2", "--seq-len", "16", "--log-every", "1", "--no-progress", "--json", str(out),
           "--stage", str(stage), "--precision", precision]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = [line for line in proc.stdout.splitlines() if line.startswith("summary:")]
    assert len(summary) == 1 and f"mode=zero stage={stage} precision={precision} ranks=2" in summary[0]
    assert "tokens/s=" in summary[0] and re.search(r"time=\d+:\d\d$", summary[0]), summary
    # progress on plain lines (--no-progress), rank 0's alone: steps/s, elapsed and an ETA, 0:00 at the end
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [int(line.split()[1]) for line in steps] == [0, 1, 2], proc.stdout
    assert all(re.search(r" \d+\.\d\d steps/s .* elapsed \d+:\d\d  ETA (\d+:\d\d|\?)$", line) for line in steps), steps
    assert steps[-1].endswith("ETA 0:00"), steps
    result = json.loads(out.read_text())
    assert result["steps"] == 3 and result["world_size"] == 2
    assert len(result["peak_rss_mib"]) == 2
    assert result["comm_last_step"]["all_gather"]["calls"] > 0
    assert result["stage"] == stage and result["precision"] == precision


def _demo(tmp_path, name, *extra, nproc=2):
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "examples" / "train_gpt.py"), "--vocab", "257", "--d-model", "32", "--layers", "2", "--heads", "2",
           "--seq-len", "16", "--log-every", "1", "--no-progress", "--json", str(out), "--lazy", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_demo_resumes_from_a_checkpoint_on_another_world_size(tmp_path):
    """torchrun end to end: lazily built, 2 steps and a checkpoint on 2 ranks, then 2 more on 1 rank."""
    straight, _ = _demo(tmp_path, "straight", "--steps", "4", "--batch-size", "2")
    first, _ = _demo(tmp_path, "first", "--steps", "2", "--batch-size", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
                     "--save-full", str(tmp_path / "model.safetensors"))
    resumed, stdout = _demo(tmp_path, "resumed", "--steps", "4", "--batch-size", "4", "--resume", str(tmp_path / "ckpt"),
                            nproc=1)
    assert "resumed from" in stdout and "at step 2" in stdout
    assert first["losses"] == straight["losses"][:2]
    # the same global batch on one rank: the sums run in another order, so equal to float precision only
    for got, want in zip(resumed["losses"], straight["losses"][2:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    assert (tmp_path / "model.safetensors").stat().st_size > 0
