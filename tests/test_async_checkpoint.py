"""save_checkpoint(..., async_=True): the same bytes as a synchronous save, written while training goes on.

See [Note: asynchronous checkpoints] in ``zero_core.checkpoint._async_save``.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from zero_core import AsyncSave, CheckpointError, ChunkPolicy, ZeroConfig, save_checkpoint
from zero_core.testing import DistributedTestError, run_distributed
from zero_core.testing.checkpointing import build, kill_after_bytes, phase, train_steps
from zero_core.testing.zoo import get_case

CONFIG = ZeroConfig(chunk=ChunkPolicy(chunk_size=300))
EXTRA = {"epoch": 3, "position": torch.arange(5)}


def _both_ways(sync_dir: str, async_dir: str, stage: int) -> dict:
    """Train 2 steps, save synchronously and asynchronously, train 2 more while the second is written, close."""
    case = get_case("gpt")
    model, opt = build(case, CONFIG.replace(stage=stage))
    train_steps(model, opt, case, 0, 2)
    assert save_checkpoint(model, opt, sync_dir, extra=EXTRA) is None
    handle = save_checkpoint(model, opt, async_dir, extra=EXTRA, async_=True)
    assert isinstance(handle, AsyncSave) and handle.staged_bytes > 0
    losses = train_steps(model, opt, case, 2, 2)  # training goes on while the files are written
    model.close()  # waits for the save
    assert handle.done()
    handle.wait()  # no failure to raise
    return {"losses": losses, "blocked_s": handle.blocked_s}


@pytest.mark.parametrize("stage", [1, 3])
def test_an_asynchronous_save_writes_the_bytes_a_synchronous_one_writes(stage, tmp_path):
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    results = run_distributed(_both_ways, 2, str(sync_dir), str(async_dir), stage)
    a = json.loads((sync_dir / "zero_checkpoint.json").read_text())
    b = json.loads((async_dir / "zero_checkpoint.json").read_text())
    ids = (a["save_id"].encode(), b["save_id"].encode())
    for fa, fb in zip(a["files"], b["files"], strict=True):  # the rank files, byte for byte, but for the save id
        data_a, data_b = (sync_dir / fa["name"]).read_bytes(), (async_dir / fb["name"]).read_bytes()
        assert data_a.replace(*ids) == data_b, fa["name"]
    assert (sync_dir / a["extra"]["name"]).read_bytes() == (async_dir / b["extra"]["name"]).read_bytes()

    def comparable(metadata):
        drop = {"save_id", "files", "extra"}
        return {k: v for k, v in metadata.items() if k not in drop}

    assert comparable(a) == comparable(b)
    # and it resumes: the checkpoint written in the background loads, and trains as the run did
    straight = run_distributed(phase, 2, "gpt", CONFIG.replace(stage=stage), str(tmp_path / "x"), mode="straight",
                               k=2, j=2)[0]
    resumed = run_distributed(phase, 2, "gpt", CONFIG.replace(stage=stage), str(async_dir), mode="load", k=2, j=2)[0]
    assert resumed["losses"] == straight["losses"][2:] == results[0]["losses"]


def _fails_in_the_background(directory: str, first: str) -> list[str]:
    """Rank 1's file cannot be written: every rank learns it at its next call, and the first checkpoint stays."""
    import torch.distributed as dist

    from zero_core.checkpoint import _async_save

    case = get_case("gpt")
    model, opt = build(case, CONFIG)
    train_steps(model, opt, case, 0, 1)
    save_checkpoint(model, opt, first)  # a complete checkpoint
    train_steps(model, opt, case, 1, 1)
    original = _async_save.atomic_write
    if dist.get_rank() == 1:
        def atomic_write(path, write):
            raise OSError(28, "No space left on device")
        _async_save.atomic_write = atomic_write
    handle = save_checkpoint(model, opt, first, async_=True)  # returns: the failure is in the background
    _async_save.atomic_write = original
    train_steps(model, opt, case, 2, 1)
    messages = []
    for call in (lambda: save_checkpoint(model, opt, first), handle.wait):
        try:
            call()
            messages.append("")
        except CheckpointError as exc:
            messages.append(str(exc))
    metadata = json.loads((Path(first) / "zero_checkpoint.json").read_text())
    messages.append(metadata["step"])  # still the first checkpoint
    save_checkpoint(model, opt, first)  # the failure was raised once: saving works again
    model.close()
    return messages


def test_a_failure_in_the_background_is_raised_at_the_next_call_and_the_previous_checkpoint_stays(tmp_path):
    directory = tmp_path / "ckpt"
    results = run_distributed(_fails_in_the_background, 2, str(directory), str(directory))
    for rank, (at_next_save, at_wait, step_left) in enumerate(results):
        # raised at the next call, on every rank (rank 0 learns it from rank 1), before that call saved anything
        assert "No space left on device" in at_next_save and "previous checkpoint there is intact" in at_next_save, rank
        assert at_wait == ""  # raised once
        assert step_left == 1  # the directory kept the complete checkpoint of step 1
    assert json.loads((directory / "zero_checkpoint.json").read_text())["step"] == 3


def _async_save_and_die(directory: str, victim: int, limit: int) -> str:
    import torch.distributed as dist

    case = get_case("gpt")
    model, opt = build(case, CONFIG)
    train_steps(model, opt, case, 0, 3)
    with kill_after_bytes(limit) if dist.get_rank() == victim else _nothing():
        handle = save_checkpoint(model, opt, directory, async_=True)
        handle.wait()  # the victim dies in its writer thread; the survivor's wait fails, naming why
    return "saved"


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_rank_killed_during_the_background_write_leaves_the_previous_checkpoint(tmp_path):
    saved = run_distributed(phase, 2, "gpt", CONFIG, str(tmp_path), mode="save", k=2)[0]
    before = json.loads((tmp_path / "zero_checkpoint.json").read_text())
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(_async_save_and_die, 2, str(tmp_path), 1, 2000, timeout=60, grace=30)
    report = str(failure.value)
    assert f"rank 1 exited with code {-signal.SIGKILL}" in report
    assert "another rank failed or stopped responding" in report  # the survivor failed fast, with a reason
    assert json.loads((tmp_path / "zero_checkpoint.json").read_text()) == before
    resumed = run_distributed(phase, 2, "gpt", CONFIG, str(tmp_path), mode="load", k=2)[0]
    for name, value in saved["params"].items():
        assert torch.equal(resumed["params"][name], value), name


def test_async_must_be_a_bool():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    from zero_core import ConfigError, shard

    zmodel, opt = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=ZeroConfig())
    with pytest.raises(ConfigError, match="async_"):
        save_checkpoint(zmodel, opt, "unused", async_="yes")
    zmodel.close()
    assert not Path("unused").exists()


def test_the_blocking_time_benchmark_runs():
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "benchmarks"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "zero_bench.async_checkpoint", "--model", "tiny", "--repeats", "1"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert len(rows) == 2, proc.stdout
