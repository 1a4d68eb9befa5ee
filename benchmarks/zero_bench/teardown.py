"""Process-group teardown that lets a rank exit cleanly, and the check that it did.

Why the reference rows used to abort at exit: ``torch.distributed.nn.functional`` binds
``group=group.WORLD`` as the default argument of its collectives when it is first imported, and
``DistributedDataParallel`` (through ``torch._dynamo``) and FSDP2 import it lazily. Imported after
``init_process_group``, those defaults hold the default group for the life of the process, so
``destroy_process_group`` cannot free it and its gloo threads keep running. When one of them
dropped the last collective's tensors while the interpreter was shutting down, it could no longer
take the GIL, was unwound by ``pthread_exit`` through a ``noexcept`` destructor, and the rank died
in ``std::terminate`` ("terminate called without an active exception", SIGABRT). Importing the
module here, before any process group exists, binds ``None`` instead: the group is freed, and its
threads joined, inside ``destroy_process_group``.

DTensor holds them too. In torch 2.13 a ``DeviceMesh`` owns the groups it created, and DTensor's
caches (redistribution planners, sharding propagation) keep meshes alive for the life of the
process: every FSDP2 and zero row leaves some there. So :func:`destroy_process_group_checked`, once
torch has destroyed the groups, takes them out of the meshes that outlive them, and then checks
that no gloo thread is left.
"""

from __future__ import annotations

import gc
import importlib
import os
import re
import sys

import torch.distributed as dist

# Before any process group exists, so that its collectives' default ``group`` is None (the module docstring says why).
importlib.import_module("torch.distributed.nn")

__all__ = ["backend_threads", "destroy_process_group_checked"]

# gloo's threads: ProcessGroupGloo's workers (pt_gloo_runloop) and the TCP transport's event loop (gloo_tcp_loop)
BACKEND_THREAD = re.compile("gloo", re.IGNORECASE)


def backend_threads() -> list[str]:
    """Names of this process's native threads that belong to a gloo process group (Linux; empty elsewhere)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended while we looked
            continue
        if BACKEND_THREAD.search(name):
            names.append(name)
    return sorted(names)


def destroy_process_group_checked() -> None:
    """Destroy every process group and check that their threads are gone, so the interpreter exits alone.

    Raises:
        RuntimeError: a group outlived ``destroy_process_group`` (something still references it), so
            its threads would race the interpreter's shutdown and could abort the rank at exit.
    """
    dist.destroy_process_group()
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    if mesh_module is not None:
        for mesh in [o for o in gc.get_objects() if isinstance(o, mesh_module.DeviceMesh)]:
            registry = getattr(mesh, "_pg_registry", None)  # torch 2.13: a mesh owns the groups it created
            if registry:
                registry.clear()
    gc.collect()  # DDP and FSDP2 modules sit in reference cycles that hold the groups until collected
    left = backend_threads()
    if left:
        raise RuntimeError(
            f"the process group outlived destroy_process_group: threads {', '.join(left)} are still running, so the "
            "rank could abort at exit ('terminate called without an active exception'). Something still references "
            "the group: import modules that bind it at import time (torch.distributed.nn) before init_process_group, "
            "and drop the models and optimizers that hold it before destroying it")
