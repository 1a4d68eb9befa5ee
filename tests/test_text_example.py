"""examples/text_lm under torchrun on 2 CPU ranks, tiny: it learns, resumes exactly, and exports loadable weights."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "text_lm"
TINY = ["--steps", "4", "--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--batch-size", "4",
        "--accum", "2", "--lr", "1e-2", "--warmup", "1", "--eval-every", "2", "--eval-seqs", "8", "--log-every", "1",
        "--checkpoint-every", "100", "--train-mb", "0.25", "--sample-bytes", "16"]


def _train(out: Path, name: str, *extra: str, default_out: bool = False) -> tuple[dict, str]:
    figures = out.parent / f"{name}.json"
    # default_out: the example's own default (the system's temporary folder, pointed at `out`'s parent here)
    where = [] if default_out else ["--out", str(out)]
    env = {**os.environ, "TMPDIR": str(out.parent)} if default_out else None
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLE / "train.py"), *TINY, *where, "--json", str(figures), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(figures.read_text()), proc.stdout


def _untracked() -> str:
    """What `git status` shows of the checkout (untracked and changed files; ignored ones are not shown)."""
    done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 0, f"the tests run from a git checkout: {done.stderr}"
    return done.stdout


def test_text_example_learns_resumes_exactly_and_exports(tmp_path):
    before = _untracked()
    (tmp_path / "tmp").mkdir()
    straight, stdout = _train(tmp_path / "tmp" / "zero-text-lm", "straight", default_out=True)
    # Progress: rank 0 alone prints a line per step (log-every 1) with elapsed time, steps/s and an ETA, which is
    # 0:00 at the last step; the summary gives the total time.
    steps = [line for line in stdout.splitlines() if re.match(r"step +[1-9]\d*  loss", line)]
    assert [int(line.split()[1]) for line in steps] == [1, 2, 3, 4], stdout
    assert all(re.search(r"elapsed \d+:\d\d  \d+\.\d\d steps/s  ETA (\d+:\d\d|\?)$", line) for line in steps), steps
    assert steps[-1].endswith("ETA 0:00"), steps[-1]
    assert re.search(r"summary: 4 steps \(4 in this run, \d+:\d\d in all\)", stdout), stdout
    assert straight["wall_s"] > 0
    assert _untracked() == before, "the demo wrote into the checkout: its outputs belong in --out"
    (tmp_path / "tmp" / "zero-text-lm").rename(tmp_path / "straight")
    first, stdout = _train(tmp_path / "stopped", "first", "--stop-after", "2")
    assert "stopped after step 2" in stdout and not (tmp_path / "stopped" / "hf").exists()
    resumed, stdout = _train(tmp_path / "stopped", "resumed", "--resume")
    assert "resumed from" in stdout and "at step 2" in stdout

    # [step, train loss, grad norm] and [step, val loss]: same world size, so equal bit for bit
    assert first["train"] == straight["train"][:2]
    assert resumed["train"] == straight["train"] and resumed["val"] == straight["val"]
    assert [s for s, *_ in straight["val"]] == [0, 2, 4]
    assert straight["val"][-1][1] < straight["val"][0][1] - 0.1
    assert straight["train"][-1][1] < straight["train"][0][1]

    # the export is a plain state dict that a plain model loads strictly, with the sharded model's values
    sys.path.insert(0, str(EXAMPLE))
    try:
        from byte_gpt import ByteGPT, ByteGPTConfig
    finally:
        sys.path.remove(str(EXAMPLE))
    for run in ("straight", "stopped"):
        plain = ByteGPT(ByteGPTConfig(seq_len=32, d_model=32, n_layer=1, n_head=2))
        plain.load_state_dict(load_file(tmp_path / run / "hf" / "model.safetensors"), strict=True)
    straight_weights = load_file(tmp_path / "straight" / "hf" / "model.safetensors")
    resumed_weights = load_file(tmp_path / "stopped" / "hf" / "model.safetensors")
    assert all(torch.equal(straight_weights[k], resumed_weights[k]) for k in straight_weights)
    assert "reloaded the export into a plain ByteGPT" in stdout and "sample (temperature" in stdout
