"""The ``zero`` command line: the parser and the dispatch. Each command lives in its own ``_cli_*`` module.

Exit codes: 0 done, 1 the request failed (a user error is one line on stderr, never a traceback),
2 the command line is wrong. The command modules import torch only when they run.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from zero_core import _cli_bench, _cli_consolidate, _cli_env, _cli_estimate
from zero_core._cli_common import USAGE, CommandError
from zero_core._version import __version__

__all__ = ["main"]

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
    for module in (_cli_estimate, _cli_env, _cli_bench, _cli_consolidate):
        module.add_parser(commands)
    return parser


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
        from zero_core.errors import ZeroError  # every error zero raises on purpose; anything else is a bug: traceback

        if not isinstance(exc, ZeroError):
            raise
        print(f"zero {command}: error: {exc}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``zero`` with ``argv`` (default: the process's arguments); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # everything after `bench` is the bench's, --help included
        return _guarded("bench", _cli_bench.run, argv[1:])
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) or a usage error argparse has printed (2)
        return _exit_code(exc)
    return _guarded(args.command, args.run, args)


if __name__ == "__main__":
    sys.exit(main())
