"""One subprocess call of the fresh-venv install tests: output kept, a failure or a timeout fails the test with it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


def run_checked(cmd: list[str], *, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout:.0f}s\n--- stdout ---\n{out}\n--- stderr ---\n{err}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    return proc
