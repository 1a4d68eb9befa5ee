"""The stream check (issue 47 item 5): [Note: streams of the data plane] in zero_core.base._streams, checked on CPU.

A recording double of the data plane's streams (``zero_core.testing.streams``) is installed around ``shard()``; it
fails when a buffer is read on one stream before the event of the stream that wrote it, reused before its
consumer's event, or freed while another stream may still use it. It runs over forward, backward, prefetch,
``no_sync`` and recovery, at world size 1 (in this process) and 2 (one spawn for every scenario), and each test
also asserts the recorder saw the cross-stream traffic it checks, so a pass is never vacuous. On CUDA the same
steps also run under torch's CUDA sanitizer.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zero_core import ChunkPolicy, ZeroConfig, shard
from zero_core.base._devices import copy_on_copy_stream
from zero_core.chunks._buffers import BufferPool
from zero_core.testing import rank_device, run_distributed
from zero_core.testing.streams import RecordingStreams, StreamViolation, record_streams

TIMEOUT = 120


# --- the double itself: each of the three violations, and what is allowed -------------------------------------


def test_a_read_before_the_writers_event_is_a_violation():
    rec = RecordingStreams(strict=True)
    buf = torch.empty(4)
    rec.allocated(buf, rec.compute)
    rec.wait(rec.all_gather, rec.record(rec.compute))
    rec.wrote(buf, rec.all_gather)
    with pytest.raises(StreamViolation, match="read on the compute stream before the event of the all-gather stream"):
        rec.read(buf, rec.compute)
    event = rec.record(rec.all_gather)
    rec.wait(rec.compute, event)
    rec.read(buf, rec.compute)  # after the event: allowed
    # an event recorded before the write does not cover it
    rec.wait(rec.all_gather, rec.record(rec.compute))  # (the compute stream read it: the rewrite waits that)
    early = rec.record(rec.all_gather)
    rec.wrote(buf, rec.all_gather)
    rec.wait(rec.compute, early)
    with pytest.raises(StreamViolation, match="read on the compute stream"):
        rec.read(buf, rec.compute)


def test_a_reuse_before_the_consumers_event_is_a_violation():
    rec = RecordingStreams(strict=True)
    buf = torch.empty(4)
    rec.allocated(buf, rec.compute)
    rec.wait(rec.all_gather, rec.record(rec.compute))  # orders the allocation, not what the compute stream does next
    rec.read(buf, rec.compute)  # the compute stream consumes it ...
    with pytest.raises(StreamViolation, match="reused .* on the all-gather stream before the event of its consumer, "
                                              "the compute stream"):
        rec.wrote(buf, rec.all_gather)  # ... and the all-gather stream overwrites it without waiting
    rec2 = RecordingStreams(strict=True)
    rec2.allocated(buf, rec2.compute)
    rec2.read(buf, rec2.compute)
    rec2.wait(rec2.all_gather, rec2.record(rec2.compute))
    rec2.wrote(buf, rec2.all_gather)  # after the consumer's event: allowed


def test_a_free_while_in_use_is_a_violation():
    rec = RecordingStreams(strict=True)
    buf = torch.empty(4)
    rec.allocated(buf, rec.compute)
    rec.wait(rec.reduce_scatter, rec.record(rec.compute))
    rec.read(buf, rec.reduce_scatter)
    with pytest.raises(StreamViolation, match="freed while in use: the reduce-scatter stream used it"):
        rec.dropped(buf)
    rec.allocated(buf, rec.compute)
    rec.wait(rec.reduce_scatter, rec.record(rec.compute))
    rec.read(buf, rec.reduce_scatter)
    rec.wait(rec.compute, rec.record(rec.reduce_scatter))
    rec.dropped(buf)  # the compute stream, whose memory it is, waited the user: allowed


def test_events_order_transitively():
    """compute -> all-gather -> reduce-scatter: the last sees the first's write through the middle one's event."""
    rec = RecordingStreams(strict=True)
    buf = torch.empty(4)
    rec.allocated(buf, rec.compute)
    rec.wrote(buf, rec.compute)
    rec.wait(rec.all_gather, rec.record(rec.compute))
    rec.wait(rec.reduce_scatter, rec.record(rec.all_gather))
    rec.read(buf, rec.reduce_scatter)


def test_the_pool_hands_a_buffer_out_after_the_event_it_came_back_with():
    rec = RecordingStreams(strict=True)
    pool = BufferPool(rec)
    buf = pool.take(8, torch.float32, torch.device("cpu"), zeroed=False, stream=rec.all_gather)
    rec.wait(rec.all_gather, rec.record(rec.compute))  # allocated on the compute stream: the writer waits it
    rec.wrote(buf, rec.all_gather)
    rec.wait(rec.compute, rec.record(rec.all_gather))
    rec.read(buf, rec.compute)
    pool.give(buf)  # the compute stream read it last: it comes back with the compute stream's event
    again = pool.take(8, torch.float32, torch.device("cpu"), zeroed=False, stream=rec.all_gather)
    assert again is buf
    rec.wrote(again, rec.all_gather)  # the pool made the all-gather stream wait that event
    pool.give(again, after=rec.record(rec.all_gather))
    pool.clear()  # the compute stream waits the event before the memory goes back to the allocator
    assert rec.counts["dropped"] == 1 and not rec.violations


def test_a_host_copy_runs_on_the_copy_stream_and_its_reader_waits_it():
    rec = RecordingStreams(strict=True)
    src, dst = torch.arange(4.0), torch.empty(4)
    rec.allocated(src, rec.compute)
    rec.wrote(src, rec.compute)
    copy_on_copy_stream(dst, src, rec)
    assert torch.equal(dst, src)
    assert rec.counts["write on copy"] == 1 and rec.counts["copy waits compute"] == 1
    assert rec.counts["host waits copy"] == 1  # dst is in host memory: the host reads it next


# --- training steps under the recorder ------------------------------------------------------------------------


class Net(nn.Module):
    """Five units (one chunk each, ``chunk_size=80``), so every pass has a next unit to prefetch."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step + 10 * (dist.get_rank() if dist.is_initialized() else 0))
    return torch.randn(4, 8, generator=g).to(rank_device()), torch.randint(0, 3, (4,), generator=g).to(rank_device())


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    return F.cross_entropy(model(x), y)


