"""A third-party shard strategy works from plain installs: a fresh venv, wheels built from zero-core, zero-comm
and examples/strategy-nodelocal (no built-in strategy installed), torchrun training on 4 ranks selecting
``strategy="node-local"`` by name, which plans hybrid sharding (each chunk on a (2, 2) mesh: sharded in pairs
of ranks, replicated across the pairs) without core knowing about it; and the example's own conformance
tests run with that venv's pytest (nothing imported from the checkout).

Kept lean for CI: one venv, one pip call, one torchrun of 4 processes for 10 steps.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from _checked_run import run_checked as _run

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = ["packages/core", "packages/comm", "examples/strategy-nodelocal"]

TRAIN = textwrap.dedent(
    """
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import zero_core
    import zero_strategy_nodelocal
    from zero_core import ChunkPolicy, ZeroConfig

    # Installed, not imported from the checkout; and no built-in strategy is installed at all.
    assert "site-packages" in zero_strategy_nodelocal.__file__, zero_strategy_nodelocal.__file__
    assert "site-packages" in zero_core.__file__, zero_core.__file__
    assert zero_core.plugin.ZeroPlugins.load().strategies.names() == ["node-local"], zero_core.plugin.ZeroPlugins.load().strategies.names()
    # torchrun says the node has 4 ranks; the override makes "nodes" of 2
    assert os.environ["LOCAL_WORLD_SIZE"] == "4" and os.environ["ZERO_NODELOCAL_SHARD_SIZE"] == "2"

    STEPS, BATCH = 10, 64


    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(BATCH, 16, generator=generator)
    targets = torch.sin(inputs[:, :4] * 2)

    # The reference: the same model in one process on the whole batch, without zero.
    reference = build()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_losses = []
    for _ in range(STEPS):
        ref_optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(reference(inputs), targets)
        loss.backward()
        ref_optimizer.step()
        ref_losses.append(loss.item())

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    failures = []  # every rank runs every collective, then reports all it found
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        config = ZeroConfig(strategy="node-local", chunk=ChunkPolicy(chunk_size=256), collective_timeout_s=120)
        model = build()
        model, optimizer = zero_core.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
        engine = model.engine
        if not isinstance(engine.strategy, zero_strategy_nodelocal.NodeLocalStrategy):
            failures.append(f"the engine runs {type(engine.strategy).__name__}, not NodeLocalStrategy")
        if len(engine.chunks) < 3:
            failures.append(f"only {len(engine.chunks)} chunks")
        meshes = []
        for chunk in engine.chunks:
            plan = getattr(chunk, "plan", None)  # the ChunkPlan the strategy gave, as the runtime keeps it
            if plan is None:
                failures.append(f"chunk {chunk.index} exposes no .plan (its ChunkPlan); its .mesh is {chunk.mesh}")
                continue
            meshes.append(plan.mesh)
            if plan.mesh.shape != (2, 2) or plan.mesh.ranks != (0, 1, 2, 3):
                failures.append(f"chunk {chunk.index} lives on {plan.mesh!r}, not the (2, 2) mesh over ranks 0-3")
            if chunk.size != 2 * chunk.shard_size:
                failures.append(f"chunk {chunk.index}: size {chunk.size} is not 2 shards of {chunk.shard_size} (sharded over 2 ranks)")

        local = slice(rank * BATCH // world, (rank + 1) * BATCH // world)  # each rank trains on its quarter
        losses = []
        for _ in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(inputs[local]), targets[local])
            loss.backward()
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        if rank == 0:
            print("losses:   ", " ".join(f"{x:.7f}" for x in losses), flush=True)
            print("reference:", " ".join(f"{x:.7f}" for x in ref_losses), flush=True)
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            if abs(got - want) > 1e-5 * max(1.0, abs(want)):
                failures.append(f"step {step}: loss {got!r} but one process on the whole batch gives {want!r}")
        if not losses[-1] < 0.8 * losses[0]:
            failures.append(f"the loss did not go down: {losses}")

        # Replicas hold the same shards, bit for bit: rank r and the ranks of its replicate group.
        shards = [chunk.shard.detach().cpu().clone() for chunk in engine.chunks]
        every = [None] * world
        dist.all_gather_object(every, shards)
        if meshes:
            for group in meshes[0].replicate_groups():
                if rank in group:
                    for other in group:
                        for i, (a, b) in enumerate(zip(every[rank], every[other])):
                            if a.shape != b.shape or not torch.equal(a, b):
                                failures.append(f"chunk {i}: rank {rank}'s shard differs from its replica on rank {other}")
        # The whole parameters: the same on every rank, and the reference's.
        params = model.full_parameters()
        everyone = [None] * world
        dist.all_gather_object(everyone, params)
        for other, theirs in enumerate(everyone):
            for name, value in params.items():
                if not torch.equal(value, theirs[name]):
                    failures.append(f"parameter {name} differs between rank {rank} and rank {other}")
        for name, value in reference.named_parameters():
            if not torch.allclose(params[name], value.detach(), rtol=1e-4, atol=1e-5):
                diff = (params[name] - value.detach()).abs().max().item()
                failures.append(f"parameter {name} differs from the reference by {diff:.3g}")
        model.close()  # as documented: before the process group goes away
    finally:
        dist.destroy_process_group()
    if failures:
        print(f"rank {rank}: FAILED\\n  " + "\\n  ".join(failures), flush=True)
        raise SystemExit(1)
    print(f"rank {rank}: ok, {len(engine.chunks)} chunks on meshes {sorted({m.shape for m in meshes})}", flush=True)
    """
)



@pytest.mark.timeout(900)
def test_node_local_strategy_installs_and_trains_hsdp_from_a_fresh_venv(tmp_path: Path, fresh_venv) -> None:
    python, env = fresh_venv.python, fresh_venv.env  # torch, pytest and pytest-timeout; nothing of the checkout
    _run([*fresh_venv.pip, *(str(ROOT / d) for d in DISTRIBUTIONS)], env=env, cwd=tmp_path, timeout=300)

    # (a) torchrun on 4 gloo ranks ("one node" to torchrun), the strategy selected by name through its entry
    # point, and ZERO_NODELOCAL_SHARD_SIZE=2 making it plan two "nodes" of 2 ranks: HSDP on a (2, 2) mesh
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    proc = _run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(script)],
                env={**env, "ZERO_NODELOCAL_SHARD_SIZE": "2"}, cwd=tmp_path, timeout=300)
    print(proc.stdout)
    assert "losses:" in proc.stdout and proc.stdout.count(": ok,") == 4, proc.stdout + proc.stderr

    # (b) the example's conformance tests with the venv's pytest, outside the repository's pytest config
    rundir = tmp_path / "pytest-run"
    rundir.mkdir()
    test_file = ROOT / "examples" / "strategy-nodelocal" / "tests" / "test_conformance.py"
    proc = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(rundir),
                 str(test_file)], env=env, cwd=rundir, timeout=300)
    print(proc.stdout)
    assert " passed" in proc.stdout and " failed" not in proc.stdout and "skipped" not in proc.stdout, proc.stdout
