"""The report: Markdown blocks rewritten in place and a JSON mirror, flushed after every section."""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from typing import Any


class Report:
    """``report.md`` and ``results.json`` under ``out``; a timed-out run keeps what was flushed."""

    def __init__(self, out: str, budget_s: float) -> None:
        self.out, self.budget_s = out, budget_s
        self.start = time.perf_counter()
        self.blocks: dict[str, list[str]] = {}  # in the order first written; a block can be rewritten
        self.results: dict[str, Any] = {"sections": {}, "errors": []}
        os.makedirs(out, exist_ok=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def log(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {message}", flush=True)

    def block(self, key: str, lines: list[str]) -> None:
        self.blocks[key] = list(lines)
        self.flush()

    def render(self) -> str:
        return "\n".join(line for lines in self.blocks.values() for line in lines) + "\n"

    def flush(self) -> None:
        with open(os.path.join(self.out, "report.md"), "w") as f:
            f.write(self.render())
        with open(os.path.join(self.out, "results.json"), "w") as f:
            json.dump(self.results, f, indent=1, default=str)

    def error(self, where: str, err: BaseException) -> str:
        """Record an error; returns its traceback's tail for the report."""
        tb = traceback.format_exc()
        self.results["errors"].append({"section": where, "error": f"{type(err).__name__}: {err}", "traceback": tb})
        self.log(f"ERROR in {where}: {type(err).__name__}: {err}\n{tb}")
        return "\n".join(tb.strip().splitlines()[-25:])

    def section(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one section: skipped past the time budget, reported (not raised) when it fails."""
        if self.elapsed() > self.budget_s:
            self.log(f"skipping {name}: past the time budget ({self.budget_s:.0f} s)")
            self.results["sections"][name] = {"skipped": "time budget"}
            self.block(name, [f"\n## {name}\n", f"skipped: past the time budget ({self.budget_s:.0f} s)"])
            return None
        self.log(f"== {name}")
        t0 = time.perf_counter()
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - fail soft: the rest of the report still runs
            tail = self.error(name, err)
            self.results["sections"].setdefault(name, {})["error"] = f"{type(err).__name__}: {err}"
            self.blocks.setdefault(name, [f"\n## {name}\n"]).append(
                f"\n**ERROR** `{type(err).__name__}: {str(err)[:500]}`\n\n```text\n{tail}\n```")
            return None
        finally:
            self.log(f"== {name} done in {time.perf_counter() - t0:.1f} s")
            self.flush()


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A Markdown table."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
