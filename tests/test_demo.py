"""The demo script runs under torchrun on 2 CPU ranks and prints its summary (tiny model, 3 steps)."""

import json
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
    assert "tokens/s=" in summary[0]
    result = json.loads(out.read_text())
    assert result["steps"] == 3 and result["world_size"] == 2
    assert len(result["peak_rss_mib"]) == 2
    assert result["comm_last_step"]["all_gather"]["calls"] > 0
    assert result["stage"] == stage and result["precision"] == precision
