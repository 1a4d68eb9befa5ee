"""``zero bench [ARGS...]``: the benchmark of every strategy and policy against DDP and FSDP2 (``zero_bench``).

The bench ships as the ``zero-bench`` distribution (the repository's ``benchmarks/``); from a
checkout where it is not installed, ``benchmarks/`` is put on ``sys.path``, as
``python benchmarks/bench.py`` does.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from zero_core._cli_common import CommandError

__all__ = ["add_parser", "find_bench", "run"]

_NOT_FOUND = """\
the benchmark is not installed and {where} is not in a zero checkout. Install it:
  pip install zero-bench                                   (once published)
  pip install ./benchmarks                                 (from a zero checkout)
  pip install --find-links dist zero-bench                 (from wheels built by `nox -s build`)
or run it from a checkout: `nox -s bench -- --quick`"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    # Only for `zero --help`: zero_core._cli hands `zero bench ...` to the bench unparsed, so the
    # bench's own options (and its --help) pass through untouched.
    commands.add_parser("bench", help="run the benchmark against DDP and FSDP2 (`zero bench --help`: its options)",
                        add_help=False)


def find_bench(cwd: Path | None = None) -> ModuleType:
    """``zero_bench.main``: installed, else from the checkout holding ``cwd`` (default: the current directory)."""
    try:
        return importlib.import_module("zero_bench.main")
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "zero_bench":
            raise _missing_dependency(exc) from None
    where = (cwd or Path.cwd()).resolve()
    for directory in (where, *where.parents):
        benchmarks = directory / "benchmarks"
        if (benchmarks / "zero_bench" / "main.py").is_file():
            sys.path.insert(0, str(benchmarks))
            try:
                return importlib.import_module("zero_bench.main")
            except ModuleNotFoundError as exc:
                raise _missing_dependency(exc) from None
    raise CommandError(_NOT_FOUND.format(where=where))


def _missing_dependency(exc: ModuleNotFoundError) -> CommandError:
    return CommandError(f"the benchmark needs {exc.name!r}, which is not installed: pip install {exc.name}, "
                        "or install zero-bench, which declares what it needs")


def run(argv: Sequence[str]) -> int:
    bench = find_bench()
    if "-h" in argv or "--help" in argv:
        print(f"zero bench runs the benchmark in {Path(str(bench.__file__)).parent} with every argument after `bench`; "
              "these are its options (`nox -s bench -- ARGS` is `zero bench ARGS`):\n")
    try:
        return bench.main(list(argv)) or 0
    except SystemExit as exc:  # the bench's argparse: --help (0) or a bad option (2), already printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
