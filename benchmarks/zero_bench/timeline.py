"""A memory timeline of one step on one rank: what the process holds, what the allocator lends, and
what it is for.

At every module boundary of the step (see :class:`MemoryTimeline`) it reads:

- ``rss``: the resident set (``/proc/self/statm``), what the machine sees;
- ``in_use``: the bytes the allocator has lent out and not had back (glibc's ``mallinfo2``:
  ``uordblks + hblkhd``; ``torch.cuda.memory_allocated`` on CUDA);
- ``held``: what the allocator holds from the system (glibc: ``arena + hblkhd``; CUDA: reserved);
- the system's own accounting by kind (zero's :meth:`Engine.memory_by_kind`, or the parameters,
  gradients and optimizer states of a DDP or FSDP2 rank), each storage counted once.

``other`` (activations and the user's temporaries) is ``in_use`` less the in-use bytes at the
start of the run (the interpreter, torch, the process group) less the accounted kinds.
``slack`` is what the process holds beyond what the allocator lends, above the same point at
the start: freed memory the allocator has not returned. The difference between peak RSS and the
theory (states + activations + baseline) is then ``accounted - states`` (buffers) plus ``slack``.

The step is marked with its phases (``forward``, ``backward``, ``step``), so the plot shows where in
the step each byte is held. Only the one step it samples runs with the thread, so the timed steps
are never slowed by it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MemoryProbe", "MemoryTimeline", "breakdown_at_peak"]

MiB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    """glibc's ``mallinfo2`` (2.33+), or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


class MemoryProbe:
    """Reads the process's resident set and its allocator's in-use and held bytes (MiB)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._mallinfo = None if device.type == "cuda" else _mallinfo2()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._statm = open("/proc/self/statm", "rb", buffering=0) if os.path.exists("/proc/self/statm") else None

    @property
    def allocator(self) -> str | None:
        """Whose in-use bytes these are: ``cuda``, ``glibc``, or None (not measurable here)."""
        return "cuda" if self.device.type == "cuda" else ("glibc" if self._mallinfo is not None else None)

    def rss(self) -> float:
        if self._statm is None:
            return 0.0
        self._statm.seek(0)
        return int(self._statm.read().split()[1]) * self._page / MiB

    def allocator_bytes(self) -> tuple[float | None, float | None]:
        """(in use, held), MiB."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / MiB, torch.cuda.memory_reserved(self.device) / MiB
        if self._mallinfo is None:
            return None, None
        info = self._mallinfo()
        return (info.uordblks + info.hblkhd) / MiB, (info.arena + info.hblkhd) / MiB

    def close(self) -> None:
        if self._statm is not None:
            self._statm.close()
            self._statm = None


