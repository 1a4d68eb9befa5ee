"""[Note: two planes of collectives]: only ``_collectives`` (parameters and gradients) and ``_agreement`` (decisions
the ranks share) call a comm backend's collectives; every other core module goes through their functions."""

from __future__ import annotations

import ast
from pathlib import Path

COLLECTIVES = {"all_gather", "reduce_scatter", "all_reduce", "broadcast", "agree_min", "agree_any", "agree_max", "all_gather_object",
               "all_to_all"}
ALLOWED = {"_collectives.py", "_agreement.py", "backend.py"}  # comm/backend.py defines the interface


def collective_calls(source: str) -> list[tuple[str, int]]:
    """``(method, line)`` of each call of a collective method on any object (``comm.all_gather(...)``)."""
    return [(node.func.attr, node.lineno) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES]


def test_the_detector_finds_a_direct_call() -> None:
    assert collective_calls("def f(engine):\n    engine.comm.all_reduce(t)\n") == [("all_reduce", 2)]
    assert collective_calls("from zero_core.chunks._collectives import sum_over_ranks\nsum_over_ranks(t, comm)\n") == []


def test_only_the_two_collective_modules_call_a_backend() -> None:
    root = Path(__file__).resolve().parents[1] / "src" / "zero_core"  # the tree this test lives in
    offenders = [f"{path.relative_to(root)}:{line} calls {method}"
                 for path in sorted(root.rglob("*.py")) if path.name not in ALLOWED and "testing" not in path.parts
                 for method, line in collective_calls(path.read_text(encoding="utf-8"))]
    assert not offenders, ("core modules must call collectives through zero_core.chunks._collectives or zero_core.comm._agreement "
                           f"(see [Note: two planes of collectives]): {offenders}")
