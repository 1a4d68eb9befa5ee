"""Entry point of ``nox -s bench``; see ``benchmarks/zero_bench/main.py`` for the options (or ``--help``)."""

import sys

from zero_bench.main import main

if __name__ == "__main__":
    sys.exit(main())
