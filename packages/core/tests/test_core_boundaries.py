"""Other distributions use zero-core only through ``zero_core`` and ``zero_core.plugin``.

Anything else in zero-core (``zero_core._*``, ``zero_core.chunks.chunk``, ...) may change without
notice; a plugin that imports it breaks on a zero-core upgrade. Parsed, not imported, so the
check needs none of the distributions' dependencies and takes milliseconds.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import zero_core

ROOT = Path(__file__).resolve().parents[3]
PLUGIN_SOURCES = ("packages/comm/src", "packages/comm-quantized/src", "packages/strategies/*/src", "packages/offload/src", "examples/*/src")
ALLOWED = {"zero_core", "zero_core.plugin"}
# Importing `from zero_core import chunk` reaches a submodule just like `import zero_core.chunks.chunk`.
CORE_SUBMODULES = {path.stem for path in Path(zero_core.__file__).parent.glob("*.py")} - {"__init__"} | {
    path.parent.name for path in Path(zero_core.__file__).parent.glob("*/__init__.py")
}


def _plugin_files() -> list[Path]:
    return sorted(path for pattern in PLUGIN_SOURCES for src in ROOT.glob(pattern) for path in src.rglob("*.py"))


def _core_modules_used(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every zero_core module an import (or ``zero_core.<submodule>`` attribute) reaches, with its line."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "zero_core":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "zero_core":
            yield node.lineno, node.module
            if node.module == "zero_core":
                for alias in node.names:
                    if alias.name in CORE_SUBMODULES:
                        yield node.lineno, f"zero_core.{alias.name}"
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "zero_core":
            if node.attr in CORE_SUBMODULES:
                yield node.lineno, f"zero_core.{node.attr}"


def test_plugin_sources_are_found():
    files = _plugin_files()
    names = {path.relative_to(ROOT).parts[1] for path in files}
    assert {"comm", "comm-quantized", "strategies", "offload", "placement-lru"} <= names, f"plugin sources not found under {ROOT}: {names}"


def test_plugins_import_only_the_plugin_namespace():
    offences = []
    for path in _plugin_files():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, module in _core_modules_used(tree):
            if module not in ALLOWED:
                offences.append(f"{path.relative_to(ROOT)}:{line}: uses {module}")
    assert not offences, (
        "plugins may use zero-core only through `zero_core` and `zero_core.plugin`; import these names from "
        "`zero_core.plugin` instead (add a missing one to packages/core/src/zero_core/plugin.py):\n" + "\n".join(offences)
    )


def test_the_check_catches_each_way_of_reaching_a_private_module():
    source = (
        "import zero_core.base._accounting\n"
        "from zero_core.chunks.chunk import rewrap\n"
        "from zero_core import placement, plugin, Chunk\n"
        "import zero_core\n"
        "zero_core.base._accounting.in_engine_work\n"
        "from zero_core.plugin import Pending\n"
    )
    used = [(line, module) for line, module in _core_modules_used(ast.parse(source)) if module not in ALLOWED]
    assert sorted(used) == [(1, "zero_core.base._accounting"), (2, "zero_core.chunks.chunk"), (3, "zero_core.placement"), (5, "zero_core.base")]
