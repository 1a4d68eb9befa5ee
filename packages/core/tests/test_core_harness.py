"""The distributed test harness: results come back, failures never hang."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from zero_core.testing import DistributedTestError, run_distributed


def _sum_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), os.environ["WORLD_SIZE"]


def _rank1_raises():
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # would wait forever for rank 1
    return "unreachable"


def _rank0_hangs():
    if dist.get_rank() == 0:
        time.sleep(3600)
    return "done"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_results_come_back_in_rank_order(world):
    results = run_distributed(_sum_ranks, world)
    assert [r[0] for r in results] == list(range(world))
    assert all(r[1] == world and r[2] == sum(range(world)) and r[3] == str(world) for r in results)


def test_a_failing_rank_fails_the_run_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank1_raises, 2, timeout=120, grace=2)
    assert time.monotonic() - start < 60
    assert "rank 1 failed" in str(info.value) and "rank one is broken" in str(info.value)


def test_a_hanging_rank_is_killed_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="did not finish within 5s"):
        run_distributed(_rank0_hangs, 2, timeout=5)
    assert time.monotonic() - start < 30
