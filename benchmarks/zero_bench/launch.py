"""One configuration under torchrun, and what went wrong when it fails.

Each rank's stdout and stderr go to files of their own (torchrun's ``--redirects``), so a failed
row is reported with the ranks that failed, how each ended (its exit code or the signal that
killed it) and each one's last lines, instead of torchrun's summary alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zero_bench.configs import BenchConfig

__all__ = ["RANK_LINES", "explain", "launch", "sigterm_raises"]

RANK_LINES = 12  # last lines of each failed rank shown in the report
# a rank's uncaught Python exception, as torch.distributed prints it ("[rank1]: ValueError: ...")
EXCEPTION_LINE = re.compile(r"^(\[rank\d+\]: )?[\w.]+(Error|Exception|Interrupt): ")
# one failure in torchrun's summary: "rank      : 1 (local_rank: 1)" then "exitcode  : -6 (pid: 123)"
FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: (\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def _ending(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _rank_log(log_dir: Path, local_rank: int) -> list[str]:
    """A rank's stderr lines (its stdout's when stderr is empty), from torchrun's log directory."""
    for stream in ("stderr.log", "stdout.log"):
        files = sorted(log_dir.glob(f"*/attempt_*/{local_rank}/{stream}"))
        if files:
            lines = files[-1].read_text(errors="replace").strip().splitlines()
            if lines:
                return lines
    return []


def explain(log: str, log_dir: Path, returncode: int) -> dict[str, Any]:
    """The ``error`` and ``log_tail`` of a failed launch: the failed ranks, root cause first, with their last lines."""
    summary = log.split("Root Cause", 1)
    # torchrun lists the root cause (the first rank to fail) after the others; it goes first here
    root = FAILURE.findall(summary[1]) if len(summary) == 2 else []
    failures = list(dict.fromkeys(root + FAILURE.findall(summary[0])))
    parts, first = [], None
    for rank, local_rank, code in failures:
        lines = _rank_log(log_dir, int(local_rank))
        raised = [line for line in lines if EXCEPTION_LINE.match(line)]
        last = (raised[-1] if raised else lines[-1] if lines else "(no output)").split("]: ", 1)[-1]
        if first is None:
            first = f"rank {rank} {_ending(int(code))}: {last}"
        tail = "\n".join(f"    {line}" for line in lines[-RANK_LINES:]) or "    (no output)"
        parts.append(f"  rank {rank} ({_ending(int(code))}), its last lines:\n{tail}")
    if first is None:  # no rank failed: torchrun itself did, or rank 0 wrote no record
        lines = log.strip().splitlines()
        error = "the ranks exited with 0 but rank 0 wrote no record" if returncode == 0 else f"torchrun {_ending(returncode)}"
        return {"error": error, "log_tail": "\n".join(lines[-25:])}
    return {"error": first, "log_tail": "\n".join(parts)}


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within it, SIGTERM (a CI timeout, a stopped nox) raises ``SystemExit`` as Ctrl-C raises ``KeyboardInterrupt``,
    so that the running :func:`launch` stops its ranks, which live in a session of their own, before the bench exits."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def launch(config: BenchConfig, spec: dict[str, Any], world: int, timeout: float, tmp: Path,
           pythonpath: Path | None) -> dict[str, Any]:
    """Run ``config`` on ``world`` ranks; the record rank 0 wrote, or ``{"status": "failed", ...}``.

    Args:
        pythonpath: the folder holding ``zero_bench`` when it is not installed (a checkout), else ``None``.
    """
    out, log_dir = tmp / f"{config.name}.json", tmp / f"{config.name}-logs"
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "--log-dir", str(log_dir), "--redirects", "3",
           "-m", "zero_bench.worker", "--spec", json.dumps({**spec, "config": config.as_dict()}), "--out", str(out)]
    # A session of its own, so that a timeout or Ctrl-C stops the ranks too, not only the launcher.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        tails = "\n".join(f"  rank {r}, its last lines:\n" + "\n".join(f"    {line}" for line in _rank_log(log_dir, r)[-RANK_LINES:])
                          for r in range(world))
        return {"status": "failed", "error": f"did not finish within --timeout {timeout:.0f} s", "log_tail": tails}
    except BaseException:  # Ctrl-C or SIGTERM (sigterm_raises): the ranks are in another session and would run on
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode != 0 or not out.exists():
        return {"status": "failed", **explain(log or "", log_dir, proc.returncode)}
    return json.loads(out.read_text())
