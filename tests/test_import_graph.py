"""The import graph of every distribution has no cycle, so every import points down.

Parsed, not imported: every ``import`` statement counts, at the top of a module, inside a
function, or under ``if TYPE_CHECKING:`` (a lazy or typing-only import is still a knot a reader
and a refactoring must untie). An import of a package's own ``__init__`` counts as an edge to it
(``from zero_core import ZeroConfig`` inside zero_core makes the module depend on everything the
package re-exports); the implicit import of a submodule's parent package does not. An acyclic
graph has a layering in which every arrow points to a lower layer, which is what this keeps true.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Every distribution's import roots: the packages, the benchmark harness and the example plugins.
SOURCE_ROOTS = ("packages/*/src", "packages/strategies/*/src", "benchmarks", "examples/*/src")
PACKAGES = {"zero_core", "zero_comm", "zero_comm_quantized", "zero_strategy_chunk", "zero_strategy_tensor", "zero_offload",
            "zero_integrations", "zero_bench"}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of every distribution."""
    found: dict[str, Path] = {}
    for pattern in SOURCE_ROOTS:
        for root in ROOT.glob(pattern):
            for path in root.rglob("*.py"):
                parts = path.relative_to(root).with_suffix("").parts
                if parts[0] not in PACKAGES or "tests" in parts:
                    continue
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                found[name] = path
    return found


def _imports(name: str, path: Path, modules: Mapping[str, Path]) -> Iterator[tuple[str, int]]:
    """The modules of ``modules`` that ``name`` (at ``path``) imports, with the line of each import."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, up level - 1
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    yield sub, node.lineno
                elif target in modules:
                    yield target, node.lineno


def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {imported module: line of the first such import}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for target, line in _imports(name, path, modules):
            if target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _describe(component: list[str], graph: Mapping[str, Mapping[str, int]], modules: Mapping[str, Path]) -> str:
    members = set(component)
    lines = [f"cycle of {len(component)} modules:"]
    for name in component:
        for target, line in sorted(graph[name].items()):
            if target in members:
                lines.append(f"  {modules[name].relative_to(ROOT)}:{line}: {name} imports {target}")
    return "\n".join(lines)


def test_every_distribution_is_found():
    graph = import_graph()
    roots = {name.split(".")[0] for name in graph}
    assert roots == PACKAGES | {"zero_lru", "zero_nodelocal"} or PACKAGES <= roots, roots
    assert len(graph) > 100, f"only {len(graph)} modules found under {ROOT}"
    assert "zero_core.runtime._engine" in graph["zero_core._module"], "the parser lost a plain top-level import"


def test_the_detector_finds_cycles():
    # The detector itself: a two-module and a three-module cycle, a self-contained tail, a diamond.
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"g", "h"}, "g": {"i"}, "h": {"i"}, "i": set()}
    assert cycles(graph) == [["a", "b"], ["c", "d", "e"]]
    assert cycles({"x": {"y"}, "y": set()}) == []


def test_the_detector_sees_lazy_and_typing_only_imports(tmp_path):
    pkg = tmp_path / "zero_core"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zero_core.high import X\n")
    (pkg / "high.py").write_text("def f():\n    from zero_core import low\n")
    modules = {"zero_core": pkg / "__init__.py", "zero_core.low": pkg / "low.py", "zero_core.high": pkg / "high.py"}
    graph = {name: {t for t, _ in _imports(name, path, modules)} - {name} for name, path in modules.items()}
    assert cycles(graph) == [["zero_core.high", "zero_core.low"]]


def test_no_import_cycle():
    modules = _modules()
    graph = import_graph()
    found = cycles(graph)
    assert not found, (
        "import cycles (every import counts, also inside functions and under TYPE_CHECKING); move the shared "
        "names down to a module both can import, or pass the object in instead of importing its module:\n"
        + "\n".join(_describe(c, graph, modules) for c in found)
    )


# --- layers (installed by restructure.py) ---
# zero_core's rooms, lowest first. A module may import its own room and the rooms before it; an import of a room
# after it is an upward import (imports inside functions and under TYPE_CHECKING count, as above). "top" is
# zero_core's top-level modules (the public verbs and the old paths' shims), "testing" is zero_core.testing, and
# "cli" is last: nothing in the libraries imports the command line.
LAYERS = ('base', 'config', 'comm', 'chunks', 'interfaces', 'runtime', 'setup', 'checkpoint', 'tools', 'top', 'testing', 'cli')
# Registered paths kept as aliases of a room's module (entry points in packages/core/pyproject.toml): they belong
# to the room they alias.
ALIASES = {"zero_core._cli": "cli", "zero_core._default_plugins": "interfaces"}


def room_of(name: str) -> str | None:
    """The room of a zero_core module, by its dotted name; None outside zero_core."""
    parts = name.split(".")
    if parts[0] != "zero_core":
        return None
    if name in ALIASES:
        return ALIASES[name]
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "top"


def upward_imports(graph: Mapping[str, Mapping[str, int]], modules: Mapping[str, Path]) -> list[str]:
    found = []
    for name, edges in sorted(graph.items()):
        room = room_of(name)
        if room is None:
            continue
        for target, line in sorted(edges.items()):
            other = room_of(target)
            if other is not None and LAYERS.index(other) > LAYERS.index(room):
                found.append(f"{modules[name].relative_to(ROOT)}:{line}: {name} (room {room}) imports {target} "
                             f"(room {other}, above it) in {modules[target].relative_to(ROOT)}")
    return found


def test_every_room_is_a_layer():
    rooms = {p.name for p in (ROOT / "packages/core/src/zero_core").iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(LAYERS) - {"top"}, f"rooms on disk {sorted(rooms)} != LAYERS {LAYERS}"


def test_the_layer_check_finds_upward_imports():
    modules = {"zero_core.base.low": ROOT / "x.py", "zero_core.runtime.high": ROOT / "y.py",
               "zero_core.cli.cmd": ROOT / "z.py", "zero_bench.run": ROOT / "w.py"}
    graph = {"zero_core.base.low": {"zero_core.runtime.high": 3}, "zero_core.runtime.high": {"zero_core.base.low": 1},
             "zero_core.cli.cmd": {"zero_core.runtime.high": 1}, "zero_bench.run": {}}
    assert upward_imports(graph, modules) == [
        "x.py:3: zero_core.base.low (room base) imports zero_core.runtime.high (room runtime, above it) in y.py"]
    assert cli_importers({"zero_bench.run": {"zero_core.cli.cmd": 2}}, modules) == [
        "w.py:2: zero_bench.run imports zero_core.cli.cmd, the command line"]


def test_no_upward_import_between_rooms():
    found = upward_imports(import_graph(), _modules())
    assert not found, (
        "imports from a lower room of zero_core to a higher one (LAYERS in tests/test_import_graph.py, lowest "
        "first; docs/architecture.md says what each room holds); move the shared names down, or pass the object in:\n"
        + "\n".join(found))


def cli_importers(graph: Mapping[str, Mapping[str, int]], modules: Mapping[str, Path]) -> list[str]:
    return [f"{modules[name].relative_to(ROOT)}:{line}: {name} imports {target}, the command line"
            for name, edges in sorted(graph.items()) if room_of(name) not in ("cli",)
            for target, line in sorted(edges.items()) if room_of(target) == "cli" and name not in ALIASES]


def test_no_library_imports_the_command_line():
    graph = import_graph()
    found = [line for line in cli_importers(graph, _modules()) if not line.split(": ")[1].startswith("zero_bench")]
    assert not found, "the libraries import zero_core.cli; the command line calls them, not the other way:\n" + "\n".join(found)