class _Raise(RuntimeError):
    pass


def _raise(*_: object) -> None:
    raise _Raise("a forward that fails mid-way")


def _mark_compute(model: nn.Module, rec: RecordingStreams) -> None:
    """Tell the recorder where each unit computes, in forward and in backward: these hooks run after zero's own
    (registered later), so after the unit's gather and the next unit's prefetch were issued."""

    def backward_hook(_grad: torch.Tensor) -> None:
        rec.computing()

    def forward_hook(_module: nn.Module, _args: object, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.register_hook(backward_hook)

    for layer in [*model.layers, model.head]:
        layer.register_forward_pre_hook(lambda *_: rec.computing())
        layer.register_forward_hook(forward_hook)


def _scenario(path: str, **options: object) -> dict:
    """One path's steps under a fresh recorder; what the recorder saw, by phase."""
    stage = int(options.pop("stage", 3))
    strategy = str(options.pop("strategy", "chunk"))
    chunk = ChunkPolicy(chunk_size=80) if strategy == "chunk" else ChunkPolicy()
    phases: dict[str, Counter] = {}
    with record_streams() as rec:
        torch.manual_seed(0)
        model = Net().to(rank_device())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = shard(model, opt, config=ZeroConfig(stage=stage, strategy=strategy, chunk=chunk, **options))
        _mark_compute(model, rec)

        @contextlib.contextmanager
        def phase(name: str) -> Iterator[None]:
            before = Counter(rec.counts)
            try:
                yield
            finally:
                phases[name] = Counter(rec.counts) - before

        for step in range(3):
            if path == "no_sync":
                with model.no_sync(), phase(f"no_sync backward {step}"):
                    _loss(model, step).backward()
            if path == "recovery" and step == 1:
                handle = model.layers[2].register_forward_hook(_raise)
                try:
                    with phase("failed forward"):
                        _loss(model, step)
                except _Raise:
                    pass
                finally:
                    handle.remove()
            with phase(f"forward {step}"):
                loss = _loss(model, step)
            with phase(f"backward {step}"):
                loss.backward()
            with phase(f"step {step}"):
                opt.step()
                opt.zero_grad()
    return {"violations": list(rec.violations), "counts": dict(rec.counts),
            "phases": {k: dict(v) for k, v in phases.items()}}


SCENARIOS = {
    "stage3": {},  # agreed all-gathers with prefetch, then replayed passes
    "stage3_static": {"static_graph": True},  # prefetch without agreements
    "stage2": {"stage": 2},  # gradients reduce-scattered, kept buffers refreshed after each step
    "tensor": {"strategy": "tensor"},  # gather groups: one all-gather per module, cut out per parameter
    "no_sync": {"path": "no_sync"},
    "recovery": {"path": "recovery"},
}


def _all_scenarios() -> dict[str, dict]:
    out = {}
    for name, options in SCENARIOS.items():
        options = dict(options)
        out[name] = _scenario(str(options.pop("path", name)), **options)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, dict]]:
    return run_distributed(_all_scenarios, 2, timeout=TIMEOUT)


