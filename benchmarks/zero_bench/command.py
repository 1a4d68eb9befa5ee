"""The bench's command: ``zero bench ARGS`` and the ``zero-bench ARGS`` console script.

zero-bench registers :func:`bench` in the ``zero.cli`` entry-point group (benchmarks/pyproject.toml), which
is how the ``zero`` command of zero-core finds it; zero-core itself knows nothing of the bench. This module
imports the standard library only: ``zero --help`` imports it for :func:`bench`'s first docstring line.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["bench", "main"]


def bench(argv: Sequence[str]) -> int:
    """Run the benchmark of every strategy and policy against DDP and FSDP2; `zero bench --help` lists its options.

    ``argv`` is every argument after ``zero bench``; returns the bench's exit status.
    """
    return _run(argv, prog="zero bench")


def main(argv: Sequence[str] | None = None) -> int:
    """The ``zero-bench`` console script: the same as ``zero bench``."""
    return _run(sys.argv[1:] if argv is None else argv, prog="zero-bench")


def _run(argv: Sequence[str], prog: str) -> int:
    from zero_bench import main as bench_main

    if "-h" in argv or "--help" in argv:
        print(f"{prog} runs the benchmark in {Path(bench_main.__file__).parent} with every argument after "
              f"`{prog}`; these are its options (`nox -s bench -- ARGS` is `{prog} ARGS`):\n")
    return bench_main.main(list(argv), prog=prog)
