"""``zero_integrations.accelerate.prepare``: an Accelerate custom loop under zero, launched by ``accelerate launch`` on
2 CPU ranks, against the same loop under plain Accelerate in one process (examples/accelerate_loop.py).

The loop uses ``accelerator.accumulate`` (2 micro-batches), ``accelerator.backward``, ``accelerator.clip_grad_norm_``
(every step clipped), a schedule, ``accelerator.save_state`` part way and ``load_state``. The zero run has 8 samples
per rank and micro-batch, the plain one 16, so every step sees the same samples. Checked: the losses and the global
pre-clip norms at every micro-batch, the final weights, each run resuming from its own checkpoint, and each loading
the other's checkpoint (2 ranks from 1 process, and back): the checkpoint is world-size free and plain Accelerate's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from zero_core.base.errors import ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "accelerate_loop.py"
TOL = 1e-6  # measured: 1.2e-7 on the losses, 6e-8 on the weights (the reduction's order)


def _run(cmd: list[str], tmp_path: Path) -> None:
    if str(ROOT / "tests") not in sys.path:  # run on its own, this file's folder is the only test folder on the path
        sys.path.insert(0, str(ROOT / "tests"))
    from _checked_run import run_checked

    # a user's saved `accelerate config` must not change the launch; one thread per rank on the shared cores
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}
    run_checked(cmd, env=env, cwd=tmp_path, timeout=300)


def _close(a: list[float], b: list[float], what: str) -> None:
    assert len(a) == len(b), what
    worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
    assert worst <= TOL, f"{what}: {worst:.3g} apart"


def _same_weights(a: dict[str, list[float]], b: dict[str, list[float]], what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        _close(a[name], b[name], f"{what}: {name}")


def test_a_loop_under_zero_on_two_ranks_matches_plain_accelerate_and_checkpoints_load_both_ways(tmp_path):
    plain, zero, plain_from_zero = (tmp_path / f"{n}.json" for n in ("plain", "zero", "plain_from_zero"))
    python = [sys.executable, str(EXAMPLE)]
    _run([*python, "--plain", "--batch-size", "16", "--checkpoint", str(tmp_path / "ckpt-plain"), "--out", str(plain)],
         tmp_path)
    _run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no", str(EXAMPLE), "--checkpoint", str(tmp_path / "ckpt-zero"),
          "--resume-from", str(tmp_path / "ckpt-zero"), "--resume-from", str(tmp_path / "ckpt-plain"), "--out", str(zero)],
         tmp_path)
    _run([*python, "--plain", "--batch-size", "16", "--no-train", "--resume-from", str(tmp_path / "ckpt-zero"),
          "--out", str(plain_from_zero)], tmp_path)
    a, b, c = (json.loads(p.read_text()) for p in (plain, zero, plain_from_zero))
    assert (a["world_size"], b["world_size"]) == (1, 2)
    assert len(a["norms"]) == 4 and all(n > 0.4 for n in a["norms"])  # every step clipped: the norm matters
    _close(a["losses"], b["losses"], "losses")
    _close(a["norms"], b["norms"], "pre-clip gradient norms")
    _same_weights(a["parameters"], b["parameters"], "weights after the epoch")
    # (name of the run, what it resumed): each replays the plain run's tail from its own checkpoint or the other's
    replays = [("plain, own", a["resumed"][0]), ("zero, own", b["resumed"][0]), ("zero from plain", b["resumed"][1]),
               ("plain from zero", c["resumed"][0])]
    tail = len(a["resumed"][0]["losses"])
    assert tail == 4 and a["losses"][-tail:] == a["resumed"][0]["losses"]
    for what, replay in replays:
        _close(a["losses"][-tail:], replay["losses"], f"{what}: losses")
        _same_weights(a["parameters"], replay["parameters"], f"{what}: weights")
    files = sorted(p.name for p in (tmp_path / "ckpt-plain").iterdir())  # plain Accelerate's, one RNG file per rank
    assert sorted(p.name for p in (tmp_path / "ckpt-zero").iterdir()) == sorted([*files, "random_states_1.pkl"])


def test_prepare_refuses_what_it_cannot_honour():
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from zero_integrations.accelerate import prepare

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # an earlier test of this process (a Trainer built in process) may have left Accelerate's singleton state set
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with pytest.raises(ConfigError, match=r"mixed_precision='bf16'.*precision=Precision\(compute='bf16'\)"):
            prepare(Accelerator(mixed_precision="bf16", cpu=True), model, optimizer)
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = Accelerator(cpu=True)
        prepared_model = accelerator.prepare(model)
        with pytest.raises(ConfigError, match="takes the plain model"):
            prepare(accelerator, prepared_model, optimizer)
        with pytest.raises(ConfigError, match="takes an accelerate.Accelerator first"):
            prepare(object(), model, optimizer)  # type: ignore[arg-type]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
