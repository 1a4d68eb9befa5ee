"""The ``zero`` command line: the parser and the dispatch. Each command lives in its own ``_cli_*`` module.

Other distributions add commands through the ``zero.cli`` entry-point group (see [Note: commands from
other distributions]).

Exit codes: 0 done, 1 the request failed (a user error is one line on stderr, never a traceback),
2 the command line is wrong. The command modules import torch only when they run, and importing the package
imports none either (see [Note: a lazy package] in ``zero_core``), so ``zero --help`` answers at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

from zero_core.base._version import __version__
from zero_core.cli import _cli_consolidate, _cli_env, _cli_estimate
from zero_core.cli._cli_common import USAGE, CommandError

__all__ = ["COMMAND_GROUP", "main"]

# [Note: commands from other distributions]
# A distribution adds `zero NAME` by registering, in the entry-point group "zero.cli", NAME = "module:function",
# where function(argv: list[str]) -> int runs the command with every argument after NAME (its --help included)
# and returns the exit code; the first line of its docstring is the line `zero --help` shows. Its module is
# imported for `zero --help`, so it imports the standard library only and the command's own code when it runs.
# zero-core's own commands win over an entry point of the same name. zero-core names no such distribution
# except to say how to install one when its command is asked for and missing (_ELSEWHERE).
COMMAND_GROUP = "zero.cli"
_BUILT_IN = ("estimate", "env", "consolidate")
# Commands that other zero distributions provide: name -> (distribution, extras to install, help line).
_ELSEWHERE = {"bench": ("zero-bench", "[plot,rich]", "run the benchmark against DDP and FSDP2")}

_EPILOG = """\
examples:
  zero estimate --params 7e9 --world-size 64 --stage 3
  zero env
  zero bench --quick
  zero consolidate runs/ckpt-1000 runs/hf

`zero COMMAND --help` describes each command. Docs: docs/cli.md."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero", description="Tools for zero (ZeRO sharded data parallel) runs.",
                                     epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"zero-core {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    for module in (_cli_estimate, _cli_env, _cli_consolidate):
        module.add_parser(commands)
    found = _commands()
    for name in sorted(found.keys() | _ELSEWHERE.keys()):
        # Only for `zero --help`: main() hands `zero NAME ...` to the command unparsed, its --help included.
        commands.add_parser(name, help=_help_line(name, found.get(name)), add_help=False)
    return parser


def _commands() -> dict[str, metadata.EntryPoint]:
    """The commands other installed distributions register (the first of each name; never a built-in's name)."""
    found: dict[str, metadata.EntryPoint] = {}
    for point in metadata.entry_points(group=COMMAND_GROUP):
        if point.name not in _BUILT_IN:
            found.setdefault(point.name, point)
    return found


def _help_line(name: str, point: metadata.EntryPoint | None) -> str:
    if point is None:
        distribution, _, what = _ELSEWHERE[name]
        return f"{what} (not installed: `zero {name}` says how to install {distribution})"
    source = f"from {point.dist.name}" if point.dist is not None else f"from {point.value}"
    try:
        doc = (point.load().__doc__ or "").strip().splitlines()
    except Exception as exc:  # noqa: BLE001 - a broken command must not break `zero --help`; running it says more
        return f"{source}; fails to load: {type(exc).__name__}: {exc}"
    line = doc[0].rstrip(".") if doc else f"`zero {name} --help` describes it"
    return f"{line[:1].lower()}{line[1:]} ({source})"


def _run_external(name: str, point: metadata.EntryPoint | None) -> Callable[[Sequence[str]], int]:
    """The runner of ``zero NAME ...`` for a command another distribution provides (or says how to install it)."""

    def run(argv: Sequence[str]) -> int:
        if point is None:
            from zero_core.base._install import install_command

            distribution, extra, what = _ELSEWHERE[name]
            raise CommandError(f"`zero {name}` ({what}) comes with the {distribution} distribution, which is not "
                               f"installed. Install it: {install_command(distribution, extra=extra)}")
        try:
            return point.load()(list(argv)) or 0
        except SystemExit as exc:  # the command's own argparse: --help (0) or a bad option (2), already printed
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)

    return run


def _exit_code(exc: SystemExit) -> int:
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else USAGE)


def _guarded(command: str, run: Callable[..., int], arg: object) -> int:
    """Run a command; a user error becomes one line on stderr and its exit code."""
    try:
        return run(arg)
    except BrokenPipeError:  # `zero ... | head`: the reader has gone; stop writing, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except CommandError as exc:
        print(f"zero {command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:
        from zero_core.base.errors import ZeroError  # every error zero raises on purpose; anything else is a bug: traceback

        if not isinstance(exc, ZeroError):
            raise
        print(f"zero {command}: error: {exc}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``zero`` with ``argv`` (default: the process's arguments); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in _BUILT_IN and not argv[0].startswith("-"):
        found = _commands()
        if argv[0] in found or argv[0] in _ELSEWHERE:  # everything after NAME is the command's, --help included
            return _guarded(argv[0], _run_external(argv[0], found.get(argv[0])), argv[1:])
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) or a usage error argparse has printed (2)
        return _exit_code(exc)
    return _guarded(args.command, args.run, args)


if __name__ == "__main__":
    sys.exit(main())
