"""``python -m zero_bench [OPTIONS]``: the bench of an installed zero-bench (``--help`` for the options)."""

import sys

from zero_bench.main import main

sys.exit(main())
