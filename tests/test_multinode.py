"""A real multi-node launch on one machine: two torchrun agents ("nodes") of 2 processes each, meeting at a c10d
rendezvous, train with HSDP (replicated across the nodes, sharded within each), checkpoint, and resume in a second
launch, at parity with one process. See docs/multi-node.md for the same commands on real nodes."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero_core import ChunkPolicy, ZeroConfig
from zero_core.testing import run_distributed
from zero_core.testing.checkpointing import phase
from zero_core.testing.zoo import get_case

WORKER = Path(__file__).with_name("_multinode_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, directory: Path, out: Path) -> None:
    """Both nodes of one launch, as two torchrun agents; each gets the same command but its own --node-rank."""
    port = _free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", f"zero-multinode-{mode}", str(WORKER), mode, str(directory), str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = []
    for proc in nodes:
        try:
            outputs.append(proc.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            pytest.fail(f"the {mode} launch did not finish in 300 s:\n" + "\n".join(o for o in outputs if o))
    if any(proc.returncode for proc in nodes):
        pytest.fail(f"the {mode} launch failed:\n" + "\n---\n".join(outputs))


def test_two_nodes_train_hsdp_checkpoint_and_resume(tmp_path):
    directory = tmp_path / "checkpoint"
    _launch("save", directory, tmp_path / "save.pt")
    _launch("load", directory, tmp_path / "load.pt")
    saved, loaded = (torch.load(tmp_path / name, weights_only=False) for name in ("save.pt", "load.pt"))

    # RANK = node x 2 + LOCAL_RANK, and each node's two processes are consecutive ranks: the mesh's shard groups
    for seen in (saved["seen"], loaded["seen"]):
        assert sorted((s["rank"], s["node"], s["local_rank"]) for s in seen) == \
            sorted((s["node"] * 2 + s["local_rank"], s["node"], s["local_rank"]) for s in seen)
        assert {s["node"] for s in seen} == {0, 1} and all(s["rank"] == s["env_rank"] for s in seen)

    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=get_case("gpt").chunk_size))
    reference = run_distributed(phase, 1, "gpt", config, str(tmp_path / "unused"), mode="straight", k=4)[0]
    assert len(saved["losses"]) == 4 and len(loaded["losses"]) == 2
    assert saved["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert loaded["losses"] == pytest.approx(reference["losses"][2:], rel=1e-5)
    for run in (saved, loaded):
        for name, value in reference["params"].items():
            torch.testing.assert_close(run["params"][name], value, rtol=1e-5, atol=1e-6)