class MemoryTimeline:
    """Samples a :class:`MemoryProbe` and an accounting callback at every module boundary of one step.

    Samples are taken on the training thread only: before and after each module's forward
    (global module hooks), when each module output's gradient arrives in backward (a hook on
    the output, which fires as that module's backward begins), around ``optimizer.step()``
    (optimizer hooks) and at each :meth:`mark`: the accounting is read there only, where it
    is consistent (a sampling thread would read the engine's buffers while the training
    thread replaces them). In between, a ticker thread reads the resident set and the
    allocator alone every ``period_s`` (the loss and a large matmul's backward hold the
    step's peak between two boundaries), carrying the kinds of the last boundary.
    """

    def __init__(self, probe: MemoryProbe, accounting: Callable[[], dict[str, int]],
                 optimizer: torch.optim.Optimizer | None = None, *, period_s: float = 0.005) -> None:
        self.probe, self.accounting, self.optimizer, self.period_s = probe, accounting, optimizer, period_s
        self.samples: list[tuple[float, float, float | None, float | None, dict[str, int]]] = []
        self.phases: list[tuple[float, str]] = []
        self._t0 = 0.0
        self._handles: list[Any] = []
        self._kinds: dict[str, int] = {}
        # The probe's file is shared by the training thread's samples and the ticker's.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def sample(self, *_: Any) -> None:
        self._kinds = self.accounting()
        self._read()

    def _read(self) -> None:
        with self._lock:
            in_use, held = self.probe.allocator_bytes()
            self.samples.append((time.perf_counter() - self._t0, self.probe.rss(), in_use, held, self._kinds))

    def _tick(self) -> None:
        # Between module boundaries (inside the loss, a large matmul's backward) the resident set and the allocator
        # are read on their own every ``period_s``, with the kinds of the last boundary: the ticker never touches the
        # engine's objects, which the training thread changes (a reader of those could see a freed buffer).
        while not self._stop.wait(self.period_s):
            self._read()

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.sample()
        if torch.is_grad_enabled():
            for t in (output if isinstance(output, (tuple, list)) else (output,)):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        self.sample()

    def mark(self, phase: str) -> None:
        """The step enters ``phase`` now."""
        self.phases.append((time.perf_counter() - self._t0, phase))
        self.sample()

    def __enter__(self) -> MemoryTimeline:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._t0 = time.perf_counter()
        self._handles = [register_module_forward_pre_hook(lambda m, a: self.sample()),
                         register_module_forward_hook(self._after_forward)]
        if self.optimizer is not None:
            self._handles += [self.optimizer.register_step_pre_hook(lambda *a: self.sample()),
                              self.optimizer.register_step_post_hook(lambda *a: self.sample())]
        self.sample()
        self._ticker = threading.Thread(target=self._tick, name="zero-bench-memory", daemon=True)
        self._ticker.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.sample()

    def as_dict(self, *, start_rss: float, start_in_use: float | None, start_held: float | None = None) -> dict[str, Any]:
        """JSON-ready columns (MiB, seconds since the step began), the kinds as ``by_kind`` columns."""
        kinds = sorted({k for s in self.samples for k in s[4]})
        return {
            "allocator": self.probe.allocator,
            "start_rss_mib": start_rss,
            "start_in_use_mib": start_in_use,
            "start_held_mib": start_held,
            "t_s": [round(s[0], 5) for s in self.samples],
            "rss_mib": [round(s[1], 2) for s in self.samples],
            "in_use_mib": None if start_in_use is None else [round(s[2], 2) for s in self.samples],
            "held_mib": None if start_in_use is None else [round(s[3], 2) for s in self.samples],
            "by_kind_mib": {k: [round(s[4].get(k, 0) / MiB, 2) for s in self.samples] for k in kinds},
            "phases": [[round(t, 5), name] for t, name in self.phases],
        }


STATE_KINDS = ("params", "grads", "optimizer_states")


def breakdown_at_peak(timeline: dict[str, Any]) -> dict[str, float] | None:
    """Where the bytes are at the sample of highest RSS (MiB): the process at start (``baseline``), the model
    states the ZeRO formulas count (``states``), the system's other buffers (``buffers``: gathered chunks,
    gradient buffers in flight, pooled buffers), activations and temporaries (``other``) and memory the
    allocator holds but does not lend (``slack``). They add up to ``rss``. None without in-use figures.

    On CUDA the footprint is the caching allocator's reserved bytes instead of the resident set (``rss``
    then holds reserved device memory), and ``slack`` is reserved but unallocated memory."""
    if not timeline or timeline.get("in_use_mib") is None or not timeline["rss_mib"]:
        return None
    cuda = timeline.get("allocator") == "cuda"
    footprint = timeline["held_mib"] if cuda else timeline["rss_mib"]
    i = max(range(len(footprint)), key=footprint.__getitem__)
    rss, in_use = footprint[i], timeline["in_use_mib"][i]
    kinds = {k: v[i] for k, v in timeline["by_kind_mib"].items()}
    states = sum(v for k, v in kinds.items() if k in STATE_KINDS)
    buffers = sum(v for k, v in kinds.items() if k not in STATE_KINDS)
    base_in_use = timeline["start_in_use_mib"]
    base_rss = (timeline.get("start_held_mib") or 0.0) if cuda else timeline["start_rss_mib"]
    other = in_use - base_in_use - states - buffers
    slack = (rss - base_rss) - (in_use - base_in_use)
    return {"t_s": timeline["t_s"][i], "rss": rss, "baseline": base_rss, "states": states, "buffers": buffers,
            "other": other, "slack": slack, "in_use": in_use, "peak_in_use": max(timeline["in_use_mib"]),
            **{f"kind:{k}": v for k, v in kinds.items()}}
