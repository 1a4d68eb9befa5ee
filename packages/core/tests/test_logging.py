"""One logger tree: library code logs under ``zero.*`` and never prints."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import torch

from zero_core import ZeroConfig, shard
from zero_core.plugin import get_logger
from zero_core.testing.zoo import get_case

ROOT = Path(__file__).resolve().parents[3]
LIBRARY_SOURCES = ("packages/*/src", "packages/strategies/*/src", "examples/*/src")


def _library_files() -> list[Path]:
    files = []
    for pattern in LIBRARY_SOURCES:
        for src in ROOT.glob(pattern):
            for path in src.rglob("*.py"):
                # the command line and the test kits talk to a terminal on purpose
                if path.name.startswith("_cli") or "testing" in path.parts or path.name == "__main__.py":
                    continue
                files.append(path)
    return files


def _calls(path: Path, name: str) -> list[ast.Call]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == name)
        or (isinstance(node.func, ast.Attribute) and node.func.attr == name))]


def test_library_code_never_prints():
    files = _library_files()
    assert len(files) > 60, f"library sources not found under {ROOT}"
    printing = [f"{path.relative_to(ROOT)}:{call.lineno}" for path in files for call in _calls(path, "print")]
    assert not printing, f"library code prints; log through zero_core.plugin.get_logger instead: {printing}"


def test_every_logger_is_in_the_zero_tree():
    outside = []
    for path in _library_files():
        for call in _calls(path, "getLogger"):
            arg = call.args[0] if call.args else None
            name = arg.value if isinstance(arg, ast.Constant) else None
            if not (isinstance(name, str) and (name == "zero" or name.startswith("zero."))):
                outside.append(f"{path.relative_to(ROOT)}:{call.lineno}: getLogger({ast.unparse(arg) if arg else ''})")
    offenders = [o for o in outside if not o.startswith("packages/core/src/zero_core/base/_log.py")]
    assert not offenders, f"loggers outside the 'zero' tree; use zero_core.plugin.get_logger: {offenders}"
    assert get_logger("offload") is logging.getLogger("zero.offload")
    assert get_logger("offload").parent is logging.getLogger("zero")  # one setLevel on "zero" reaches every plugin


def test_shard_logs_its_layout_under_zero_core(caplog):
    case = get_case("odd_sizes")
    model = case.build()
    with caplog.at_level(logging.INFO, logger="zero"):
        sharded, _ = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=ZeroConfig())
    records = [r for r in caplog.records if r.name == "zero.core"]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    message = records[0].getMessage()
    chunks = sharded.engine.chunks
    assert f"into {len(chunks)} chunks" in message and "stage 3" in message and "strategy 'chunk'" in message
    sharded.close()
