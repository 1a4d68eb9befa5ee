"""Host memory per parameter: what a system keeps in host memory for each parameter it trains (issue 48, item 4).

[Note: host bytes per parameter]
Two figures, taken over the same window (building the model, setting the system up, its
first training step and ``zero_grad``):

- *tensor bytes*: the host storages (pinned or not) that operators created in the window
  and that are still alive at its end, at the size they hold then, counted exactly
  (:meth:`zero_core.plugin.LiveBytes.held` restricted to the CPU). This is what the system
  holds by design: fp32 master parameters and AdamW's two moments are 12 bytes per
  parameter; gradients kept on the host add 2 (bf16) or 4 (fp32). Zero-dimensional
  tensors made from Python numbers (AdamW's step counters) are not made by an operator
  and are left out: a few bytes per parameter *tensor*, not per parameter.
- *resident bytes*: the growth of the process's resident set over the window, at its end
  and at its peak (the kernel's high-water mark, reset when the window opens; None where
  it cannot be reset). It adds what tensor sizes leave out: the CUDA host allocator
  rounding pinned blocks up and caching them, malloc's slack, the CUDA libraries' own
  buffers, and the peak's transient buffers (gradients on their way to the optimizer).

The first is exact and is what a test checks; the second is what the machine pays, and
what sets the largest model a host holds. Both are divided by the parameters trained.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from zero_core.plugin import LiveBytes

__all__ = ["HostGrowth", "host_growth", "resident_bytes"]


def resident_bytes() -> int | None:
    """The process's resident set in bytes now (Linux ``/proc/self/statm``); None where there is none."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _peak_resident_bytes() -> int | None:
    """The resident set's high-water mark (``VmHWM``) in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_peak_resident() -> bool:
    """Set the high-water mark to the resident set now (Linux: ``5`` into ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


@dataclass
class HostGrowth:
    """What :func:`host_growth` measured. See [Note: host bytes per parameter].

    Attributes:
        tensor_bytes: Bytes the host storages created in the window hold at its end (exact).
        peak_tensor_bytes: The most those storages held at once during the window (exact: gradients on their way
            to the optimizer, a gathered copy, ...).
        resident_bytes: Growth of the resident set over the window (None without ``/proc``).
        peak_resident_bytes: Growth of the resident set's high-water mark over the window (None where it
            cannot be reset).
    """

    tensor_bytes: int = 0
    peak_tensor_bytes: int = 0
    resident_bytes: int | None = None
    peak_resident_bytes: int | None = None

    def per_param(self, params: int) -> dict[str, float | None]:
        """The figures over ``params`` parameters, as a benchmark row's fields."""

        def per(value: int | None) -> float | None:
            return None if value is None else round(value / params, 3)

        return {"host_B_per_param": per(self.tensor_bytes), "host_peak_B_per_param": per(self.peak_tensor_bytes),
                "host_rss_B_per_param": per(self.resident_bytes),
                "host_peak_rss_B_per_param": per(self.peak_resident_bytes)}


@contextmanager
def host_growth() -> Iterator[HostGrowth]:
    """Measure the host memory the code inside keeps: ``with host_growth() as grown: ...``, then read ``grown``.

    The figures are filled in when the block ends (also when it raises). The counting costs Python time per
    operator: measure a step that is not timed.
    """
    gc.collect()
    before = resident_bytes()
    peak_known = before is not None and _reset_peak_resident()
    counter = LiveBytes(device_type="cpu")
    grown = HostGrowth()
    try:
        with counter:
            yield grown
    finally:
        gc.collect()  # tensors dropped in reference cycles inside the window are not kept
        after, peak = resident_bytes(), _peak_resident_bytes()
        grown.tensor_bytes = counter.held()
        grown.peak_tensor_bytes = counter.peak
        if before is not None and after is not None:
            grown.resident_bytes = after - before
            if peak_known and peak is not None:
                grown.peak_resident_bytes = peak - before
