"""The torch.distributed comm backend: conformance, timeouts, single-process use."""

import time
from datetime import timedelta

import pytest
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


class _ControlOnAHostTwin(TorchCommBackend):
    """Control messages over a gloo twin of the group, as over an NCCL-only group (here forced over gloo)."""

    @staticmethod
    def _needs_host_twin(backend: str) -> bool:
        return True


class TestControlMessagesOnAHostTwin(CommBackendConformance):
    backend_class = _ControlOnAHostTwin


def _control_groups():
    twin, own = _ControlOnAHostTwin(dist.group.WORLD), TorchCommBackend(dist.group.WORLD)
    made = twin._control_group  # None until the first control message
    agreed = (twin.agree_min(3 + dist.get_rank()), twin.agree_any(torch.tensor([dist.get_rank()], dtype=torch.uint8)).tolist(),
              twin.agree_max(torch.tensor([dist.get_rank()])).tolist(), twin.all_gather_object(dist.get_rank()))
    control = twin._control()
    own.agree_min(0)
    return {"made before": made, "agreed": agreed, "twin": control is not dist.group.WORLD,
            "one twin": twin._control() is control, "twin ranks": dist.get_process_group_ranks(control),
            "twin backend": str(dist.get_backend(control)), "own": own._control() is dist.group.WORLD,
            "devices": (str(twin._control_device), str(own._control_device)),
            "counted": twin.stats.summary(twin.stats.current)}


def test_control_messages_over_an_nccl_only_group_go_over_a_gloo_twin_made_once():
    """See [Note: control messages on the host]: the twin is made at the first control message, once, over the
    group's ranks; every control message answers as over the group itself; a group that carries CPU tensors
    (gloo here) sends them itself."""
    results = run_distributed(_control_groups, 2, timeout=60)
    for r in results:
        assert r["made before"] is None
        assert r["agreed"] == (3, [1], [1], [0, 1])
        assert r["twin"] and r["one twin"] and r["own"]
        assert r["twin ranks"] == [0, 1] and r["twin backend"] == "gloo"
        assert r["devices"] == ("cpu", "cpu")
    assert results[0]["counted"] == results[1]["counted"]


def _rank0_result(backend_class, call, peer_sleeps_s):
    """Rank 0's time to a CollectiveTimeoutError from ``call(comm)`` (3 s timeout) and its message, while rank 1
    sleeps instead of taking part."""
    comm = backend_class(dist.group.WORLD, timeout=timedelta(seconds=3))
    if dist.get_rank() == 1:
        time.sleep(peer_sleeps_s)
        return None
    start = time.monotonic()
    try:
        call(comm)
    except CollectiveTimeoutError as err:
        return time.monotonic() - start, str(err)
    return "completed"


def _all_gather(comm):
    comm.all_gather(torch.empty(8), torch.ones(4))


def test_timeout_error_names_the_collective_and_rank():
    results = run_distributed(_rank0_result, 2, TorchCommBackend, _all_gather, 6, timeout=30)
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


def _gloo_results():
    """Each collective on random fp32 and bf16 values against the sum in rank order and the concatenation, bit for
    bit; the bytes the backend's pool holds after each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = TorchCommBackend(dist.group.WORLD)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        inputs = [torch.randn(world * 6, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(world)]
        for async_op in (False, True):
            comm.free()
            reduced = torch.empty(6, dtype=dtype)
            pending = comm.reduce_scatter(reduced, inputs[rank].clone(), async_op=async_op)
            if pending is not None:
                pending.wait()
            expected = torch.sum(torch.stack(inputs).view(world, world, 6)[:, rank], dim=0)
            out[f"rs {dtype} {async_op}"] = torch.equal(reduced, expected)
            out["rs bytes"] = comm.buffer_bytes
            # into a wider output (a 16-bit reduction landing in fp32): summed in the input's dtype, then cast
            wide = torch.empty(6, dtype=torch.float32)
            comm.reduce_scatter(wide, inputs[rank].clone())
            # the general path's formula: torch.sum over the ranks' rows into the wider output
            expected_wide = torch.sum(torch.stack(inputs).view(world, world, 6)[:, rank], dim=0,
                                      out=torch.empty(6, dtype=torch.float32))
            out[f"rs wide {dtype} {async_op}"] = torch.equal(wide, expected_wide)
            comm.free()
            gathered = torch.empty(world * 6, dtype=dtype)
            pending = comm.all_gather(gathered, inputs[rank][:6], async_op=async_op)
            if pending is not None:
                pending.wait()
            out[f"ag {dtype} {async_op}"] = torch.equal(gathered, torch.cat([t[:6] for t in inputs]))
            out["ag bytes"] = comm.buffer_bytes
            # into a wider output (a cast gather): the general path, which casts while it copies
            wide = torch.empty(world * 6, dtype=torch.float32)
            comm.all_gather(wide, inputs[rank][:6])
            out[f"ag wide {dtype}"] = torch.equal(wide, torch.cat([t[:6] for t in inputs]).float())
            # in place: the input is this rank's row of the output (a one-parameter chunk's gather)
            gathered = torch.zeros(world * 6, dtype=dtype)
            gathered[rank * 6 : (rank + 1) * 6] = inputs[rank][:6]
            comm.all_gather(gathered, gathered[rank * 6 : (rank + 1) * 6])
            out[f"ag in place {dtype}"] = torch.equal(gathered, torch.cat([t[:6] for t in inputs]))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_collectives_are_exact_and_two_ranks_need_no_send_buffer(world):
    """[Note: two ranks on gloo]: at two ranks the all-to-alls skip the rank's own block, so the all-gather holds no
    send buffer and the reduce-scatter receives only the peer's copy of its slice (the output's size, not the
    input's); the results are bit for bit those of the general path, which four ranks take."""
    for result in run_distributed(_gloo_results, world, timeout=60):
        assert not [k for k, v in result.items() if "bytes" not in k and not v]
        row = 6 * torch.bfloat16.itemsize  # the last dtype run
        assert result["ag bytes"] == (0 if world == 2 else world * row)
        assert result["rs bytes"] == (row if world == 2 else world * row)


def _agree(comm):
    comm.agree_min(1)


def test_a_peer_that_never_sends_its_first_control_message_times_out_making_the_twin():
    results = run_distributed(_rank0_result, 2, _ControlOnAHostTwin, _agree, 8, timeout=60)
    elapsed, message = results[0]
    assert elapsed < 8
    assert "gloo group of ranks [0, 1] for control messages" in message and "Another rank" in message
