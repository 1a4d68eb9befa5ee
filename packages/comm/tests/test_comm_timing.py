"""Measured time in the comm counters: per kind, calls and bytes as before, plus seconds, latency and bandwidth.

Wall times are not deterministic, so the backends are run with a fake clock (every reading one
second after the last) where exact figures are asserted, and a real training step is checked for
structure: every kind timed, positive times, bandwidth equal to bytes over seconds.
"""

import itertools
import pickle
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from zero_comm import BucketedCommBackend, TorchCommBackend
from zero_core import ChunkPolicy, CommStats, ZeroConfig, clip_grad_norm_, shard
from zero_core.plugin import CollectiveCount, CollectiveKind, ring_bytes_sent
from zero_core.testing import run_distributed
from zero_core.testing.gpt import GPT, GPTConfig, SyntheticTokens, lm_loss

AG, RS, AR, BC = CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE, CollectiveKind.BROADCAST
CONTROL, OBJECT = CollectiveKind.CONTROL, CollectiveKind.OBJECT


def _timed(calls=1, bytes_sent=0, payload=0, seconds=None, blocked=None):
    count = CollectiveCount()
    for _ in range(calls):
        count.add(bytes_sent // calls, payload // calls)
        if seconds is not None:
            count.add_time(seconds / calls, blocked / calls)
    return count


def test_latency_and_bandwidths_follow_from_bytes_and_seconds():
    count = _timed(calls=4, bytes_sent=3_000_000, payload=6_000_000, seconds=0.002, blocked=0.001)
    assert (count.calls, count.bytes_sent, count.payload_bytes, count.timed_calls) == (4, 3_000_000, 6_000_000, 4)
    assert count.latency_ms == pytest.approx(0.5)
    assert count.algbw_gbps == pytest.approx(6_000_000 / 0.002 / 1e9)
    assert count.busbw_gbps == pytest.approx(3_000_000 / 0.002 / 1e9)


def test_figures_that_were_not_measured_are_none():
    untimed = _timed(calls=2, bytes_sent=100, payload=200)
    assert (untimed.latency_ms, untimed.algbw_gbps, untimed.busbw_gbps) == (None, None, None)
    partly = _timed(calls=1, bytes_sent=100, payload=200, seconds=1.0, blocked=1.0)
    partly.add(100, 200)  # a second call that was not timed: its bytes must not count against the first one's time
    assert partly.latency_ms == 1e3 and partly.busbw_gbps is None
    objects = _timed(calls=1, seconds=0.5, blocked=0.5)  # object exchanges carry no counted bytes
    assert objects.latency_ms == 500 and objects.algbw_gbps is None


def test_timing_default_is_cpu_only():
    stats = CommStats()
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert stats.times(cpu) and not stats.times(cuda)
    stats.timing = True
    assert stats.times(cpu) and stats.times(cuda)
    stats.timing = False
    assert not stats.times(cpu) and not stats.times(cuda)


def test_steps_totals_and_combine_carry_the_time():
    stats = CommStats(window=2)
    for step in range(3):
        count = stats.record(AG, 100, payload_bytes=200)
        stats.add_time(count, 0.25 * (step + 1), 0.125)
        stats.record(RS, 50, payload_bytes=100)  # untimed
        stats.end_step()
    assert len(stats.steps) == 2 and stats.step_count == 3
    total = stats.totals[AG]
    assert (total.calls, total.bytes_sent, total.payload_bytes, total.timed_calls) == (3, 300, 600, 3)
    assert total.seconds == pytest.approx(1.5) and total.blocked_seconds == pytest.approx(0.375)
    combined = CommStats.combine(stats.steps)
    assert (combined[AG].calls, combined[AG].seconds, combined[RS].timed_calls) == (2, pytest.approx(1.25), 0)
    per_step = stats.timed_summary(combined, steps=2)
    assert per_step["all_gather"]["calls"] == 1 and per_step["all_gather"]["seconds"] == pytest.approx(0.625)
    assert per_step["all_gather"]["busbw_gbps"] == pytest.approx(200 / 1.25 / 1e9)
    assert per_step["reduce_scatter"]["seconds"] == 0 and per_step["reduce_scatter"]["latency_ms"] is None
    # the existing view is unchanged: calls and bytes only
    assert stats.summary() == {"all_gather": {"calls": 1, "bytes_sent": 100}, "reduce_scatter": {"calls": 1, "bytes_sent": 50}}
    assert pickle.loads(pickle.dumps(stats)).totals == stats.totals


def test_table_puts_theory_beside_the_measurement():
    stats = CommStats()
    stats.add_time(stats.record(AG, 3 * 2**20, payload_bytes=6 * 2**20), 0.004, 0.001)
    stats.add_time(stats.record(CONTROL, 12, payload_bytes=12), 0.001, 0.001)
    lines = stats.table(stats.current, theory={"all_gather": 3 * 2**20, "reduce_scatter": 0}).splitlines()
    assert lines[0].split() == ["collective", "calls", "sent", "theory", "total", "ms", "latency", "ms", "algbw", "GB/s",
                                "busbw", "GB/s", "blocked", "ms"]
    assert lines[1].split() == ["all_gather", "1", "3.0", "MiB", "3.0", "MiB", "4.000", "4.000", "1.57", "0.786", "1.000"]
    assert lines[2].split() == ["control", "1", "12", "B", "-", "1.000", "1.000", "1.2e-05", "1.2e-05", "1.000"]
    # control traffic is not predicted, so there is no predicted total to compare with
    assert lines[3].split() == ["total", "2", "3.0", "MiB", "-", "5.000", "-", "-", f"{(3 * 2**20 + 12) / 0.005 / 1e9:.3g}",
                                "2.000"]


def _fake_clock_collectives(timing):
    """Every collective kind through the torch backend, and a bucketed reduce-scatter, on a clock that ticks once a reading."""
    group, timeout = dist.group.WORLD, timedelta(seconds=60)
    comm = TorchCommBackend(group, timeout=timeout)
    bucketed = BucketedCommBackend(group, timeout=timeout, bucket_size_mb=1.0)
    bucketed.stats = comm.stats  # as zero_core.shard does: one set of counters per engine
    comm.stats.clock = itertools.count().__next__
    comm.stats.timing = timing
    rank = dist.get_rank()
    gathered = torch.empty(8)
    comm.all_gather(gathered, torch.full((4,), float(rank)))
    comm.all_gather(torch.empty(8), torch.ones(4), async_op=True).wait()
    reduced = torch.empty(4)
    comm.reduce_scatter(reduced, torch.arange(8.0), async_op=True).wait()  # gloo: an all-to-all, then a local sum
    queued = torch.empty(4)
    bucketed.reduce_scatter(queued, torch.arange(8.0), async_op=True)  # only queued: launched and waited in flush
    bucketed.flush()
    comm.all_reduce(torch.ones(4))
    comm.broadcast(torch.ones(4), src=0)
    comm.agree_min(3)
    comm.agree_any(torch.zeros(3, dtype=torch.uint8))
    comm.all_gather_object("x")
    counts = {k.value: (c.calls, c.bytes_sent, c.payload_bytes, c.timed_calls, c.seconds, c.blocked_seconds)
              for k, c in comm.stats.current.items()}
    return counts, gathered.tolist(), reduced.tolist(), queued.tolist()


@pytest.mark.parametrize("timing", [None, False])
def test_each_collective_is_timed_from_issue_to_wait(timing):
    results = run_distributed(_fake_clock_collectives, 2, timing, timeout=120)
    for rank, (counts, gathered, reduced, queued) in enumerate(results):
        assert gathered == [0.0] * 4 + [1.0] * 4
        assert reduced == queued == [2.0 * (4 * rank + i) for i in range(4)]

        def ring(kind, payload, calls=1, as_kind=None):
            return calls * ring_bytes_sent(as_kind or kind, payload, 2)

        # (calls, bytes sent, payload, and with the fake clock: seconds, blocked seconds); a blocking call reads
        # the clock at issue and at completion (1 s, all blocked), an async one also where its wait starts (2 s, 1 blocked)
        measured = {
            "all_gather": (2, ring(AG, 32, 2), 64, 1 + 2, 1 + 1),
            "reduce_scatter": (2, ring(RS, 32, 2), 64, 2 + 2, 1 + 1),
            "all_reduce": (1, ring(AR, 16), 16, 1, 1),
            "broadcast": (1, ring(BC, 16), 16, 1, 1),
            "control": (2, ring(CONTROL, 8, as_kind=AR) + ring(CONTROL, 3, as_kind=AR), 11, 2, 2),
            "object": (1, 0, 0, 1, 1),
        }
        expected = {k: (calls, sent, payload, calls if timing is None else 0, *((s, b) if timing is None else (0, 0)))
                    for k, (calls, sent, payload, s, b) in measured.items()}
        assert counts == expected


def _train_two_steps():
    torch.manual_seed(0)
    net = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=2))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net, optimizer = shard(net, optimizer, config=ZeroConfig(stage=3, chunk=ChunkPolicy(chunk_size=3000)))
    data, rank = SyntheticTokens(vocab_size=64, seq_len=16), dist.get_rank()
    for step in range(2):
        tokens = data.batch(step, 4)[2 * rank:2 * rank + 2]
        optimizer.zero_grad()
        net.backward(lm_loss(net(tokens), tokens))
        clip_grad_norm_(net, 1.0)  # an all-reduce of the norm
        optimizer.step()
    stats = net.comm_stats
    records = [stats.setup, *stats.steps]
    out = {"summaries": [stats.summary(r) for r in records], "timed": [stats.timed_summary(r) for r in records],
           "totals": stats.timed_summary(stats.totals), "combined": stats.timed_summary(CommStats.combine(stats.steps)),
           "table": stats.table()}
    net.close()
    return out


