"""The memory tracer: non-model data (activations, temporaries) per compute phase, on CPU and CUDA.

[Note: what the tracer measures]
Model data (shards, gathered buffers, gradient buffers, optimizer states) is accounted
exactly by the engine and the tiers; the tracer measures the rest. A step is cut into
*periods* at each compute point (a module about to run forward or backward with some
chunks, :meth:`~zero_core.plugin.PlacementPolicy.before_compute`); for each period the tracer
reports the peak non-model bytes seen in it.

- On CPU it counts tensor storage: a ``TorchDispatchMode`` sees every operator the step
  runs, forward and backward, and adds the bytes of each new storage an operator
  returns (not views or in-place results of its inputs), until that storage is freed.
  Operators run by the engine itself (:func:`zero_core.plugin.in_engine_work`)
  allocate model data and are skipped.
- On CUDA it reads the caching allocator: the peak of ``memory_allocated`` since the
  last sample, minus the model data on the device and minus what was *resident* when
  tracing started (the user's other tensors, the CUDA libraries' workspaces already
  made), which the budget does not cover: ``device_budget_mb`` is the room for zero's
  model data and the step's own non-model data, on either device.
  Of the memory the allocator caches without handing it out, only the part it cannot
  give back counts (:attr:`MemoryTracer.fragmented`): before it reports running out it
  releases every cached segment that holds no live block and retries, but a free piece
  of a segment that also holds a live block stays lost. That is the peak of its
  ``inactive_split_bytes`` in the large pool (blocks over 1 MiB; the small pool's 2 MiB
  segments are a bounded, constant loss that the budget's margin covers). Counting all
  cached memory instead doubled the plan of a 200M-parameter GPT on an H200 (1.9 GiB of
  cache on a 1.7 GiB peak) and refused models that trained. :attr:`MemoryTracer.cached_free`
  reports the most it cached.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zero_core.plugin import LiveBytes, in_engine_work

__all__ = ["MemoryTracer"]


class _StorageCounter(LiveBytes):
    """Live bytes of the storages operators created outside the engine's own work."""

    def counts(self) -> bool:
        return not in_engine_work()


class MemoryTracer:
    """Measures non-model data between samples. See [Note: what the tracer measures].

    Args:
        device: The compute device (CUDA: allocator statistics; else storage counting).
        on_op: Called after every operator while tracing on CPU (an audit hook).
    """

    def __init__(self, device: torch.device, *, on_op: Callable[[], None] | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._on_op = on_op
        self._mode: _StorageCounter | None = None
        #: CUDA: the most memory the allocator held beyond what was allocated, at any sample (0 on CPU); reported only.
        self.cached_free = 0
        #: CUDA: non-model bytes already allocated when tracing started (left out of every figure).
        self.resident = 0
        #: CUDA: the most cached memory the allocator could not release (split large segments), at any sample.
        self.fragmented = 0

    @property
    def active(self) -> bool:
        return self._mode is not None or (self.cuda and self._started)

    _started = False

    def start(self, model_bytes: int = 0) -> None:
        """Begin tracing; ``model_bytes`` is the model data on the device now (CUDA: what is allocated beyond it
        is resident and left out)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.resident = max(0, torch.cuda.memory_allocated(self.device) - model_bytes)
            self._started = True
            return
        if self._mode is None:
            self._mode = _StorageCounter(self._on_op)
            self._mode.__enter__()

    def stop(self) -> None:
        self._started = False
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def live(self, model_bytes: int = 0) -> int:
        """Non-model bytes now (CUDA: allocated minus ``model_bytes``, the model data on the device, and the resident bytes)."""
        if self.cuda:
            return max(0, torch.cuda.memory_allocated(self.device) - model_bytes - self.resident)
        return self._mode.live if self._mode is not None else 0

    def sample(self, model_bytes: int = 0, *, synchronize: bool = True) -> int:
        """The peak non-model bytes since the last sample; starts a new period.

        On CUDA ``synchronize=False`` reads the allocator's figures without waiting for the device: they are
        kept by the host as it allocates and frees, so only frees that wait on another stream's work show late
        (which makes the figure larger, never smaller). For the watch of later steps, which must not stall them.
        """
        if self.cuda:
            if synchronize:
                torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - model_bytes - self.resident
            held = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            self.cached_free = max(self.cached_free, held)
            split = torch.cuda.memory_stats(self.device).get("inactive_split_bytes.large_pool.peak", 0)
            self.fragmented = max(self.fragmented, split)
            torch.cuda.reset_peak_memory_stats(self.device)
            return max(0, peak)
        if self._mode is None:
            return 0
        peak, self._mode.peak = self._mode.peak, self._mode.live
        return peak
