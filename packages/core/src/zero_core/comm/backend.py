"""The comm backend interface: the collectives a shard strategy needs, over one process group.

A backend is a thin wrapper over ``torch.distributed``; the runtime calls it only from
:mod:`zero_core.chunks._collectives` and :mod:`zero_core.comm._agreement` (see [Note: two planes of
collectives]). What it counts lives beside it, in :mod:`zero_core.comm._comm_stats` (re-exported
here, where plugins have always found it): bytes follow the ring convention and timing
follows [Note: collective timing] there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from zero_core.base.errors import CommError
from zero_core.comm._comm_stats import CollectiveCount, CollectiveKind, CommStats, ring_bytes_sent

if TYPE_CHECKING:
    from zero_core.config.api import ZeroConfig

__all__ = ["CollectiveCount", "CollectiveKind", "CommBackend", "CommStats", "Pending", "ring_bytes_sent"]


class Pending(Protocol):
    """An asynchronous collective in flight.

    A backend that has already copied a reduce-scatter's input (into a bucket) may set
    ``input_released = True`` on the pending it returns; the caller may then reuse the
    input at once instead of keeping it until :meth:`wait`.
    """

    def wait(self) -> None:
        """Block until it completes (raising on timeout or failure)."""


class _ClosedGroup:
    """Stands for the process group of a closed backend: any collective given it fails at once."""

    def __repr__(self) -> str:
        return "<process group of a closed zero engine>"


class CommBackend(ABC):
    """Collectives over one process group, with counters and a timeout on every call.

    Implementations are constructed by the engine with the process group (``None``
    for the default group, or when running a single process) and a timeout. Inputs
    and outputs are flat, contiguous tensors; ``all_gather`` concatenates the ranks'
    inputs in rank order into ``output`` and ``reduce_scatter`` leaves rank ``r``
    the ``r``-th equal slice of the reduced input.

    Subclass :class:`zero_core.testing.CommBackendConformance` to test a backend.
    """

    name: ClassVar[str]

    def __init__(self, group: Any = None, *, timeout: timedelta = timedelta(minutes=5)) -> None:
        self.group = group
        self.timeout = timeout
        self.stats = CommStats()

    @classmethod
    def from_config(cls, group: Any, *, timeout: timedelta, config: ZeroConfig) -> CommBackend:
        """How :func:`zero_core.shard` builds the backend; override to read options from ``config``."""
        return cls(group, timeout=timeout)

    @classmethod
    def estimate_reduce_scatter_calls(cls, shard_numels: Sequence[int], *, element_size: int, world_size: int,
                                      config: ZeroConfig) -> int:
        """Reduce-scatter calls one step makes for gradients of these shard sizes (in reduction order).

        For :func:`zero_core.estimate`; a backend that merges or splits reduce-scatters
        overrides it. The default: one call per chunk.
        """
        return len(shard_numels)

    def flush(self) -> None:
        """Issue every reduce-scatter the backend still holds back, and complete them all.

        The engine calls it on every rank at the end of each backward, before it reads the
        reduced gradients. Backends that run each collective when asked need nothing here;
        bucketing backends launch their partial buckets.
        """

    def free(self) -> None:
        """Release buffers the backend keeps between steps (they are re-allocated on next use)."""

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the buffers the backend holds now (send and receive buffers, buckets; idle or in use), on the
        device of the tensors it carries. The engine counts them with its own buffers (placement policies budget
        them). A backend that keeps no buffers of its own leaves it 0."""
        return 0

    def expect_reduce_scatters(self, numels: Sequence[int]) -> None:
        """The elements per rank of the reduce-scatters one backward may ask for (an upper bound), told once by
        :func:`zero_core.shard`. A bucketing backend never makes a bucket larger than all of them together; the
        default ignores it."""

    def close(self) -> None:
        """Release the buffers and the reference to the process group; the backend cannot communicate afterwards.

        The engine calls it from ``close()``, so that ``torch.distributed.destroy_process_group()``
        frees the group at once instead of at interpreter exit.
        """
        self.free()
        self.group = _ClosedGroup()

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank in the group."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of ranks in the group."""

    @abstractmethod
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Pending | None:
        """Gather every rank's ``input`` into ``output`` (``world_size * input.numel()``).

        With ``async_op=True`` return a :class:`Pending` to wait on before reading ``output``.
        """

    @abstractmethod
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Pending | None:
        """Sum ``input`` over ranks and keep this rank's slice in ``output``.

        With ``async_op=True`` return a :class:`Pending` to wait on; ``input`` must stay
        alive and unchanged until then.
        """

    # [Note: collectives that may be lossy]
    # The runtime sends parameters for compute and gradients for reduction through the two methods below, and
    # everything else (master values for checkpoints and inspection, optimizer pieces, the kept post-forward copies,
    # the replicas' master shards, setup broadcasts) through the exact collectives above. A backend that communicates
    # lossily (zero-comm-quantized sends int8 blocks with their scales) overrides only these two, so a master value
    # never passes through a lossy collective; the defaults are the exact collectives. Every rank must take the same
    # path for the same call (the runtime decides by call site, never by rank-local state), or the payloads differ
    # in size.
    def all_gather_params(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Pending | None:
        """:meth:`all_gather` of parameter values for forward and backward (stage 3's gathers, stages 1 and 2's
        after-step refresh): see [Note: collectives that may be lossy]. ``input`` may be this rank's row of
        ``output`` (a gather in place), whose values the call must then leave as they are (they may be the master
        values). Defaults to :meth:`all_gather`."""
        return self.all_gather(output, input, async_op=async_op)

    @property
    def params_exact(self) -> bool:
        """Whether :meth:`all_gather_params` delivers the inputs exactly (:meth:`params_exact_at` this world size). A
        backend that says no makes every chunk keep its master shard apart from the full buffer it gathers into, also
        at stages 1 and 2 in one dtype, where that buffer would otherwise hold the masters (and reading them would
        read the lossy copies)."""
        return self.params_exact_at(self.world_size)

    @classmethod
    def params_exact_at(cls, world_size: int) -> bool:
        """Whether :meth:`all_gather_params` over ``world_size`` ranks delivers the inputs exactly; for
        :func:`zero_core.estimate` too. The default: always."""
        return True

    @classmethod
    def estimate_bytes_sent(cls, kind: CollectiveKind, numel_per_rank: int, *, element_size: int, world_size: int,
                            config: ZeroConfig) -> int:
        """Bytes one rank sends in one :meth:`all_gather_params` (``kind`` ALL_GATHER: ``numel_per_rank`` elements
        from each rank) or :meth:`reduce_scatter_grads` (REDUCE_SCATTER: ``numel_per_rank`` elements to each rank),
        as :attr:`stats` counts them; for :func:`zero_core.estimate`. The default is the ring convention on the
        full payload; a backend that sends other bytes (a lossy one) overrides it."""
        return ring_bytes_sent(kind, numel_per_rank * world_size * element_size, world_size)

    def reduce_scatter_grads(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Pending | None:
        """:meth:`reduce_scatter` of gradients: see [Note: collectives that may be lossy]. Defaults to
        :meth:`reduce_scatter`."""
        return self.reduce_scatter(output, input, async_op=async_op)

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """Reduce ``tensor`` in place over ranks with ``op`` (``sum`` or ``max``)."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Copy ``tensor`` from rank ``src`` to every rank, in place."""

    @abstractmethod
    def agree_min(self, value: int) -> int:
        """The minimum of ``value`` over ranks (counted as :attr:`CollectiveKind.CONTROL`)."""

    @abstractmethod
    def agree_any(self, flags: torch.Tensor) -> torch.Tensor:
        """Elementwise OR of a 1-D ``uint8`` tensor over ranks (counted as :attr:`CollectiveKind.CONTROL`)."""

    def agree_max(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum of a 1-D ``int64`` CPU tensor over ranks, as a new CPU tensor.

        The runtime's tagged control messages use it (see [Note: lockstep rounds] in
        ``zero_core.comm._lockstep``). This default is one :meth:`all_reduce` (``max``), counted as the
        backend counts all-reduces; a backend overrides it to count it as
        :attr:`CollectiveKind.CONTROL`.
        """
        out = values.clone()
        if self.world_size > 1:
            self.all_reduce(out, op="max")
        return out

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, output_splits: Sequence[int],
                   input_splits: Sequence[int]) -> None:
        """Send ``input``'s ``input_splits[j]`` elements (in rank order) to rank ``j``; receive into ``output``
        rank ``i``'s ``output_splits[i]`` elements, in rank order. Blocking; 1-D tensors of one dtype.

        Whole-tensor optimizer steps use it (see [Note: whole-tensor optimizer steps] in
        ``zero_core.runtime._whole_step``). This default is built from :meth:`all_gather` and
        :meth:`agree_max` (every rank's padded send buffer reaches every rank, ``world_size`` times
        the bytes of a native all-to-all); a backend over a transport with an all-to-all overrides it.
        """
        world, rank = self.world_size, self.rank
        if len(input_splits) != world or len(output_splits) != world:
            raise CommError(f"all_to_all needs one split per rank ({world}), got {len(input_splits)} and "
                            f"{len(output_splits)}")
        if world == 1:
            output.copy_(input)
            return
        width = int(self.agree_max(torch.tensor([max(input_splits)], dtype=torch.int64))[0])
        send = torch.zeros(world, width, dtype=input.dtype, device=input.device)
        at = 0
        for j, n in enumerate(input_splits):
            send[j, :n] = input[at:at + n]
            at += n
        everyone = torch.empty(world, world, width, dtype=input.dtype, device=input.device)
        self.all_gather(everyone.view(-1), send.view(-1))
        at = 0
        for i, n in enumerate(output_splits):
            output[at:at + n] = everyone[i, rank, :n]
            at += n

    @abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather a small picklable object from every rank, in rank order."""