def test_a_sharded_step_times_every_kind_it_counts():
    for result in run_distributed(_train_two_steps, 2, timeout=180):
        setup, *steps = result["timed"]
        assert {"object", "broadcast"} <= set(setup)
        for step in steps:
            assert {"all_gather", "reduce_scatter", "all_reduce", "control"} <= set(step)
        for summary, timed in zip(result["summaries"], result["timed"]):
            assert summary == {k: {"calls": v["calls"], "bytes_sent": v["bytes_sent"]} for k, v in timed.items()}
            for kind, v in timed.items():
                assert v["timed_calls"] == v["calls"] > 0, kind
                assert 0 < v["blocked_seconds"] <= v["seconds"], kind
                assert v["latency_ms"] == pytest.approx(1e3 * v["seconds"] / v["calls"]), kind
                if v["bytes_sent"]:
                    assert v["busbw_gbps"] == pytest.approx(v["bytes_sent"] / v["seconds"] / 1e9), kind
                    assert v["algbw_gbps"] == pytest.approx(v["payload_bytes"] / v["seconds"] / 1e9), kind
        assert result["totals"].keys() == result["combined"].keys()  # both steps are still in the window
        for kind, total in result["totals"].items():
            assert total == pytest.approx(result["combined"][kind]), kind
        lines = result["table"].splitlines()
        assert [line.split()[0] for line in lines] == ["collective", "all_gather", "reduce_scatter", "all_reduce", "control",
                                                       "total"]
