"""The bench's ranks free their process group at teardown, so nothing races the interpreter's exit.

A gloo group that outlives ``destroy_process_group`` keeps its worker threads; one of them dropping
the last collective's tensors during interpreter shutdown aborted a rank now and then ("terminate
called without an active exception", SIGABRT: the flaky reference rows of ``nox -s bench``). The
abort is a race, but a group that outlives its destruction is not: these tests check that after
each kind of row (DDP, FSDP2 and zero on DTensor), no gloo thread is left.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from zero_core.testing import DistributedTestError, run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from zero_bench.configs import MODELS, BenchConfig  # noqa: E402
from zero_bench.teardown import backend_threads, destroy_process_group_checked  # noqa: E402
from zero_bench.worker import run_config  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads are listed from /proc (Linux)")

ROWS = {
    "ddp": BenchConfig(name="ddp", kind="ddp"),
    "fsdp2": BenchConfig(name="fsdp2", kind="fsdp2"),
    "chunk-s3": BenchConfig(name="chunk-s3", kind="zero", strategy="chunk", stage=3),
}


def train_then_tear_down(config: dict) -> tuple[list[str], list[str]]:
    run_config(config, MODELS["tiny"].options(), steps=2, warmup=1)
    during = backend_threads()
    destroy_process_group_checked()
    return during, backend_threads()


def hold_the_group_then_tear_down() -> int:
    group = dist.distributed_c10d._get_default_group()  # a stray reference, as a cache would hold
    destroy_process_group_checked()
    return group.size()


@pytest.mark.parametrize("row", sorted(ROWS))
def test_no_gloo_thread_outlives_the_teardown(row):
    for during, after in run_distributed(train_then_tear_down, 2, ROWS[row].as_dict(), timeout=120):
        assert during, "the group's threads should be visible while it is alive, or this test checks nothing"
        assert after == []


def test_a_group_still_referenced_is_named():
    with pytest.raises(DistributedTestError, match="outlived destroy_process_group: threads .*gloo"):
        run_distributed(hold_the_group_then_tear_down, 2, timeout=60)
