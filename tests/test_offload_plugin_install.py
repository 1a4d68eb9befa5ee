"""A third-party placement policy works from plain installs: a fresh venv, wheels built from the
repository's distributions plus examples/placement-lru, torchrun training selecting it by name, and
the example's own conformance tests run with that venv's pytest (nothing imported from the checkout).
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from _checked_run import run_checked as _run

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = ["packages/core", "packages/comm", "packages/strategies/chunk", "packages/offload", "examples/placement-lru"]

TRAIN = textwrap.dedent(
    """
    import json
    import sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import zero_core
    import zero_placement_lru
    from zero_core import ChunkPolicy, ZeroConfig
    from zero_core.plugin import MemoryTier

    # Installed, not imported from the checkout.
    assert "site-packages" in zero_placement_lru.__file__, zero_placement_lru.__file__
    assert "site-packages" in zero_core.__file__, zero_core.__file__

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        placement, options = sys.argv[1], json.loads(sys.argv[2])
        config = ZeroConfig(placement=placement, placement_options=options, chunk=ChunkPolicy(chunk_size=256),
                            collective_timeout_s=120)
        model, optimizer = zero_core.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
        engine = model.engine
        assert engine.placement.name == placement, engine.placement.name
        assert len(engine.chunks) >= 3, f"only {len(engine.chunks)} chunks"

        generator = torch.Generator().manual_seed(1)
        inputs = torch.randn(64, 16, generator=generator)
        targets = torch.sin(inputs[:, :4] * 2)  # the same global batch on every rank; each trains on its half
        local = slice(rank * 32, (rank + 1) * 32)
        losses = []
        for _ in range(10):
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(inputs[local]), targets[local])
            loss.backward()
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            # after every step the shards are back on the host (the optimizer stepped there)
            assert all(c.tier is MemoryTier.HOST for c in engine.chunks), [c.tier for c in engine.chunks]
        if rank == 0:
            print("losses:", " ".join(f"{x:.5f}" for x in losses), flush=True)
        assert losses[-1] < 0.8 * losses[0], losses
        assert sum(b < a for a, b in zip(losses, losses[1:])) >= 7, losses
        moves = engine.placement.report()["moves"]["params"]
        assert moves > 0, f"the {placement} policy never moved a master shard"
        print(f"rank {rank}: ok, {len(engine.chunks)} chunks, {moves} shard moves", flush=True)
        model.close()  # as documented: before the process group goes away
    finally:
        dist.destroy_process_group()
    """
)



@pytest.mark.timeout(900)
def test_lru_policy_installs_and_trains_from_a_fresh_venv(tmp_path: Path, fresh_venv) -> None:
    python, env = fresh_venv.python, fresh_venv.env  # torch, pytest and pytest-timeout; nothing of the checkout
    _run([*fresh_venv.pip, *(str(ROOT / d) for d in DISTRIBUTIONS)], env=env, cwd=tmp_path, timeout=300)

    # (a) torchrun on 2 gloo ranks, the policy selected by name through its entry point; and zero-offload's
    # own gemini (margin_ratio 0: every chunk steps on the host, so its shards move), which
    # `pip install zero-core zero-strategy-chunk zero-offload` must make work on its own
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    for placement, options in (("lru", {"device_chunks": 1}), ("gemini", {"device_budget_mb": 1, "margin_ratio": 0.0})):
        proc = _run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
                     placement, json.dumps(options)], env=env, cwd=tmp_path, timeout=240)
        print(proc.stdout)
        assert "losses:" in proc.stdout and proc.stdout.count(": ok,") == 2, proc.stdout + proc.stderr

    # (b) the example's conformance tests with the venv's pytest, outside the repository's pytest config
    rundir = tmp_path / "pytest-run"
    rundir.mkdir()
    test_file = ROOT / "examples" / "placement-lru" / "tests" / "test_conformance.py"
    proc = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(rundir),
                 "--timeout", "600", str(test_file)], env=env, cwd=rundir, timeout=660)
    print(proc.stdout)
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout
