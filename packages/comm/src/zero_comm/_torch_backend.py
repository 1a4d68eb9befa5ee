"""A comm backend over torch.distributed process groups (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zero_core import CollectiveTimeoutError, CommStats
from zero_core.plugin import (
    BufferPool,
    CollectiveCount,
    CollectiveKind,
    CommBackend,
    CommError,
    Pending,
    ring_bytes_sent,
)

__all__ = ["TorchCommBackend"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

# torch 2.12 added the *_single names and 2.13 deprecates the *_into_tensor ones they replace. The
# tests run 2.13; the GPU machines zero is measured on run 2.11, where only the old names exist.
def single_collective(name: str, before_2_12: str) -> Callable[..., Any]:
    """``torch.distributed``'s function ``name``, or its pre-2.12 spelling where this torch lacks it."""
    return getattr(dist, name, None) or getattr(dist, before_2_12)


_all_gather_single = single_collective("all_gather_single", "all_gather_into_tensor")
_reduce_scatter_single = single_collective("reduce_scatter_single", "reduce_scatter_tensor")


def check_reduce_scatter_sizes(output: torch.Tensor, input: torch.Tensor, world_size: int) -> None:
    """A reduce-scatter's input must hold ``world_size`` outputs; say so when it does not."""
    if input.numel() != output.numel() * world_size:
        raise CommError(
            f"reduce_scatter input has {input.numel()} elements, expected world_size x output = "
            f"{world_size} x {output.numel()}"
        )


class _Timer:
    """Times one collective into its count; see [Note: collective timing] in ``zero_core.comm._comm_stats``."""

    __slots__ = ("_count", "_stats", "_sync", "start")

    def __init__(self, stats: CommStats, count: CollectiveCount, device: torch.device) -> None:
        self._stats, self._count = stats, count
        self._sync = device if device.type == "cuda" else None
        if self._sync is not None:  # the host does not wait for a CUDA collective: the device must be idle at both ends
            torch.cuda.synchronize(self._sync)
        self.start = stats.clock()

    def now(self) -> float:
        return self._stats.clock()

    def done(self, blocked_from: float) -> None:
        """The collective completed; the caller was blocked on it since ``blocked_from``."""
        if self._sync is not None:
            torch.cuda.synchronize(self._sync)
        end = self._stats.clock()
        self._stats.add_time(self._count, end - self.start, end - blocked_from)


class _Pending:
    """A torch.distributed work handle waited on with the backend's timeout.

    ``then`` runs once the transfer is complete (the local half of a composed collective),
    inside the timed span.
    """

    def __init__(self, backend: TorchCommBackend, work: Any, what: str, keep: torch.Tensor,
                 then: Callable[[], None] | None = None, timer: _Timer | None = None) -> None:
        self._backend, self._work, self._what, self._then, self._timer = backend, work, what, then, timer
        self._keep: torch.Tensor | None = keep  # the input must outlive the collective

    def wait(self) -> None:
        self.complete(None)

    def complete(self, blocked_from: float | None) -> None:
        """Wait; the caller has been blocked since ``blocked_from`` (``None``: since now)."""
        if self._keep is not None:
            timer = self._timer
            if timer is not None and blocked_from is None:
                blocked_from = timer.now()
            self._backend._wait(self._work, self._what)
            self._keep = None
            self._work = None  # a finished work handle must not outlive its process group (it can abort the exit)
            if self._then is not None:
                self._then()
                self._then = None
            if timer is not None:
                assert blocked_from is not None
                timer.done(blocked_from)
                self._timer = None


class TorchCommBackend(CommBackend):
    """Collectives through ``torch.distributed``, each waited on with the backend's timeout.

    [Note: reduce-scatter on gloo]
    Gloo's reduce-scatter is slow: on two loopback ranks it took 6.6 ms per MiB against
    1.8 ms for an all-reduce of the same buffer and 1.2 ms for an all-to-all (and at
    8 MiB: 21-30 ms against 9.5 and 4.6 ms). So on gloo a reduce-scatter is an
    all-to-all (each rank receives every peer's copy of its own slice, which is exactly
    the bytes a ring reduce-scatter moves) followed by a local sum over the ranks, in
    rank order. It needs one transient receive buffer of the input's size. NCCL keeps
    its native reduce-scatter.

    [Note: all-gather on gloo]
    Gloo's all-gather is slower than its all-to-all too: on two loopback ranks (2 CPU
    cores) an all-gather into 8.8 MiB took 7.5-8.2 ms against 6.3 ms for an all-to-all
    whose input is this rank's shard repeated once per rank (the copy included), and into
    147 MiB 160-166 ms against 105 ms; at four ranks 15.9 against 13.5 ms and 291 against
    185 ms. So on gloo an all-gather is that all-to-all: each rank sends its shard to every
    peer, exactly the bytes a ring all-gather sends, and receives the shards rank-major,
    which is the all-gather's output. It needs one transient send buffer of the output's
    size, pooled like the reduce-scatter's receive buffer. NCCL keeps its native all-gather.

    [Note: two ranks on gloo]
    At two ranks both all-to-alls send nothing to the rank itself (a split of 0): the
    all-gather sends its input as it is and receives the peer's shard straight into the
    peer's row of the output, then copies its own shard into its row; the reduce-scatter
    sends the peer's slice of its input as it is and adds the peer's copy of its own slice
    to its own (``a + b`` is ``b + a`` in floating point, so the result is bit for bit the
    sum in rank order; into a wider output, 16-bit gradients into fp32, the sum is taken in
    the output's dtype, as ``torch.sum`` takes it). No send buffer, no copy of the rank's
    own block through gloo: for 12.4 MB on two loopback ranks, 10.4-10.9 ms against
    14.5-14.7 ms per all-gather and 9.0-9.8 against 14.4-14.8 ms per reduce-scatter.

    Every call runs asynchronously and is then waited on with ``timeout``, so a peer that
    died or took another code path turns into a :class:`~zero_core.CollectiveTimeoutError`
    naming the collective, not a hang. With ``group=None`` and no initialised process
    group the backend serves a single process and sends nothing.
    """

    name = "torch"

    def __init__(self, group: Any = None, *, timeout: timedelta = timedelta(minutes=5)) -> None:
        super().__init__(group, timeout=timeout)
        self._distributed = dist.is_available() and dist.is_initialized() and group is not None
        self._rank = dist.get_rank(group) if self._distributed else 0
        self._world = dist.get_world_size(group) if self._distributed else 1
        backend = dist.get_backend(group) if self._distributed else "gloo"
        # See [Note: reduce-scatter on gloo] and [Note: all-gather on gloo].
        self._reduce_scatter_by_all_to_all = backend == "gloo"
        self._all_gather_by_all_to_all = backend == "gloo"
        self._receive_buffers = BufferPool()  # thread-safe: buffers come back from the reduction waiter's thread
        # See [Note: control messages on the host]: the group they go over (made at the first one where it is a
        # gloo twin of an NCCL-only group) and the device of their tensors.
        self._host_twin = self._distributed and self._world > 1 and self._needs_host_twin(backend)
        self._control_group: Any = None if self._host_twin else self.group
        self._control_device = (torch.device("cuda", torch.cuda.current_device())
                                if backend == "nccl" and not self._host_twin else torch.device("cpu"))

    # [Note: control messages on the host]
    # Besides gathers and reductions the runtime sends small control messages: which all-gather comes next at
    # stage 3 (``agree_min``), its tagged lockstep rounds (``agree_max``), which parameters got gradients
    # (``agree_any``, once per backward) and setup metadata (``all_gather_object``). Each is read on the host as
    # soon as it lands. Over an NCCL-only group (``init_process_group("nccl")``) its tensor would be on the GPU,
    # and reading it back would wait for everything queued on the device before it: a host-device synchronisation
    # inside the step, several a step at stage 3, each draining the queue the host had run ahead of. So over such
    # a group they go over a gloo twin of it (the same ranks, made with the first control message, which every
    # rank of the group sends at the same point; ``use_local_synchronization``: only its members take part),
    # with CPU tensors: no device synchronisation, and no NCCL call the reductions' stream would queue behind.
    # A group that carries CPU tensors already (gloo, or ``"cpu:gloo,cuda:nccl"``, what torch makes when
    # ``init_process_group`` is given no backend) sends them itself. Where gloo is not built in, they stay on
    # the GPU as before.

    @staticmethod
    def _needs_host_twin(backend: str) -> bool:
        """Whether a group of this backend carries no CPU tensors (NCCL alone) and gloo can stand in for it."""
        return backend == "nccl" and dist.is_gloo_available()

    def _control(self) -> Any:
        """The group control messages go over (see [Note: control messages on the host])."""
        group = self._control_group
        if group is None:
            ranks = dist.get_process_group_ranks(self.group)
            try:
                group = dist.new_group(ranks, backend="gloo", timeout=self.timeout, use_local_synchronization=True)
            except RuntimeError as err:  # the store's barrier timed out (DistStoreError is one), or gloo failed
                raise CollectiveTimeoutError(
                    f"making the gloo group of ranks {ranks} for control messages (see zero_comm._torch_backend) on "
                    f"rank {self._rank} of {self._world} did not complete within {self.timeout.total_seconds():.0f}s "
                    f"or failed: {err}. Another rank probably raised an error or died before its first control "
                    "message; look at the other ranks' output first. If gloo cannot connect between the nodes, set "
                    "GLOO_SOCKET_IFNAME, or initialise with init_process_group(\"cpu:gloo,cuda:nccl\")."
                ) from err
            self._control_group = group
        return group

    def free(self) -> None:
        self._receive_buffers = BufferPool()

    @property
    def buffer_bytes(self) -> int:
        """The pooled send and receive buffers of gloo's all-to-all all-gathers and reduce-scatters."""
        pool = self._receive_buffers
        return pool.nbytes + pool.lent

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as err:
            raise CollectiveTimeoutError(
                f"{what} on rank {self._rank} of {self._world} did not complete within "
                f"{self.timeout.total_seconds():.0f}s or failed: {err}. Another rank probably raised an error, "
                "died, or issued a different collective; look at the other ranks' output first."
            ) from err

    def _finish(self, work: Any, what: str, keep: torch.Tensor, async_op: bool, timer: _Timer | None,
                then: Callable[[], None] | None = None) -> Pending | None:
        """Hand back the in-flight collective, or wait for it here (with the timeout)."""
        pending = _Pending(self, work, what, keep=keep, then=then, timer=timer)
        if async_op:
            return pending
        pending.complete(None if timer is None else timer.start)  # a blocking call blocks from its start
        return None

    def _complete(self, work: Any, what: str, timer: _Timer | None) -> None:
        """Wait for a blocking collective (with the timeout) and time it."""
        self._wait(work, what)
        if timer is not None:
            timer.done(timer.start)

    def _record(self, kind: CollectiveKind, payload_bytes: int, device: torch.device,
                bytes_as: CollectiveKind | None = None) -> _Timer | None:
        """Count one collective (its bytes sent the way ``bytes_as`` sends them); start its timer if timed."""
        stats = self.stats
        count = stats.record(kind, ring_bytes_sent(bytes_as or kind, payload_bytes, self._world), payload_bytes=payload_bytes)
        return _Timer(stats, count, device) if stats.times(device) else None

    def _peer_splits(self, numel: int) -> list[int]:
        """Two ranks: ``numel`` elements to and from the peer, none to this rank itself."""
        splits = [numel, numel]
        splits[self._rank] = 0
        return splits

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Pending | None:
        if output.numel() != input.numel() * self._world:
            raise CommError(
                f"all_gather output has {output.numel()} elements, expected world_size x input = "
                f"{self._world} x {input.numel()}"
            )
        if self._world == 1:
            output.copy_(input)
            return None
        timer = self._record(CollectiveKind.ALL_GATHER, output.numel() * output.element_size(), output.device)
        what = f"all_gather of {output.numel()} elements"
        # [Note: two ranks on gloo]; an all-to-all moves one dtype, so a cast gather takes the general path (which
        # casts into its send buffer)
        if self._all_gather_by_all_to_all and self._world == 2 and input.dtype == output.dtype:
            rows, splits = output.view(2, -1), self._peer_splits(input.numel())
            rows[self._rank].copy_(input.reshape(-1))
            work = dist.all_to_all_single(rows[1 - self._rank], input.reshape(-1), output_split_sizes=splits,
                                          input_split_sizes=splits, group=self.group, async_op=True)
            return self._finish(work, what, input, async_op, timer)
        if self._all_gather_by_all_to_all:
            pool = self._receive_buffers  # the one it came from, even if free() replaces it meanwhile
            send = pool.take(output.numel(), output.dtype, output.device, zeroed=False)
            send.view(self._world, -1).copy_(input.reshape(1, -1).expand(self._world, -1))
            work = dist.all_to_all_single(output, send, group=self.group, async_op=True)
            return self._finish(work, what, send, async_op, timer, then=lambda: pool.give(send))
        work = _all_gather_single(output, input, group=self.group, async_op=True)
        return self._finish(work, what, input, async_op, timer)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Pending | None:
        check_reduce_scatter_sizes(output, input, self._world)
        if self._world == 1:
            output.copy_(input)
            return None
        timer = self._record(CollectiveKind.REDUCE_SCATTER, input.numel() * input.element_size(), input.device)
        what = f"reduce_scatter of {input.numel()} elements"
        if self._reduce_scatter_by_all_to_all and self._world == 2:  # [Note: two ranks on gloo]
            pool = self._receive_buffers  # the one it came from, even if free() replaces it meanwhile
            rows, splits = input.contiguous().view(2, -1), self._peer_splits(output.numel())
            received = pool.take(output.numel(), input.dtype, input.device, zeroed=False)
            work = dist.all_to_all_single(received, rows[1 - self._rank], output_split_sizes=splits,
                                          input_split_sizes=splits, group=self.group, async_op=True)

            def add_peer() -> None:
                if output.dtype == received.dtype:
                    torch.add(rows[self._rank], received, out=output.view(-1))
                else:  # a wider output (16-bit gradients into fp32): summed in its dtype, as torch.sum does
                    output.view(-1).copy_(rows[self._rank]).add_(received)
                pool.give(received)

            return self._finish(work, what, rows, async_op, timer, then=add_peer)
        if self._reduce_scatter_by_all_to_all:
            # reused: a fresh multi-megabyte buffer every step costs page faults and heap growth
            pool = self._receive_buffers  # the one it came from, even if free() replaces it meanwhile
            received = pool.take(input.numel(), input.dtype, input.device, zeroed=False)
            work = dist.all_to_all_single(received, input.contiguous(), group=self.group, async_op=True)

            def add_up() -> None:
                torch.sum(received.view(self._world, -1), dim=0, out=output.view(-1))
                pool.give(received)

            return self._finish(work, what, input, async_op, timer, then=add_up)
        work = _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return self._finish(work, what, input, async_op, timer)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, output_splits: Sequence[int],
                   input_splits: Sequence[int]) -> None:
        world = self._world
        if len(input_splits) != world or len(output_splits) != world or sum(input_splits) != input.numel() \
                or sum(output_splits) != output.numel():
            raise CommError(
                f"all_to_all splits do not fit: input {input.numel()} elements in {list(input_splits)}, output "
                f"{output.numel()} in {list(output_splits)}, one split per rank ({world})")
        if world == 1:
            output.copy_(input)
            return
        size = input.element_size()
        # bytes this rank sends: everything but its own split (which stays here)
        sent = (input.numel() - input_splits[self._rank]) * size
        stats = self.stats
        count = stats.record(CollectiveKind.ALL_TO_ALL, sent, payload_bytes=input.numel() * size)
        timer = _Timer(stats, count, input.device) if stats.times(input.device) else None
        work = dist.all_to_all_single(output, input, output_split_sizes=list(output_splits),
                                      input_split_sizes=list(input_splits), group=self.group, async_op=True)
        self._complete(work, f"all_to_all of {input.numel()} elements (a whole-tensor optimizer step)", timer)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        if op not in _OPS:
            raise CommError(f"all_reduce op must be one of {sorted(_OPS)}, got {op!r}")
        if self._world == 1:
            return
        timer = self._record(CollectiveKind.ALL_REDUCE, tensor.numel() * tensor.element_size(), tensor.device)
        work = dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=True)
        self._complete(work, f"all_reduce({op}) of {tensor.numel()} elements", timer)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self._world == 1:
            return
        timer = self._record(CollectiveKind.BROADCAST, tensor.numel() * tensor.element_size(), tensor.device)
        global_src = dist.get_global_rank(self.group, src) if self.group is not dist.group.WORLD else src
        work = dist.broadcast(tensor, src=global_src, group=self.group, async_op=True)
        self._complete(work, f"broadcast of {tensor.numel()} elements from rank {src}", timer)

    def agree_min(self, value: int) -> int:
        if self._world == 1:
            return value
        timer = self._record(CollectiveKind.CONTROL, 8, self._control_device, bytes_as=CollectiveKind.ALL_REDUCE)
        t = torch.tensor([value], dtype=torch.int64, device=self._control_device)
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._control(), async_op=True)
        self._complete(work, "agreement on the next all-gather", timer)
        return int(t.item())

    def agree_max(self, values: torch.Tensor) -> torch.Tensor:
        if self._world == 1:
            return values.clone()
        values = values.to(self._control_device, dtype=torch.int64, copy=True)
        timer = self._record(CollectiveKind.CONTROL, values.numel() * 8, self._control_device,
                             bytes_as=CollectiveKind.ALL_REDUCE)
        work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._control(), async_op=True)
        self._complete(work, "a tagged agreement between the ranks (lockstep round or next all-gather)", timer)
        return values.cpu()

    def agree_any(self, flags: torch.Tensor) -> torch.Tensor:
        if self._world == 1:
            return flags
        flags = flags.to(self._control_device, dtype=torch.uint8)
        timer = self._record(CollectiveKind.CONTROL, flags.numel(), self._control_device, bytes_as=CollectiveKind.ALL_REDUCE)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._control(), async_op=True)
        self._complete(work, "agreement on which parameters got gradients", timer)
        return flags.cpu()

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self._world == 1:
            return [obj]
        # Objects are small setup metadata; count the call, not the pickled bytes (it is timed as one collective).
        timer = self._record(CollectiveKind.OBJECT, 0, self._control_device)
        # torch's all_gather_object waits with the process group's default timeout (30 minutes), not ours: the
        # pickled bytes travel as two tensor all-gathers (lengths, then the padded bytes), each waited on here.
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self._control_device)
        lengths = torch.empty(self._world, dtype=torch.int64, device=self._control_device)
        what = f"object all-gather (setup or checkpoint metadata, {data.numel()} bytes)"
        work = _all_gather_single(lengths, torch.tensor([data.numel()], device=self._control_device),
                                      group=self._control(), async_op=True)
        self._wait(work, what)
        width = int(lengths.max().item())
        padded = torch.zeros(width, dtype=torch.uint8, device=self._control_device)
        padded[: data.numel()] = data
        out = torch.empty(width * self._world, dtype=torch.uint8, device=self._control_device)
        self._complete(_all_gather_single(out, padded, group=self._control(), async_op=True), what, timer)
        rows = out.view(self._world, width).cpu()
        return [pickle.loads(rows[r, : int(n)].numpy().tobytes()) for r, n in enumerate(lengths.tolist())]
