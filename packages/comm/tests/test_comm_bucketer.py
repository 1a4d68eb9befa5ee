"""The reduce-scatter bucketer and the ``bucketed`` backend: values, collective counts, order, threads, errors.

The distributed checks of 2 ranks run in one process group (the ``two_ranks`` fixture);
each test asserts its own part of the result. Buckets here are 1 KiB, so the arithmetic
stays small: 1024 bytes / 4 bytes per fp32 element / 2 ranks = 128 elements per rank.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zero_comm import (
    Bucket,
    BucketCallbackError,
    BucketedCommBackend,
    BucketError,
    BucketState,
    ReduceScatterBucketer,
    TorchCommBackend,
)
from zero_core import CommStats, ZeroConfig
from zero_core.plugin import CollectiveKind, ring_bytes_sent
from zero_core.testing import CommBackendConformance, run_distributed

KIB = 1 / 1024  # in MiB, the unit of bucket sizes
RS = CollectiveKind.REDUCE_SCATTER
# Sizes around the 128-element capacity of a 2-rank fp32 bucket (64 at 4 ranks): tiny ones,
# exact fits, one over, several buckets' worth, and multi-dimensional shapes.
SHAPES = [(1,), (3,), (17,), (4, 16), (5,), (100,), (128,), (129,), (2,), (40,), (250,), (7,), (3, 5), (64,), (1,)]


class TestBucketedBackend(CommBackendConformance):
    backend_class = BucketedCommBackend


# -- helpers shared by the workers and the assertions ------------------------------------


def _parts(rank: int, k: int, world: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Rank ``rank``'s input ``k``, one tensor per destination rank; small integers, so sums are exact even in bf16."""
    base = torch.arange(math.prod(shape)).remainder(7).reshape(shape)
    return [(base + 3 * rank + dst + k % 5).to(dtype) for dst in range(world)]


