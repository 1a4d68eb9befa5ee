"""Workers for checkpoint, state dict and lazy-initialisation tests: build, train, save, load, compare.

Every function here runs on each rank under :func:`zero_core.testing.run_distributed` (or
in one process without a process group). Batches are a pure function of the step, split
evenly over the ranks, so runs at different world sizes train the same model.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zero_core import ZeroConfig, lazy_init, load_checkpoint, save_checkpoint, shard
from zero_core.testing.distributed import device_under_test
from zero_core.testing.parity import SEED, make_optimizer
from zero_core.testing.zoo import ZooCase, get_case

__all__ = ["build", "kill_after_bytes", "phase", "train_steps"]


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def build(case: ZooCase | str, config: ZeroConfig, *, lazy: bool = False, load_from: Any = None,
          load_strict: bool = True, optimizer: str = "adamw", seed: int = SEED,
          plugins: Sequence[object] = (), mesh_shape: tuple[int, ...] | None = None) -> tuple[Any, torch.optim.Optimizer]:
    """The zoo model built under ``seed`` (eagerly, or lazily), sharded with ``config`` (and ``plugins``), on a CPU
    device mesh of ``mesh_shape`` (``(replicate, shard)`` for two dimensions) when given."""
    case = get_case(case) if isinstance(case, str) else case
    torch.manual_seed(seed)
    if lazy:
        with lazy_init():
            model = case.build()
    else:
        model = case.build()
    mesh = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
        mesh = init_device_mesh(device_under_test(), tuple(mesh_shape), mesh_dim_names=names)
    return shard(model, make_optimizer(case, model, optimizer), config=config, load_from=load_from,
                 load_strict=load_strict, plugins=plugins, mesh=mesh)


def train_steps(model: Any, opt: torch.optim.Optimizer, case: ZooCase, start: int, count: int,
                batch_size: int = 8) -> list[float]:
    """Train steps ``start .. start + count - 1`` on this rank's slice of each global batch; the mean losses."""
    rank, world = _world()
    local = batch_size // world
    losses = []
    for step in range(start, start + count):
        opt.zero_grad(set_to_none=True)
        inputs, targets = case.batch(step, batch_size)
        part = slice(rank * local, (rank + 1) * local)
        device = model.engine.device  # the device under test, see [Note: the device under test]
        loss = case.loss(model(inputs[part].to(device)), targets[part].to(device))
        model.backward(loss)
        opt.step()
        reported = loss.detach().float().clone()
        if world > 1:
            dist.all_reduce(reported)
            reported /= world
        losses.append(reported.item())
    return losses


def phase(case_name: str, config: ZeroConfig, directory: str, *, mode: str, k: int, j: int = 0,
          optimizer: str = "adamw", lazy: bool = False, extra: Any = None, plugins: Sequence[object] = (),
          mesh_shape: tuple[int, ...] | None = None) -> dict[str, Any]:
    """One leg of a resume test.

    ``mode="straight"`` trains ``k + j`` steps; ``"save"`` trains ``k``, saves a sharded
    checkpoint into ``directory`` and trains ``j`` more (saving must not change the run, so
    this is also the uninterrupted reference); ``"load"`` loads it into a freshly built
    model and trains ``j`` more. Returns the losses, the full parameters, the optimizer's step count states,
    the engine's step and the loaded extra object.
    """
    case = get_case(case_name)
    model, opt = build(case, config, lazy=lazy, optimizer=optimizer, plugins=plugins, mesh_shape=mesh_shape)
    loaded = None
    try:
        if mode == "straight":
            losses = train_steps(model, opt, case, 0, k + j)
        elif mode == "save":  # and train on: the run is also the uninterrupted reference for a resume
            losses = train_steps(model, opt, case, 0, k)
            save_checkpoint(model, opt, directory, extra=extra)
            losses += train_steps(model, opt, case, k, j)
        elif mode == "load":
            loaded = load_checkpoint(model, opt, directory)
            losses = train_steps(model, opt, case, k, j)
        else:
            raise ValueError(f"mode must be straight, save or load, got {mode!r}")
        scale = model.loss_scaler.scale if model.loss_scaler is not None else None
        params = {name: value.cpu() for name, value in model.full_parameters().items()}
        return {"losses": losses, "params": params, "extra": loaded, "step": model.engine.step_count,
                "scale": scale, "rng": torch.random.get_rng_state()}
    finally:
        model.close()


@contextlib.contextmanager
def kill_after_bytes(limit: int) -> Iterator[None]:
    """Kill this process (SIGKILL, no cleanup) once ``limit`` bytes have gone through atomic writes.

    Simulates a rank dying in the middle of a checkpoint write.
    """
    from zero_core.base import _atomic

    original = _atomic.HashingWriter.write

    def write(self: Any, data: Any) -> int:
        if self.nbytes + memoryview(data).nbytes > limit:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, data)

    _atomic.HashingWriter.write = write  # type: ignore[method-assign]
    try:
        yield
    finally:
        _atomic.HashingWriter.write = original  # type: ignore[method-assign]