def _clean(result: dict) -> None:
    assert not result["violations"], "\n\n".join(result["violations"])


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_order_every_buffer_across_streams(two_ranks, name):
    for rank, results in enumerate(two_ranks):
        result = results[name]
        _clean(result)
        counts = result["counts"]
        # the check saw the traffic it checks: all-gathers on their stream, awaited by the compute stream's copy-out
        assert counts["write on all-gather"] > 0 and counts["compute waits all-gather"] > 0, (rank, counts)
        assert counts["reduce-scatter waits compute"] > 0 and counts["compute waits reduce-scatter"] > 0, (rank, counts)
        assert counts["dropped"] > 0, (rank, counts)


@pytest.mark.parametrize("name", ["stage3", "stage3_static", "tensor"])
def test_the_next_units_gather_travels_while_the_current_one_computes(two_ranks, name):
    """Prefetch, in forward and in backward: a gathered buffer the compute stream reads only after it read others
    (the units computed in between) was issued ahead on the all-gather stream and awaited by event."""
    for results in two_ranks:
        phases = results[name]["phases"]
        assert phases["forward 2"].get("overlapped", 0) > 0, phases["forward 2"]
        assert phases["backward 2"].get("overlapped", 0) > 0, phases["backward 2"]


def test_no_sync_accumulates_without_reduce_scatters(two_ranks):
    for results in two_ranks:
        _clean(results["no_sync"])
        phases = results["no_sync"]["phases"]
        assert phases["no_sync backward 0"].get("write on reduce-scatter", 0) == 0
        assert phases["no_sync backward 0"].get("write on all-gather", 0) > 0  # stage 3 gathers again for backward
        assert phases["backward 0"].get("write on reduce-scatter", 0) > 0


def test_a_failed_forward_leaves_nothing_unordered(two_ranks):
    for results in two_ranks:
        _clean(results["recovery"])
        phases = results["recovery"]["phases"]
        assert phases["failed forward"].get("write on all-gather", 0) > 0  # it raised after gathering
        assert phases["forward 1"].get("compute waits all-gather", 0) > 0


def test_one_rank_orders_its_gathers_and_gradients():
    """World size 1, in this process: a placement that keeps shards off the device, so stage 3 gathers (and copies shards between tiers)."""
    result = _scenario("stage3", placement="static", placement_options={"offload_param_frac": 1.0, "offload_optim_frac": 1.0})
    _clean(result)
    counts = result["counts"]
    assert counts["write on all-gather"] > 0 and counts["compute waits all-gather"] > 0, counts
    assert counts["allocated"] > 0 and counts["dropped"] > 0, counts


# --- CUDA: the same steps under torch's CUDA sanitizer --------------------------------------------------------

_SANITIZED = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from torch import nn
    from zero_core import ChunkPolicy, ZeroConfig, shard
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # at stage 3 on one GPU, shards kept on the host make every unit gather (and copy shards on the copy stream)
    model, opt = shard(model, opt, config=ZeroConfig(stage={stage}, chunk=ChunkPolicy(chunk_size=64 * 65),
                                                     placement="{placement}", placement_options={options}))
    for step in range(3):
        x = torch.randn(8, 64, device="cuda")
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    print("ok")
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's CUDA sanitizer needs a CUDA device")
@pytest.mark.parametrize(("stage", "placement", "options"), [
    (3, "static", {"offload_param_frac": 1.0, "offload_optim_frac": 1.0}), (2, "device", {})])
def test_cuda_steps_pass_the_cuda_sanitizer(stage, placement, options):
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    script = _SANITIZED.format(stage=stage, placement=placement, options=repr(options))
    done = subprocess.run([sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr
    assert "CSAN" not in done.stderr, done.stderr
