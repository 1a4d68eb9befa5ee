"""Shims for torch < 2.12 (the GPU machine has torch 2.11): the *_single collectives zero_comm calls.

Imported by gpu_check.py before zero, and loaded into pytest with ``-p gpushim``.
``GPUSHIM_FORCE=1`` replaces them even where torch has them (to exercise the shims on CPU).
Not library code: kept beside the report of the run that used it (see README.md here).
"""

from __future__ import annotations

import os

import torch.distributed as dist

INSTALLED: list[str] = []
# whether torch itself has each one (read before anything is replaced)
NATIVE = {name: hasattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}


def _all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
    return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def install(force: bool = False) -> list[str]:
    force = force or os.environ.get("GPUSHIM_FORCE") == "1"
    for name, fn, target in (("all_gather_single", _all_gather_single, "all_gather_into_tensor"),
                             ("reduce_scatter_single", _reduce_scatter_single, "reduce_scatter_tensor")):
        existed = hasattr(dist, name) and getattr(dist, name) is not fn
        if (force or not existed) and getattr(dist, name, None) is not fn:
            setattr(dist, name, fn)
            INSTALLED.append(f"torch.distributed.{name} -> torch.distributed.{target}"
                             + (" (forced: torch has its own)" if existed else " (missing in this torch)"))
    return INSTALLED


install()
