"""What the whole suite shares: a fork server that has already imported what every spawned rank imports.

``run_distributed`` forks each rank from multiprocessing's fork server, which it starts with torch,
torch.distributed and zero_core imported. zero_core is a lazy package, so each rank still imported
``zero_core.testing`` (torch.distributed.tensor and sympy under it) to unpickle the harness's rank
function, ``torch._dynamo`` at its first ``optimizer.step()`` (torch.optim imports it there) and pytest with
its test module: about 3 s of one core per rank per spawn (measured: 1.6, 1.4 and 0.2 CPU-seconds), more
than the test's own work in most distributed tests, and the suite spawns some hundreds of worlds. Started
here first, the fork server imports them once; ``run_distributed`` reuses a running server (its own preload
list applies only to a server it starts itself). This is speed only: a rank that did not get them imports
them as before.
The HF and Lightning tests' ranks import those libraries too (a few seconds of one core each): a test
module that spawns with one names it in ``SPAWN_PRELOAD``, and one a test module imported at collection
is preloaded as well.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Give each pytest-xdist worker its share of the cores (see [Note: cores of a test process])."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "ZERO_TEST_CORES" not in os.environ:
        cores = max(1, (os.cpu_count() or 1) // workers)
        os.environ["ZERO_TEST_CORES"] = str(cores)
        os.environ.setdefault("OMP_NUM_THREADS", str(cores))  # for the programs the tests start
        import torch

        torch.set_num_threads(cores)


PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "zero_core", "zero_core.testing", "pytest"]
# preloaded when a collected test module has imported them: the ranks it spawns import them again
OPTIONAL = ["transformers", "lightning.pytorch"]


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the fork server when a collected test's module spawns ranks, before the first test runs."""
    modules = {id(m): m for m in (getattr(item, "module", None) for item in session.items) if m is not None}
    if session.config.option.collectonly or not any(hasattr(m, "run_distributed") for m in modules.values()):
        return
    extra = [name for name in OPTIONAL if name in sys.modules]
    for module in modules.values():
        extra += [name for name in getattr(module, "SPAWN_PRELOAD", ()) if name not in extra]
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD + extra)
    # One process forked and joined here waits out the imports, so no test's own timing (the harness tests time
    # a failing and a hanging run) includes them.
    warm = context.Process(target=os.getpid, daemon=True)
    warm.start()
    warm.join()


@pytest.fixture
def fresh_venv(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """A new virtual environment with torch, pytest and pytest-timeout and nothing of this checkout (tests/_fresh_venv.py)."""
    from _fresh_venv import make_fresh_venv, run_temp

    return make_fresh_venv(tmp_path / "venv", shared=run_temp(tmp_path_factory))

