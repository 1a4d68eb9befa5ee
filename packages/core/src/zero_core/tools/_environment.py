"""The environment zero runs in, as plain data: :func:`environment_report` (what ``zero env --json`` prints).

Every section is gathered on its own and a failure is reported in its place: a broken plugin or
CUDA driver is what the report is read to find, so it must not stop the report. Standard library
at import; torch and the plugins are imported when the report is gathered.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable
from importlib import metadata
from typing import Any

__all__ = ["environment_report"]

# Optional packages zero's extras, examples and bench use, by distribution name.
_EXTRAS = ("transformers", "accelerate", "lightning", "safetensors", "PyYAML", "rich", "matplotlib")
_REQUIRED = ("pluggy", "numpy")
_BACKENDS = ("gloo", "nccl", "mpi", "ucc")
_KINDS = (("shard strategy", "zero_register_shard_strategies"), ("comm backend", "zero_register_comm_backends"),
          ("placement policy", "zero_register_placement_policies"))


def _guarded(gather: Callable[[], Any]) -> Any:
    try:
        return gather()
    except Exception as exc:  # noqa: BLE001 - reported in the section's place, see the module docstring
        return {"error": f"{type(exc).__name__}: {exc}"}


def environment_report() -> dict[str, Any]:
    """What zero runs on, as plain data: the report ``zero env`` prints (``zero env --json`` prints this dict).

    Keys: ``python`` (version, implementation, executable), ``platform``, ``torch`` (version, CUDA and
    cuDNN builds, NCCL, the devices it sees, the ``torch.distributed`` backends built in), ``distributions``
    (every installed ``zero-*`` distribution: name, version, editable, location), ``plugins`` (every
    shard strategy, comm backend and placement policy registered through the ``zero`` entry-point group,
    with the distribution that registered it) and ``packages`` (versions of the optional packages zero
    can use, ``None`` where not installed). A section that cannot be gathered (a broken plugin, a CUDA
    driver that fails) holds ``{"error": "..."}`` in its place instead of raising.
    """
    return {
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "platform": platform.platform(),
        "torch": _guarded(_torch),
        "distributions": _guarded(_distributions),
        "plugins": _guarded(_plugins),
        "packages": {name: _version(name) for name in (*_REQUIRED, *_EXTRAS)},
    }


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _torch() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    cuda_ok = torch.cuda.is_available()
    devices = []
    for i in range(torch.cuda.device_count() if cuda_ok else 0):
        props = torch.cuda.get_device_properties(i)
        devices.append({"name": props.name, "memory_bytes": props.total_memory,
                        "capability": f"{props.major}.{props.minor}"})
    nccl = None
    if dist.is_available() and dist.is_nccl_available():
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    backends = {}
    for name in _BACKENDS:
        check = getattr(dist, f"is_{name}_available", None)
        backends[name] = bool(dist.is_available() and check is not None and check())
    return {
        "version": torch.__version__,
        "location": os.path.dirname(torch.__file__),
        "cuda_build": torch.version.cuda,
        "hip_build": getattr(torch.version, "hip", None),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cuda_available": cuda_ok,
        "devices": devices,
        "nccl": nccl,
        "distributed": dist.is_available(),
        "backends": backends,
    }


def _location(dist: metadata.Distribution) -> tuple[str, bool]:
    """Where a distribution's code is, and whether it is an editable install (PEP 610's direct_url.json)."""
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct.get("dir_info", {}).get("editable"):
        url = direct.get("url", "")
        return (url.removeprefix("file://") or "?"), True
    return str(dist.locate_file("")), False


def _distributions() -> list[dict[str, Any]]:
    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name.lower().replace("_", "-").startswith("zero-") and name not in found:
            location, editable = _location(dist)
            found[name] = {"name": name, "version": dist.version, "editable": editable, "location": location}
    return sorted(found.values(), key=lambda d: d["name"])


def _plugins() -> dict[str, Any]:
    """Each registered name with the plugin and distribution that registered it."""
    from zero_core.interfaces._plugins import ENTRY_POINT_GROUP, ZeroPlugins
    from zero_core.interfaces._registry import Registry

    plugins = ZeroPlugins.load()
    pm = plugins.manager
    dist_of = {id(plugin): (dist.project_name, dist.version) for plugin, dist in pm.list_plugin_distinfo()}
    core = ("zero-core", _version("zero-core"))  # registered directly, not through its entry point
    registered = []
    for kind, hook in _KINDS:
        for impl in getattr(pm.hook, hook).get_hookimpls():
            # each plugin's hook again into a registry of its own, to see which names it adds
            own: Registry[Any] = Registry(kind)
            impl.function(*[own] * len(impl.argnames))
            name, version = dist_of.get(id(impl.plugin), core if impl.plugin_name == "zero-core" else (None, None))
            for item in own.names():
                cls = own.get(item)
                registered.append({"kind": kind, "name": item, "class": f"{cls.__module__}.{cls.__qualname__}",
                                   "plugin": impl.plugin_name, "distribution": name, "version": version})
    return {
        "entry_point_group": ENTRY_POINT_GROUP,
        "autoload": not os.environ.get("ZERO_DISABLE_PLUGIN_AUTOLOAD"),
        "blocked": [n.strip() for n in os.environ.get("ZERO_BLOCKED_PLUGINS", "").split(",") if n.strip()],
        "loaded": sorted(name for name, plugin in pm.list_name_plugin() if plugin is not None),
        "registered": sorted(registered, key=lambda r: ([k for k, _ in _KINDS].index(r["kind"]), r["name"])),
    }
