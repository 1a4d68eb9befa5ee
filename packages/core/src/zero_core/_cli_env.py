"""``zero env``: the environment zero runs in, for bug reports (as DeepSpeed's ``ds_report``).

Every section is gathered on its own and a failure is reported in its place: a broken plugin or
CUDA driver is what this command is run to find, so it must not stop the report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable
from importlib import metadata
from typing import Any

from zero_core._cli_common import aligned, human_bytes

__all__ = ["add_parser", "collect", "run"]

_DESCRIPTION = """\
Report what zero runs on: Python and the platform, torch and its build (CUDA, cuDNN, NCCL), the
devices it sees, the torch.distributed backends built in, the installed zero distributions, every
plugin registered through the "zero" entry-point group (with the distribution that registered it),
and the optional packages zero can use. Paste it into a bug report."""

_EXAMPLES = """\
examples:
  zero env
  zero env --json > env.json
  ZERO_DISABLE_PLUGIN_AUTOLOAD=1 zero env     # only zero-core's own plugin"""

# Optional packages zero's extras, examples and bench use, by distribution name.
_EXTRAS = ("transformers", "accelerate", "lightning", "safetensors", "PyYAML", "rich", "matplotlib")
_REQUIRED = ("pluggy", "numpy")
_BACKENDS = ("gloo", "nccl", "mpi", "ucc")
_KINDS = (("shard strategy", "zero_register_shard_strategies"), ("comm backend", "zero_register_comm_backends"),
          ("placement policy", "zero_register_placement_policies"))


def add_parser(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser("env", help="report torch, CUDA/NCCL, backends, zero distributions and plugins",
                              description=_DESCRIPTION, epilog=_EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_argument("--json", action="store_true", help="print the report as JSON")
    sub.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def _guarded(gather: Callable[[], Any]) -> Any:
    try:
        return gather()
    except Exception as exc:  # noqa: BLE001 - reported in the section's place, see the module docstring
        return {"error": f"{type(exc).__name__}: {exc}"}


def collect() -> dict[str, Any]:
    """The report as plain data (what ``--json`` prints)."""
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
    from zero_core._plugins import ENTRY_POINT_GROUP, ZeroPlugins
    from zero_core._registry import Registry

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


def _section(title: str, body: str) -> str:
    return f"{title}\n{body}"


def render(report: dict[str, Any]) -> str:
    """The report as aligned plain text."""
    py = report["python"]
    rows = [["python", f"{py['version']} ({py['implementation']})"], ["  executable", py["executable"]],
            ["platform", report["platform"]]]
    t = report["torch"]
    if "error" in t:
        rows.append(["torch", t["error"]])
    else:
        gpu = ", ".join(f"{d['name']} ({human_bytes(d['memory_bytes'])}, sm {d['capability']})" for d in t["devices"])
        rows += [["torch", t["version"]], ["  location", t["location"]],
                 ["CUDA build", t["cuda_build"] or ("none; ROCm " + t["hip_build"] if t["hip_build"] else "none (a CPU build)")],
                 ["cuDNN", str(t["cudnn"]) if t["cudnn"] else "-"],
                 ["CUDA available", f"{t['cuda_available']}" + (f": {len(t['devices'])} device(s)" if t["devices"] else "")],
                 *([["devices", gpu]] if gpu else []),
                 ["NCCL", t["nccl"] or "-"],
                 ["torch.distributed", ", ".join(f"{b} {'yes' if ok else 'no'}" for b, ok in t["backends"].items())
                  if t["distributed"] else "not built in"]]
    parts = [aligned(rows, indent="")]

    dists = report["distributions"]
    if isinstance(dists, dict):
        body = "  " + dists["error"]
    else:
        body = aligned([[d["name"], d["version"], "editable" if d["editable"] else "installed", d["location"]]
                        for d in dists]) if dists else "  none found (zero_core runs from a source tree on sys.path)"
    parts.append(_section("zero distributions", body))

    plugins = report["plugins"]
    if "error" in plugins:
        body = "  " + plugins["error"]
        title = "plugins"
    else:
        notes = [] if plugins["autoload"] else ["autoload off (ZERO_DISABLE_PLUGIN_AUTOLOAD)"]
        notes += [f"blocked: {', '.join(plugins['blocked'])}"] if plugins["blocked"] else []
        title = f"plugins (entry-point group {plugins['entry_point_group']!r}" + "".join(f"; {n}" for n in notes) + ")"
        rows = [[r["kind"], r["name"], r["class"],
                 f"{r['distribution']} {r['version']}" if r["distribution"] else f"plugin {r['plugin']}"]
                for r in plugins["registered"]]
        body = aligned(rows) if rows else "  none registered"
        body += "\n  loaded: " + ", ".join(plugins["loaded"])
    parts.append(_section(title, body))

    parts.append(_section("packages", aligned([[name, version or "not installed"]
                                               for name, version in report["packages"].items()])))
    return "\n\n".join(parts)
