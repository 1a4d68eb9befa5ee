"""What every ``zero`` command shares: its error type, byte units and aligned text columns.

Standard library only: ``zero --help`` builds every command's parser, and must not pay for torch.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["USAGE", "FAILURE", "CommandError", "aligned", "human_bytes"]

USAGE = 2  # the command line is wrong (argparse's own code)
FAILURE = 1  # the command line is fine, but what it asks for cannot be done


class CommandError(Exception):
    """A user error a command reports as one line on stderr, with ``exit_code``, and no traceback."""

    def __init__(self, message: str, *, exit_code: int = FAILURE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def human_bytes(n: int | float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at 1 or more: ``13.04 GiB``, ``417.2 MiB``, ``512 B``."""
    for unit, size in _UNITS:
        if abs(n) >= size:
            value = n / size
            return f"{value:,.2f} {unit}" if value < 100 else f"{value:,.1f} {unit}"
    return f"{int(n)} B"


def aligned(rows: Sequence[Sequence[str]], *, indent: str = "  ", right: Sequence[int] = ()) -> str:
    """Rows of cells as text columns, each as wide as its widest cell; columns in ``right`` align right."""
    widths = [max(len(row[i]) if i < len(row) else 0 for row in rows) for i in range(max(map(len, rows), default=0))]
    lines = []
    for row in rows:
        cells = [cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append((indent + "  ".join(cells)).rstrip())
    return "\n".join(lines)
