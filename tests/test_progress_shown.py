"""Long work shows progress. nox sessions say what they install before pip goes quiet (nox shows nothing while pip
installs, and torch's first install is a silent minute or two), so each ``session.install`` in noxfile.py follows a
``session.log`` naming it. The framework examples keep their frameworks' progress bars (elapsed, ETA, steps/s on
rank 0). The demo's own step lines are checked on the runs tests/test_text_example.py and tests/test_demo.py make."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _is_call(node: ast.AST, attribute: str) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr == attribute and isinstance(node.value.func.value, ast.Name)
            and node.value.func.value.id == "session")


def test_every_install_in_the_noxfile_is_announced_first() -> None:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    installs = 0
    silent = []
    for function in (node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)):
        for body in (node.body for node in ast.walk(function) if hasattr(node, "body") and isinstance(node.body, list)):
            for before, statement in zip([None, *body], body, strict=False):
                if _is_call(statement, "install"):
                    installs += 1
                    if before is None or not _is_call(before, "log"):
                        silent.append(f"noxfile.py:{statement.lineno} ({function.name})")
    assert installs >= 7, installs  # the check saw the sessions' installs
    assert not silent, f"session.install without a session.log just before it (say what is being installed): {silent}"


def test_the_framework_examples_keep_their_progress_bars() -> None:
    hf = (ROOT / "examples" / "hf_trainer.py").read_text()
    assert "disable_tqdm=False" in hf and "disable_tqdm=True" not in hf, "examples/hf_trainer.py hides the Trainer's bar"
    lightning = (ROOT / "examples" / "lightning_train.py").read_text()
    assert "enable_progress_bar=False" not in lightning, "examples/lightning_train.py hides Lightning's progress bar"
