"""Run a function on N ranks in separate processes, with a timeout.

``run_distributed(fn, world_size, *args)`` starts one process per rank (forked from a
forkserver that has already imported torch, so a start costs well under a second),
joins them into a process group through a file rendezvous, runs ``fn`` on each
and returns the per-rank results. If any rank raises, the others get a short grace
period and are then killed, and :class:`DistributedTestError` carries every failing
rank's traceback. Nothing waits longer than ``timeout``.

``fn`` must be importable by name (a module-level function in an installed module),
because the ranks are separate processes.

[Note: the device under test]
``ZERO_TEST_DEVICE`` picks the device the ranks compute on: ``cpu``, ``cuda``, or ``auto``
(the default: ``cuda`` where torch sees a GPU). On ``cpu`` the ranks do not see the GPUs
at all (``CUDA_VISIBLE_DEVICES`` is emptied), so zero's own default device is the CPU too.
On ``cuda`` rank r uses GPU ``r mod count``; the process group is NCCL when there are as
many GPUs as ranks, else gloo, which moves CUDA tensors through host memory for the
collectives it supports on them (see :func:`backend_for`). Tests put their inputs on
:func:`rank_device` and compare values on the CPU. CUDA ranks run with
``torch.use_deterministic_algorithms``: the tests that resume a checkpoint compare bits, and
CUDA's default embedding backward adds with atomics in any order. Before the test runs, a CUDA
rank makes cuBLAS's workspaces (a linear layer's forward and backward in each dtype): they
are made at a thread's first matrix product and then stay, so a test's first step would
otherwise count tens of MiB that no CPU run has (a device budget sized for the model does
not hold them; see ``zero_offload.MemoryTracer``).

[Note: cores of a test process]
Each rank gets :func:`threads_per_rank` intra-op threads: the cores the test process may use,
split over the ranks. Where several test processes share a machine (pytest-xdist's workers),
each may use only its share: torch's OpenMP threads spin while they wait for each other, so
more threads than free cores burn the cores other processes need. Measured on 2 cores under
load: the zoo trained at every stage in one process took 28-33 s and 9 CPU-seconds with 2
threads, 2-4 s and under 1 CPU-second with 1. The suite's conftest sets ``ZERO_TEST_CORES``
to a worker's share (the machine's cores over the workers) and the worker's own thread count
to match; unset, a test process may use every core.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["DistributedTestError", "backend_for", "device_under_test", "rank_device", "process_cores", "run_distributed",
           "threads_per_rank"]

# what every spawned rank imports (the rank function unpickles zero_core.testing; torch.optim imports torch._dynamo at
# the first step): imported once in the fork server rather than again in each rank (see tests/conftest.py)
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "zero_core", "zero_core.testing"]


class DistributedTestError(AssertionError):
    """One or more ranks failed, died or did not finish in time."""


def device_under_test() -> str:
    """``"cpu"`` or ``"cuda"``: see [Note: the device under test]."""
    wanted = os.environ.get("ZERO_TEST_DEVICE", "auto").strip().lower() or "auto"
    if wanted not in ("auto", "cpu", "cuda"):
        raise ValueError(f"ZERO_TEST_DEVICE must be 'auto', 'cpu' or 'cuda', got {wanted!r}")
    import torch

    if wanted == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("ZERO_TEST_DEVICE=cuda but torch.cuda.is_available() is False; unset it or use 'cpu'")
    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return wanted


def rank_device() -> Any:
    """This rank's ``torch.device``: its GPU when the device under test is CUDA, else the CPU."""
    import torch

    if device_under_test() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend_for(device: str, world_size: int, gpus: int) -> str:
    """NCCL needs a GPU of its own per rank; with fewer GPUs the ranks share them over gloo."""
    return "nccl" if device == "cuda" and world_size <= gpus else "gloo"


def process_cores() -> int:
    """Cores this test process may use: ``ZERO_TEST_CORES`` where set, else all of the machine's.

    See [Note: cores of a test process].
    """
    value = os.environ.get("ZERO_TEST_CORES", "").strip()
    if not value:
        return os.cpu_count() or 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"ZERO_TEST_CORES must be a whole number of cores, at least 1; got {value!r}")
    return int(value)


def threads_per_rank(world_size: int) -> int:
    """Intra-op threads each rank gets: the test process's cores split evenly (kernels' sum order depends on it)."""
    return max(1, process_cores() // world_size)


def _context() -> multiprocessing.context.ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _make_cuda_workspaces() -> None:
    """A linear layer's forward and backward in each floating dtype: cuBLAS and cuBLASLt make their workspaces
    for this thread and autograd's (see [Note: the device under test])."""
    import torch

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.ones(8, 8, device="cuda", dtype=dtype, requires_grad=True)
        torch.nn.functional.linear(x, x, x[0]).sum().backward()
    torch.cuda.synchronize()


def _rank_main(
    fn: Callable[..., Any], rank: int, world_size: int, init_file: str, backend: str | None, device: str,
    timeout: float, threads: int, env: dict[str, str], results: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
) -> None:
    # A rank killed by a signal (a C++ abort, a segfault) reports nothing through the queue: its Python stack at least
    # goes to stderr (the forkserver's, which the ranks inherit).
    faulthandler.enable()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), ZERO_TEST_DEVICE=device)
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read at CUDA's first use, which has not happened in this process
    else:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic cuBLAS needs
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            torch.use_deterministic_algorithms(True, warn_only=True)
            _make_cuda_workspaces()
        if backend is None:
            backend = backend_for(device, world_size, torch.cuda.device_count() if device == "cuda" else 0)
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        value = fn(*args, **kwargs)
        # Plain pickle copies tensor bytes; the queue's own pickler would pass shared-memory
        # handles that die with this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report everything, including SystemExit and KeyboardInterrupt
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer may be gone already; the result is what matters
                pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    grace: float = 5.0,
    backend: str | None = None,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results in rank order.

    Args:
        timeout: Seconds for the whole run; also the process group's collective timeout.
        grace: Seconds the other ranks get to finish once one rank has failed.
        backend: The process group's backend; ``None`` picks it from the device under test
            (:func:`backend_for`).
        env: Extra environment variables for the ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    device = device_under_test()
    threads = threads_per_rank(world_size)
    results = ctx.Queue()
    done: dict[int, Any] = {}
    failed: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="zero-dist-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, init_file, backend, device, timeout, threads, dict(env or {}), results, args, kwargs),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while len(done) + len(failed) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    rank, ok, payload = results.get(timeout=min(remaining, 0.2))
                except queue.Empty:
                    for rank, p in enumerate(procs):
                        if rank not in done and rank not in failed and p.exitcode is not None and results.empty():
                            failed[rank] = (f"rank {rank} exited with code {p.exitcode} without reporting a result (a negative "
                                                "code is the signal that killed it; its Python stack went to stderr)")
                    if failed:
                        deadline = min(deadline, time.monotonic() + grace)
                    continue
                if ok:
                    done[rank] = pickle.loads(payload)
                else:
                    failed[rank] = payload
                    deadline = min(deadline, time.monotonic() + grace)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
    missing = [r for r in range(world_size) if r not in done and r not in failed]
    if failed or missing:
        parts = [f"--- rank {r} failed ---\n{failed[r]}" for r in sorted(failed)]
        if missing:
            why = "after another rank failed" if failed else f"within {timeout:.0f}s"
            parts.append(f"--- ranks {missing} did not finish {why} and were killed ---")
        raise DistributedTestError(f"{fn.__name__} on {world_size} ranks:\n" + "\n".join(parts))
    return [done[r] for r in range(world_size)]
