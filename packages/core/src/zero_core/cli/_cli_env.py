"""``zero env``: the environment zero runs in, for bug reports (as DeepSpeed's ``ds_report``).

The report itself is :func:`zero_core.environment_report` (``zero_core/tools/_environment.py``); this
module parses the command and renders the report as text.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from zero_core.cli._cli_common import aligned, human_bytes

__all__ = ["add_parser", "render", "run"]

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


def add_parser(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser("env", help="report torch, CUDA/NCCL, backends, zero distributions and plugins",
                              description=_DESCRIPTION, epilog=_EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_argument("--json", action="store_true", help="print the report as JSON")
    sub.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zero_core import environment_report

    report = environment_report()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


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
