"""The torch.distributed comm backend: conformance, timeouts, single-process use."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from zero_comm import TorchCommBackend
from zero_core import CollectiveTimeoutError
from zero_core.plugin import CommBackend
from zero_core.testing import CommBackendConformance, run_distributed


class TestTorchBackend(CommBackendConformance):
    backend_class = TorchCommBackend


class _WithoutAllToAll(TorchCommBackend):
    """A backend that leaves all_to_all to the interface's default (built from all_gather and agree_max)."""

    all_to_all = CommBackend.all_to_all


class TestTheDefaultAllToAll(CommBackendConformance):
    backend_class = _WithoutAllToAll


def _rank0_result():
    comm = TorchCommBackend(dist.group.WORLD, timeout=timedelta(seconds=3))
    if dist.get_rank() == 1:
        time.sleep(6)
        return None
    start = time.monotonic()
    try:
        comm.all_gather(torch.empty(8), torch.ones(4))
    except CollectiveTimeoutError as err:
        return time.monotonic() - start, str(err)
    return "completed"


def test_timeout_error_names_the_collective_and_rank():
    results = run_distributed(_rank0_result, 2, timeout=30)
    elapsed, message = results[0]
    assert elapsed < 6
    assert "all_gather of 8 elements on rank 0 of 2" in message and "Another rank" in message


def test_single_process_without_a_process_group():
    comm = TorchCommBackend(None)
    assert (comm.rank, comm.world_size) == (0, 1)
    out = torch.empty(3)
    comm.all_gather(out, torch.arange(3.0))
    assert torch.equal(out, torch.arange(3.0))
    assert comm.agree_min(7) == 7
    assert comm.all_gather_object("x") == ["x"]
    assert comm.stats.current == {}


def test_collectives_fall_back_to_their_pre_2_12_names(monkeypatch):
    from zero_comm._torch_backend import single_collective

    if hasattr(dist, "all_gather_single"):  # torch >= 2.12
        assert single_collective("all_gather_single", "all_gather_into_tensor") is dist.all_gather_single
    # torch 2.11 (the GPU machines' build) has only the old names
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    assert single_collective("all_gather_single", "all_gather_into_tensor") is dist.all_gather_into_tensor
    assert single_collective("reduce_scatter_single", "reduce_scatter_tensor") is dist.reduce_scatter_tensor
