"""Host<->device copies that convert on the device (see [Note: copies between host and device])."""

from __future__ import annotations

import pytest
import torch

from zero_core.base._devices import to_compute_device, to_host


def _devices() -> list[torch.device]:
    return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_master_shard_reaches_the_compute_device_in_the_compute_dtype(dtype):
    master = torch.randn(1000)
    for device in _devices():
        got = to_compute_device(master, device, dtype)
        assert got.device.type == device.type and got.dtype == dtype
        assert torch.equal(got.cpu(), master.to(dtype))
    same = to_compute_device(master, torch.device("cpu"), torch.float32)
    assert same is master  # nothing to move or convert: no copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_reduced_gradient_reaches_the_host_in_the_master_dtype(dtype):
    for device in _devices():
        reduced = torch.randn(1000, device=device).to(dtype)
        got = to_host(reduced, torch.device("cpu"), torch.float32)
        assert got.device.type == "cpu" and got.dtype == torch.float32
        assert torch.equal(got, reduced.cpu().float())
        # from CUDA the host copy is pinned (a pageable one runs at a fraction of the link's speed)
        assert got.is_pinned() == (device.type == "cuda")
    kept = torch.randn(10)
    assert to_host(kept, torch.device("cpu"), torch.float32) is kept  # a gradient already there is never copied
