"""Bytes and calls of the references' collectives, counted the way zero's CommStats counts its own.

DDP launches its all-reduces from C++, so a comm hook (the stock all-reduce hook, wrapped) sees each
bucket. FSDP2 calls ``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` / ``all_reduce``
from Python, so wrapping those module functions sees each of its collectives. Bytes are the ring
volume one rank sends (``zero_core.plugin.ring_bytes_sent``): ``(N-1)/N`` of the full payload for all-gather
and reduce-scatter, twice that for all-reduce.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from zero_core.plugin import CollectiveKind, ring_bytes_sent


class Counter:
    """Calls and bytes sent per collective kind, for the step in progress and each finished one."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.current: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes_sent": 0})
        self.steps: list[dict[str, dict[str, int]]] = []

    def add(self, kind: CollectiveKind, payload_bytes: int) -> None:
        entry = self.current[kind.value]
        entry["calls"] += 1
        entry["bytes_sent"] += ring_bytes_sent(kind, payload_bytes, self.world_size)

    def end_step(self) -> None:
        self.steps.append(dict(self.current))
        self.current.clear()


def count_ddp(model: torch.nn.parallel.DistributedDataParallel, counter: Counter) -> None:
    """Install the stock all-reduce comm hook, counting each bucket it reduces."""

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations, which must not be strings
        buffer = bucket.buffer()
        counter.add(CollectiveKind.ALL_REDUCE, buffer.numel() * buffer.element_size())
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)


@contextlib.contextmanager
def count_fsdp2(counter: Counter) -> Iterator[None]:
    """Count FSDP2's collectives while the context is open."""
    originals = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single", "all_reduce")}

    def all_gather_single(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter.add(CollectiveKind.ALL_GATHER, output.numel() * output.element_size())
        return originals["all_gather_single"](output, input, *args, **kwargs)

    def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter.add(CollectiveKind.REDUCE_SCATTER, input.numel() * input.element_size())
        return originals["reduce_scatter_single"](output, input, *args, **kwargs)

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter.add(CollectiveKind.ALL_REDUCE, tensor.numel() * tensor.element_size())
        return originals["all_reduce"](tensor, *args, **kwargs)

    wrappers = {"all_gather_single": all_gather_single, "reduce_scatter_single": reduce_scatter_single, "all_reduce": all_reduce}
    for name, fn in wrappers.items():
        setattr(dist, name, fn)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