def _expected(dst: int, k: int, world: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return sum(_parts(r, k, world, shape, dtype)[dst] for r in range(world))  # type: ignore[return-value]


def _capacity(world: int, itemsize: int = 4, mb: float = KIB) -> int:
    return int(mb * 2**20) // itemsize // world


def _planned(sizes: list[int], capacity: int) -> tuple[list[int], int]:
    """Per-rank sizes of the collectives that inputs of ``sizes`` and a flush should issue, in
    launch order, and how many come before the flush: an input over the capacity goes alone at
    once, a bucket goes when the next input does not fit, the flush sends the rest."""
    launched, filled = [], 0
    for n in sizes:
        if n > capacity:
            launched.append(n)
            continue
        if filled + n > capacity:
            launched.append(filled)
            filled = 0
        filled += n
    before = len(launched)
    if filled:
        launched.append(filled)
    return launched, before


def _wire_bytes(per_rank_sizes: list[int], world: int, itemsize: int = 4) -> int:
    return sum(ring_bytes_sent(RS, world * n * itemsize, world) for n in per_rank_sizes)


def _calls(comm: Any) -> int:
    return CommStats.calls(comm.stats.current, RS)


def _bytes(comm: Any) -> int:
    return CommStats.bytes_sent(comm.stats.current, RS)


def _comm(seconds: float = 60) -> TorchCommBackend:
    return TorchCommBackend(dist.group.WORLD, timeout=timedelta(seconds=seconds))


# -- distributed workers (module level: the ranks import them by name) ---------------------


def _values(bucketer: ReduceScatterBucketer, comm: Any, shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    """Queue one input per shape (every third as a stacked tensor, the rest as lists), then flush."""
    rank, world = comm.rank, comm.world_size
    results: dict[int, torch.Tensor] = {}
    for k, shape in enumerate(shapes):
        parts = _parts(rank, k, world, shape)
        inputs = torch.stack(parts) if k % 3 == 0 else parts
        bucketer.reduce_scatter_async(inputs, comm, lambda shard, k=k: results.__setitem__(k, shard.clone()))
    before = _calls(comm)
    bucketer.flush()
    return {"results": [results[k] for k in range(len(shapes))], "before": before, "calls": _calls(comm), "bytes": _bytes(comm)}


def _order(comm: Any) -> dict[str, Any]:
    rank, world = comm.rank, comm.world_size
    bucketer = ReduceScatterBucketer(KIB)
    cap = bucketer.capacity(torch.float32, world)
    order: list[str] = []

    def queue_(label: str, n: int) -> None:
        bucketer.reduce_scatter_async(_parts(rank, 0, world, (n,)), comm, lambda shard: order.append(label))

    queue_("small", cap // 4)
    queue_("big", cap + 72)  # over the capacity: launched at once, ahead of "small"
    launched_after_big = bucketer.launched
    queue_("small2", cap // 4)
    bucketer.flush()
    seed, order = order, []
    queue_("a", cap // 2)
    queue_("b", cap // 2)
    queue_("c", cap // 2)  # does not fit next to a and b: their bucket launches first
    launched_by_c = bucketer.launched - 2
    queue_("d", cap // 4)
    bucketer.flush()
    return {"seed": seed, "after_big": launched_after_big, "overflow": order, "by_c": launched_by_c, "launched": bucketer.launched}


def _overflow(comm: Any, n: int, count: int) -> dict[str, int]:
    rank, world = comm.rank, comm.world_size
    bucketer = ReduceScatterBucketer(KIB)
    for k in range(count):
        bucketer.reduce_scatter_async(_parts(rank, k, world, (n,)), comm)
    before = _calls(comm)
    bucketer.flush()
    return {"before": before, "calls": _calls(comm), "bytes": _bytes(comm)}


def _oversized(comm: Any) -> dict[str, Any]:
    rank, world = comm.rank, comm.world_size
    bucketer = ReduceScatterBucketer(KIB)
    cap = bucketer.capacity(torch.float32, world)
    results: dict[int, torch.Tensor] = {}
    bucketer.reduce_scatter_async(_parts(rank, 0, world, (10,)), comm, lambda s: results.__setitem__(0, s.clone()))
    calls, zero_copy = [_calls(comm)], []
    for k, n in enumerate([cap + 1, 2 * cap, 3 * cap + 5], start=1):
        rows = torch.stack(_parts(rank, k, world, (n,)))
        ticket = bucketer.reduce_scatter_async(rows, comm, lambda s, k=k: results.__setitem__(k, s.clone()))
        calls.append(_calls(comm))
        zero_copy.append(ticket._collective.keep.data_ptr() == rows.data_ptr())
    ran_before_flush = len(results)
    bucketer.flush()
    return {"calls": calls, "final": _calls(comm), "zero_copy": zero_copy, "ran_before_flush": ran_before_flush,
            "results": [results[k] for k in range(4)], "cap": cap}


def _mixed(comm: Any) -> dict[str, Any]:
    rank, world = comm.rank, comm.world_size
    bucketer = ReduceScatterBucketer(KIB)
    results: dict[tuple[str, int], torch.Tensor] = {}
    for k in range(3):
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            bucketer.reduce_scatter_async(
                _parts(rank, k, world, (100,), dtype), comm, lambda s, key=(name, k): results.__setitem__(key, s.clone())
            )
    bucketer.flush()
    return {"results": results, "calls": _calls(comm), "bytes": _bytes(comm), "dtypes": [b.dtype for b in bucketer.buckets]}


def _disabled(comm_factory: Any, size: float) -> dict[str, Any]:
    comm = comm_factory()
    rank, world = comm.rank, comm.world_size
    bucketer = ReduceScatterBucketer(size)
    results: dict[int, torch.Tensor] = {}
    calls = []
    for k in range(4):
        bucketer.reduce_scatter_async(_parts(rank, k, world, (10,)), comm, lambda s, k=k: results.__setitem__(k, s.clone()))
        calls.append(_calls(comm))
    bucketer.flush()
    return {"calls": calls, "final": _calls(comm), "results": [results[k] for k in range(4)], "buckets": len(bucketer.buckets)}


def _free(comm: Any) -> dict[str, Any]:
    bucketer = ReduceScatterBucketer(KIB)
    first = _values(bucketer, comm, [(10,), (20,), (30,)])
    bucketer.free()
    freed = [b.state for b in bucketer.buckets]
    again = _values(bucketer, comm, [(10,), (20,), (30,)])
    states_after_reuse = [b.state for b in bucketer.buckets]
    bucketer.reduce_scatter_async(_parts(comm.rank, 0, comm.world_size, (4,)), comm)
    try:
        bucketer.free()
        refused = None
    except BucketError as err:
        refused = str(err)
    bucketer.flush()  # every rank flushes alike, so the queued input is still reduced in step
    return {"first": first["results"], "again": again["results"], "freed": freed, "reused": states_after_reuse, "refused": refused}


def _callback_error(comm: Any) -> dict[str, Any]:
    rank, world = comm.rank, comm.world_size
    bucketer = ReduceScatterBucketer(KIB)
    ran: list[str] = []

    def callback(label: str) -> Any:
        def run(shard: torch.Tensor) -> None:
            ran.append(label)
            if label == "bad":
                raise ValueError("boom")
        return run

    for k, label in enumerate(["ok1", "bad", "ok2"]):
        bucketer.reduce_scatter_async(_parts(rank, k, world, (6,)), comm, callback(label))
    try:
        bucketer.flush()
        error = None
    except BucketCallbackError as err:
        error = (str(err), type(err.__cause__).__name__, str(err.__cause__))
    after = _values(bucketer, comm, [(9,)])
    return {"error": error, "ran": ran, "after": after["results"], "in_flight": bucketer.in_flight}


def _threads(comm: Any) -> dict[str, Any]:
    """The engine's pattern: this thread queues and finally flushes; another thread waits on each ticket in order."""
    rank, world = comm.rank, comm.world_size
    bucketer = ReduceScatterBucketer(KIB)
    shapes = SHAPES * 2
    results: dict[int, list[torch.Tensor]] = {k: [] for k in range(len(shapes))}
    tickets: queue.Queue[Any] = queue.Queue()
    waited: list[int] = []
    errors: list[str] = []

    def waiter() -> None:
        while (item := tickets.get()) is not None:
            k, ticket = item
            try:
                ticket.wait()
            except Exception as err:
                errors.append(repr(err))
            if not results[k]:
                errors.append(f"ticket {k} returned from wait() before its callback ran")
            waited.append(k)

    thread = threading.Thread(target=waiter)
    thread.start()
    for k, shape in enumerate(shapes):
        ticket = bucketer.reduce_scatter_async(
            _parts(rank, k, world, shape), comm, lambda s, k=k: results[k].append(s.clone())
        )
        tickets.put((k, ticket))
    bucketer.flush()
    tickets.put(None)
    thread.join(60)
    return {"results": results, "waited": waited, "errors": errors, "alive": thread.is_alive(), "shapes": shapes}


def _never_flushed(comm: Any) -> dict[str, Any]:
    comm.timeout = timedelta(seconds=0.5)
    bucketer = ReduceScatterBucketer(KIB)
    got: list[torch.Tensor] = []
    ticket = bucketer.reduce_scatter_async(_parts(comm.rank, 0, comm.world_size, (4,)), comm, lambda s: got.append(s.clone()))
    outcome: dict[str, Any] = {}

    def wait() -> None:
        start = time.monotonic()
        try:
            ticket.wait()
            outcome["error"] = None
        except BucketError as err:
            outcome["error"] = str(err)
        outcome["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=wait)
    thread.start()
    thread.join(30)
    comm.timeout = timedelta(seconds=60)  # the flush below waits on a real collective
    bucketer.flush()
    ticket.wait()
    return {**outcome, "launched": bucketer.launched, "got": got}


def _backend(bucket_mb: float) -> dict[str, Any]:
    backend = BucketedCommBackend(dist.group.WORLD, timeout=timedelta(seconds=60), bucket_size_mb=bucket_mb)
    stats = CommStats()
    backend.stats = stats  # as zero_core.shard does for the reduce backend: the inner backend must follow
    rank, world = backend.rank, backend.world_size
    sizes = [s[0] for s in SHAPES]
    outputs = [torch.empty(n) for n in sizes]
    pendings: queue.Queue[Any] = queue.Queue()
    errors: list[str] = []

    def waiter() -> None:
        while (pending := pendings.get()) is not None:
            try:
                pending.wait()
            except Exception as err:
                errors.append(repr(err))

    thread = threading.Thread(target=waiter)
    thread.start()
    for k, n in enumerate(sizes):
        flat = torch.cat(_parts(rank, k, world, (n,)))
        pendings.put(backend.reduce_scatter(outputs[k], flat, async_op=True))
    backend.flush()
    pendings.put(None)
    thread.join(60)
    sync_out = torch.empty(5)
    backend.reduce_scatter(sync_out, torch.cat(_parts(rank, 99, world, (5,))))
    backend.free()
    return {"outputs": outputs, "sync": sync_out, "calls": CommStats.calls(stats.current, RS), "errors": errors,
            "freed": {b.state for b in backend.bucketer.buckets}, "sizes": sizes}


def _two_rank_worker() -> dict[str, Any]:
    return {
        "values": _values(ReduceScatterBucketer(KIB), _comm(), SHAPES),
        "order": _order(_comm()),
        "overflow": _overflow(_comm(), n=50, count=10),
        "oversized": _oversized(_comm()),
        "mixed": _mixed(_comm()),
        "disabled": [_disabled(_comm, size) for size in (0, -1.5)],
        "free": _free(_comm()),
        "callback_error": _callback_error(_comm()),
        "threads": _threads(_comm()),
        "never_flushed": _never_flushed(_comm()),
        "backend": _backend(KIB),
        "rank": dist.get_rank(),
    }


def _four_rank_worker() -> dict[str, Any]:
    return {"values": _values(ReduceScatterBucketer(KIB), _comm(), SHAPES), "backend": _backend(KIB), "rank": dist.get_rank()}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(_two_rank_worker, 2, timeout=120)


# -- values and counts -----------------------------------------------------------------------


def _assert_values(results: list[torch.Tensor], rank: int, world: int, shapes: list[tuple[int, ...]]) -> None:
    assert len(results) == len(shapes)
    for k, (got, shape) in enumerate(zip(results, shapes)):
        assert torch.equal(got, _expected(rank, k, world, shape)), (k, shape)


def test_many_small_inputs_reduce_to_the_sum_over_ranks(two_ranks: list[dict[str, Any]]) -> None:
    sizes = [math.prod(s) for s in SHAPES]
    launches, before = _planned(sizes, _capacity(2))
    for res in two_ranks:
        got = res["values"]
        _assert_values(got["results"], res["rank"], 2, SHAPES)
        assert (got["before"], got["calls"]) == (before, len(launches))
        assert got["bytes"] == _wire_bytes(launches, 2)
        assert len(launches) < len(SHAPES)  # the point of bucketing


def test_four_ranks_and_one_rank() -> None:
    results = run_distributed(_four_rank_worker, 4, timeout=120)
    sizes = [math.prod(s) for s in SHAPES]
    launches, before = _planned(sizes, _capacity(4))
    for res in results:
        _assert_values(res["values"]["results"], res["rank"], 4, SHAPES)
        assert (res["values"]["before"], res["values"]["calls"]) == (before, len(launches))
        backend = res["backend"]
        for k, (out, n) in enumerate(zip(backend["outputs"], backend["sizes"])):
            assert torch.equal(out, _expected(res["rank"], k, 4, (n,))), k
        assert torch.equal(backend["sync"], _expected(res["rank"], 99, 4, (5,)))
    # one rank: every bucket "reduce-scatters" to a copy of the input and sends nothing
    one = _values(ReduceScatterBucketer(KIB), TorchCommBackend(None), SHAPES)
    _assert_values(one["results"], 0, 1, SHAPES)
    assert one["calls"] == 0


def test_a_full_bucket_launches_before_the_input_that_overflows_it(two_ranks: list[dict[str, Any]]) -> None:
    cap, n, count = _capacity(2), 50, 10  # 128 elements per rank
    per_bucket = cap // n  # 2 inputs of 50; a third would make 150
    calls = math.ceil(count / per_bucket)  # 5
    for res in two_ranks:
        got = res["overflow"]
        assert got["before"] == calls - 1  # every bucket but the last launched when the next input did not fit
        assert got["calls"] == calls
        assert got["bytes"] == calls * ring_bytes_sent(RS, 2 * per_bucket * n * 4, 2)


def test_an_input_over_the_capacity_is_sent_at_once_in_its_own_collective(two_ranks: list[dict[str, Any]]) -> None:
    for res in two_ranks:
        got = res["oversized"]
        assert got["cap"] == _capacity(2)
        assert got["calls"] == [0, 1, 2, 3]  # the queued small input waits; each large one goes immediately
        assert got["zero_copy"] == [True, True, True]  # contiguous rows are sent as they are
        assert got["ran_before_flush"] == 0
        assert got["final"] == 4  # plus the small input's bucket at the flush
        sizes = [10, got["cap"] + 1, 2 * got["cap"], 3 * got["cap"] + 5]
        _assert_values(got["results"], res["rank"], 2, [(n,) for n in sizes])


def test_dtypes_go_to_separate_buckets(two_ranks: list[dict[str, Any]]) -> None:
    fp32_cap, bf16_cap = _capacity(2, 4), _capacity(2, 2)  # 128 and 256 elements per rank
    per_fp32, per_bf16 = fp32_cap // 100, bf16_cap // 100  # three inputs of 100 each: 1 and 2 per bucket
    fp32_launches = [per_fp32 * 100] * 3
    bf16_launches = [per_bf16 * 100, (3 - per_bf16) * 100]
    for res in two_ranks:
        got = res["mixed"]
        assert got["calls"] == len(fp32_launches) + len(bf16_launches) == 5
        assert got["bytes"] == _wire_bytes(fp32_launches, 2, 4) + _wire_bytes(bf16_launches, 2, 2)
        assert set(got["dtypes"]) == {torch.float32, torch.bfloat16}
        for (name, k), value in got["results"].items():
            dtype = torch.float32 if name == "fp32" else torch.bfloat16
            assert value.dtype == dtype
            assert torch.equal(value, _expected(res["rank"], k, 2, (100,), dtype)), (name, k)


def test_bucketing_disabled_sends_every_input_at_once(two_ranks: list[dict[str, Any]]) -> None:
    for res in two_ranks:
        for got in res["disabled"]:  # sizes 0 and -1.5
            assert got["calls"] == [1, 2, 3, 4]
            assert got["final"] == 4 and got["buckets"] == 0
            _assert_values(got["results"], res["rank"], 2, [(10,)] * 4)


# -- order ------------------------------------------------------------------------------------


def test_callbacks_run_in_launch_order_then_queue_order(two_ranks: list[dict[str, Any]]) -> None:
    for res in two_ranks:
        got = res["order"]
        assert got["after_big"] == 1
        assert got["seed"] == ["big", "small", "small2"]  # the oversized input launched first
        assert got["by_c"] == 1
        assert got["overflow"] == ["a", "b", "c", "d"]
        assert got["launched"] == 4


# -- free and errors ---------------------------------------------------------------------------


def test_free_then_reuse_and_free_with_queued_inputs_is_refused(two_ranks: list[dict[str, Any]]) -> None:
    shapes = [(10,), (20,), (30,)]
    for res in two_ranks:
        got = res["free"]
        _assert_values(got["first"], res["rank"], 2, shapes)
        _assert_values(got["again"], res["rank"], 2, shapes)
        assert got["freed"] and set(got["freed"]) == {BucketState.FREED}
        assert BucketState.FREED not in got["reused"]
        assert "1 input(s) are queued" in got["refused"] and "call flush() first" in got["refused"]


def test_a_raising_callback_does_not_stop_the_others(two_ranks: list[dict[str, Any]]) -> None:
    for res in two_ranks:
        got = res["callback_error"]
        message, cause, cause_message = got["error"]
        assert cause == "ValueError" and cause_message == "boom"
        assert "reduce-scatter of 6 elements (torch.float32" in message and "ValueError: boom" in message
        assert got["ran"] == ["ok1", "bad", "ok2"]
        _assert_values(got["after"], res["rank"], 2, [(9,)])
        assert got["in_flight"] == 0


def test_bucket_used_after_free_asks_for_allocate() -> None:
    bucket = Bucket(2, 8, torch.float32, torch.device("cpu"))
    assert bucket.state is BucketState.FREED
    with pytest.raises(BucketError, match=r"freed; call allocate\(\) first"):
        bucket.append([torch.ones(2), torch.ones(2)], None)
    bucket.allocate()
    assert bucket.append([torch.ones(2), torch.ones(2)], None) == 0
    assert bucket.append(torch.ones(2, 3), None) == 2
    assert bucket.state is BucketState.FILLING and bucket.filled == 5 and not bucket.can_take(4)
    with pytest.raises(BucketError, match=r"call ReduceScatterBucketer.flush\(\) first"):
        bucket.free()
    fresh = Bucket(2, 8, torch.float32, torch.device("cpu"))
    fresh.allocate()
    fresh.free()
    with pytest.raises(BucketError, match=r"freed; call allocate\(\) first"):
        fresh.append([torch.ones(2), torch.ones(2)], None)
    with pytest.raises(BucketError, match=r"freed; call allocate\(\) first"):
        fresh.launch(_RecordingComm(2))


class _RecordingComm:
    """Stands in for a comm backend where no collective may run: records what would be sent."""

    def __init__(self, world_size: int) -> None:
        self.world_size, self.timeout, self.sent = world_size, timedelta(seconds=1), []

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> None:
        assert input.is_contiguous() and input.numel() == output.numel() * self.world_size
        self.sent.append(input.clone())
        output.zero_()


@pytest.mark.parametrize("filled", [1, 3, 5, 9, 10])  # rows far apart, moved in pieces, moved via a copy, full
def test_a_partial_bucket_sends_its_rows_packed_to_the_front(filled: int) -> None:
    world, capacity = 4, 10
    bucket = Bucket(world, capacity, torch.float32, torch.device("cpu"))
    bucket.allocate()
    rows = torch.arange(world * filled, dtype=torch.float32).view(world, filled) + 1
    bucket.append(rows, None)
    comm = _RecordingComm(world)
    bucket.launch(comm)  # type: ignore[arg-type]
    assert torch.equal(comm.sent[0], rows.reshape(-1))
    assert bucket.state is BucketState.LAUNCHED


def test_bad_inputs_say_what_is_wrong() -> None:
    comm = _RecordingComm(2)
    bucketer = ReduceScatterBucketer(KIB)
    cases = [
        ([torch.ones(3)] * 3, r"got 3 inputs but comm.world_size is 2"),
        ([torch.ones(3), torch.ones(4)], r"inputs\[1\] has shape \(4,\) but inputs\[0\] has \(3,\)"),
        ([torch.ones(3), torch.ones(3, dtype=torch.bfloat16)], r"inputs\[1\] has dtype torch.bfloat16 but inputs\[0\] has torch.float32"),
        ([], r"empty list of inputs; pass comm.world_size = 2 tensors"),
        ([torch.ones(3), [1.0, 2.0, 3.0]], r"inputs\[1\] is a list, not a tensor"),
        (torch.ones(3, 4), r"first dimension is 3 but comm.world_size is 2"),
        ("grads", r"got str"),
    ]
    for inputs, message in cases:
        with pytest.raises(ValueError, match=message):
            bucketer.reduce_scatter_async(inputs, comm)  # type: ignore[arg-type]
    assert bucketer.launched == 0 and comm.sent == []


class _BrokenComm(_RecordingComm):
    """A backend whose first reduce-scatter cannot start and whose second fails in flight."""

    class _Failed:
        def wait(self) -> None:
            raise RuntimeError("peer died")

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Any:
        self.sent.append(input.clone())
        if len(self.sent) == 1:
            raise RuntimeError("cannot launch")
        return self._Failed()


def test_a_failed_collective_fails_its_tickets_and_leaves_the_bucketer_usable() -> None:
    comm = _BrokenComm(2)
    bucketer = ReduceScatterBucketer(KIB)
    ran: list[torch.Tensor] = []
    first = bucketer.reduce_scatter_async([torch.ones(3), torch.ones(3)], comm, ran.append)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="cannot launch"):
        bucketer.flush()
    with pytest.raises(BucketError, match="failed: cannot launch"):
        first.wait()
    second = bucketer.reduce_scatter_async([torch.ones(3), torch.ones(3)], comm, ran.append)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="peer died"):
        bucketer.flush()  # the thread that completes it gets the collective's own error
    with pytest.raises(BucketError, match="failed: peer died"):
        second.wait()  # every other waiter learns that its result never came
    assert ran == [] and bucketer.in_flight == 0
    bucketer.free()
    assert {b.state for b in bucketer.buckets} == {BucketState.FREED}


# -- threads -------------------------------------------------------------------------------------


def test_waiting_from_another_thread_while_this_one_flushes(two_ranks: list[dict[str, Any]]) -> None:
    for res in two_ranks:
        got = res["threads"]
        assert got["errors"] == [] and not got["alive"]
        assert got["waited"] == list(range(len(got["shapes"])))
        for k, shape in enumerate(got["shapes"]):
            assert len(got["results"][k]) == 1, f"callback {k} ran {len(got['results'][k])} times"
            assert torch.equal(got["results"][k][0], _expected(res["rank"], k, 2, shape))


def test_waiting_on_a_ticket_never_flushed_times_out_with_advice(two_ranks: list[dict[str, Any]]) -> None:
    for res in two_ranks:
        got = res["never_flushed"]
        assert "queued in a bucket that was never flushed; call flush()" in got["error"]
        assert 0.4 < got["elapsed"] < 10
        assert got["launched"] == 1  # wait() launched nothing; the flush did
        assert torch.equal(got["got"][0], _expected(res["rank"], 0, 2, (4,)))


# -- the backend ---------------------------------------------------------------------------------


def test_backend_buckets_async_reduce_scatters_and_counts_each_once(two_ranks: list[dict[str, Any]]) -> None:
    sizes = [s[0] for s in SHAPES]
    launches, _ = _planned(sizes, _capacity(2))
    for res in two_ranks:
        got = res["backend"]
        assert got["errors"] == []
        for k, (out, n) in enumerate(zip(got["outputs"], sizes)):
            assert torch.equal(out, _expected(res["rank"], k, 2, (n,))), k
        assert torch.equal(got["sync"], _expected(res["rank"], 99, 2, (5,)))
        assert got["calls"] == len(launches) + 1  # plus the synchronous one, flushed on its own
        assert got["freed"] == {BucketState.FREED}


def test_backend_reads_the_bucket_size_from_the_config() -> None:
    backend = BucketedCommBackend.from_config(None, timeout=timedelta(seconds=5), config=ZeroConfig(reduce_bucket_mb=0.5))
    assert isinstance(backend, BucketedCommBackend)
    assert backend.bucketer.bucket_size_mb == 0.5 and backend.timeout == timedelta(seconds=5)
    out = torch.empty(3)
    backend.reduce_scatter(out, torch.arange(3.0))  # one rank: a copy
    assert torch.equal(out, torch.arange(3.0)) and backend.stats.current == {}


class _LoopbackComm:
    """Two 'ranks' that both hold the same input: a reduce-scatter doubles this rank's slice."""

    world_size, timeout = 2, timedelta(seconds=5)

    def reduce_scatter(self, output, input, *, async_op=False):
        output.copy_(input.view(2, -1)[0] * 2)


def test_a_ticket_says_whether_the_input_may_be_reused_at_once():
    bucketer = ReduceScatterBucketer(bucket_size_mb=64 * 4 * 2 / 2**20)  # 64 fp32 elements per rank
    comm, got = _LoopbackComm(), {}
    small = torch.ones(2, 16)
    large = torch.ones(2, 100)
    queued = bucketer.reduce_scatter_async(small, comm, lambda r: got.setdefault("small", r.clone()))
    alone = bucketer.reduce_scatter_async(large, comm, lambda r: got.setdefault("large", r.clone()))
    assert queued.input_released  # copied into the bucket: the caller's buffer is free again
    assert not alone.input_released  # sent as it is: it must outlive the collective
    small.fill_(7.0)  # reusing the released input changes nothing that was queued
    bucketer.flush()
    assert torch.equal(got["small"], torch.full((16,), 2.0)) and torch.equal(got["large"], torch.full((100,), 2.0))
