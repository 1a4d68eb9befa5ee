"""Bytes of the tensors operators create, counted exactly while a mode is on: peaks without an allocator.

Used by the memory tracer of zero-offload (which leaves out what the engine allocates) and by tests and
benchmarks that assert a peak (``zero_core.testing.memory``)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages operators create while the mode is on (zero's own gathers included), and their peak.

    A storage counts from the operator that made it until it is freed; views and in-place results of an
    operator's inputs are not new. Storages that existed before the mode began are not counted, so ``peak``
    is what the code inside added at its worst moment. Exact on any device: it reads storage sizes, not an
    allocator (whose rounding and caching it leaves out). A subclass may leave operators out
    (:meth:`counts`); ``on_change`` is called after every operator counted. ``device_type`` counts the storages
    of that device type only (``"cpu"``: host memory, pinned or not).
    """

    def __init__(self, on_change: Callable[[], None] | None = None, *, device_type: str | None = None) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._on_change = on_change
        self._device_type = device_type

    def counts(self) -> bool:
        """Whether the operator that just ran is counted (all are, here)."""
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.counts():
            return out
        inputs = None
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            if self._device_type is not None and tensor.device.type != self._device_type:
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self._sizes:
                continue
            if inputs is None:
                inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            if key in inputs:
                continue
            self._sizes[key] = storage.nbytes()
            self._storages[key] = weakref.ref(storage)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key)
        if self._on_change is not None:
            self._on_change()
        return out

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._storages.pop(key, None)

    def held(self) -> int:
        """Bytes the counted storages that are still alive hold now. ``live`` counts each at the size it was made
        with; a storage freed in place (``untyped_storage().resize_(0)``, as a released chunk's full buffer is)
        holds nothing here while it still counts there."""
        total = 0
        for ref in list(self._storages.values()):
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        return total
