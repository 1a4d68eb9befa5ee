"""examples/train_gpt.py needs rich only for its progress bar: without rich it trains with plain log lines."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_gpt.py"

# Run as rank 0's terminal would: stdout claims to be a tty, which is when the example draws its bar.
WITHOUT_RICH = textwrap.dedent(
    f"""
    import sys

    sys.modules["rich"] = None  # `import rich.progress` now fails as if rich were not installed
    sys.stdout.isatty = lambda: True
    sys.path.insert(0, {str(EXAMPLE.parent)!r})
    import train_gpt

    sys.exit(train_gpt.main(sys.argv[1:]))
    """
)


def _example_module():
    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_progress_display_is_rich_when_installed_and_none_without(monkeypatch):
    example = _example_module()
    progress = example.progress_display("zero x2", total=3)
    assert progress is not None, "rich is installed (nox -s tests installs it), yet the example fell back to plain lines"
    assert len(progress.task_ids) == 1
    # the bar shows the elapsed time and the ETA; steps/s comes in the info field
    assert {type(column).__name__ for column in progress.columns} >= {"TimeElapsedColumn", "TimeRemainingColumn"}
    progress.stop()
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.delitem(sys.modules, "rich.progress", raising=False)
    assert example.progress_display("zero x2", total=3) is None


def test_example_trains_with_plain_lines_on_a_terminal_without_rich(tmp_path):
    script = tmp_path / "without_rich.py"
    script.write_text(WITHOUT_RICH)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(script),
           "--steps", "2", "--vocab", "257", "--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "16",
           "--log-every", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rich is not installed" in proc.stdout and "zero-core[examples]" in proc.stdout, proc.stdout
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("loss " in line and " steps/s " in line and " ETA " in line for line in steps), proc.stdout
    assert sum(line.startswith("summary:") for line in proc.stdout.splitlines()) == 1, proc.stdout
