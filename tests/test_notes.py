"""Named notes resolve, and the zero modules that comments and docs name exist.

A *named note* is a long explanation in a comment or docstring headed by its name in brackets,
``[Note: ...]`` with the name inside, alone on its line; other places point at it by that bracketed
name (``See [Note: ...]``, also in backticks in the docs), sometimes naming the module that holds it
right after the ``]`` (or ``])``): ``in ``zero_core.x._y````, ``in `zero_core.x._y``` (Markdown),
``in :mod:`zero_core.x._y``` or ``in zero_core.x._y``, possibly across a line break.

Parsed, not imported. The text read is the comments and the string literals (docstrings, messages,
f-string text) of every Python file of every distribution (``packages/*/src``,
``packages/strategies/*/src``, ``benchmarks``, ``examples``), of the tests that read notes
(any file under a folder named ``tests``: ``tests``, ``packages/*/tests``,
``packages/strategies/*/tests``, ``examples/*/tests``), and every Markdown page under
``docs``; a bracketed name may wrap over lines (whitespace and comment markers between its words
count as one space). The checks:

(a) every note is defined exactly once (a definition is a bracketed name alone on its line, with the
    explanation on the lines after it);
(b) every note is referenced at least once outside its definition, by a library source or a page of
    the docs (a test that reads a note does not keep it alive alone);
(c) every reference names a defined note;
(d) a reference that names a module (the forms above) names the module that defines the note, or the
    top-level package of the distribution that holds it (``in zero_comm``);
(e) every dotted ``zero_*`` name in that text (``zero_core.chunks._slots``,
    ``:meth:`~zero_core.chunks._chunk_layout.ChunkLayout.from_gather_order```) names a module or
    package that exists under the source trees; the first name after the module is bound at the
    module's top level (a def, class, assignment or import, ``TYPE_CHECKING`` imports included) or is
    a submodule; and where that name is a class the module defines, a second name is bound in the
    class body. In the libraries' own modules, a Sphinx role with a short dotted target
    (``:attr:`Chunk.full```) is checked the same way against the names of the module it is written
    in, and ``:meth:`name``` written inside a class names a method of that class (or of the module).
    Deeper names, names from outside zero (torch's), and members of classes with bases are not
    checked; the tests are not read for (e) (they name made-up modules on purpose).

Failures name the file and line and say what to change.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = ("packages/*/src", "packages/strategies/*/src", "benchmarks", "examples")
MODULE_ROOTS = ("packages/*/src", "packages/strategies/*/src", "benchmarks", "examples/*/src")  # import roots
TEST_ROOTS = ("tests", "packages/*/tests", "packages/strategies/*/tests")
DOC_ROOTS = ("docs",)
PACKAGES = {"zero_core", "zero_comm", "zero_comm_quantized", "zero_strategy_chunk", "zero_strategy_tensor", "zero_offload",
            "zero_integrations", "zero_bench", "zero_placement_lru", "zero_strategy_nodelocal"}
SELF = Path(__file__).resolve()

# "[Note: name]"; the name may wrap (whitespace collapses), never holds a bracket.
_NOTE = re.compile(r"\[Note:\s+([^\[\]`]+?)\s*\]")
# What may follow a reference's "]" to name the module that holds the note.
_IN_MODULE = re.compile(r"\]`{0,2}\)?\s+in\s+(?:``?|:mod:`~?)?(zero_\w+(?:\.\w+)*)")
_DOTTED = re.compile(r"(?<![\w./-])((?:" + "|".join(sorted(PACKAGES)) + r")(?:\.[A-Za-z_]\w*)+)(?![\w*])")
# What may stand before a definition on its line: indentation, a comment's "#", a docstring's opening quotes.
_OPENS_LINE = re.compile(r"""\s*(#\s*|[rRuU]?(\"\"\"|\'\'\')\s*)?\Z""")
_ROLE = re.compile(r":(?:meth|attr|func|class|mod|data|obj):`~?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)`")
_METHOD_ROLE = re.compile(r":meth:`~?\.?([A-Za-z_]\w*)`")


@dataclass(frozen=True)
class Prose:
    """The readable text of one file: every other character blanked, so offsets keep their lines."""

    path: Path
    module: str | None  # the dotted module, for a Python file under a source root
    text: str
    kind: str  # "source", "test" or "doc"
    raw: str  # the file as written, offsets as in ``text``

    def line(self, offset: int) -> int:
        return self.text.count("\n", 0, offset) + 1

    @property
    def where(self) -> str:
        return str(self.path.relative_to(ROOT))


def _python_prose(source: str) -> str:
    """``source`` with everything but comment text and string contents blanked (newlines kept)."""
    lines = source.splitlines(keepends=True)
    out = [[" " if ch != "\n" else "\n" for ch in line] for line in lines]

    def keep(start: tuple[int, int], end: tuple[int, int]) -> None:
        (r0, c0), (r1, c1) = start, end
        for r in range(r0, r1 + 1):
            line = lines[r - 1]
            a = c0 if r == r0 else 0
            b = c1 if r == r1 else len(line)
            for c in range(a, b):
                if line[c] != "\n":
                    out[r - 1][c] = line[c]

    string_kinds = {tokenize.STRING} | {getattr(tokenize, n) for n in ("FSTRING_MIDDLE",) if hasattr(tokenize, n)}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            r, c = tok.start
            keep((r, c + 1), tok.end)
        elif tok.type in string_kinds:
            text = tok.string
            if tok.type == tokenize.STRING:  # the contents, without the prefix and the quotes
                body = text.lstrip("rRbBuUfF")
                quote = body[:3] if body[:3] in ('"""', "'''") else body[:1]
                r, c = tok.start
                c += len(text) - len(body) + len(quote)
                er, ec = tok.end
                keep((r, c), (er, ec - len(quote)))
            else:
                keep(tok.start, tok.end)
    return "".join("".join(line) for line in out)


def _module_name(path: Path) -> str | None:
    for pattern in MODULE_ROOTS:
        for root in ROOT.glob(pattern):
            if root in path.parents:
                parts = path.relative_to(root).with_suffix("").parts
                if parts and parts[0] in PACKAGES:
                    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return None


@cache
def prose() -> tuple[Prose, ...]:
    found: dict[Path, Prose] = {}
    for kind, roots in (("source", SOURCE_ROOTS), ("test", TEST_ROOTS)):
        for pattern in roots:
            for root in sorted(ROOT.glob(pattern)):
                for path in sorted(root.rglob("*.py")):
                    if path == SELF or path in found or ".nox" in path.parts:
                        continue
                    raw = path.read_text(encoding="utf-8")
                    tests = "tests" in path.relative_to(ROOT).parts  # tests/, packages/*/tests, examples/*/tests
                    found[path] = Prose(path, _module_name(path), _python_prose(raw), "test" if tests else kind, raw)
    for pattern in DOC_ROOTS:
        for root in ROOT.glob(pattern):
            for path in sorted(root.rglob("*.md")):
                raw = path.read_text(encoding="utf-8")
                found[path] = Prose(path, None, raw, "doc", raw)
    return tuple(found.values())


@dataclass(frozen=True)
class Mention:
    name: str
    file: Prose
    offset: int
    end: int
    definition: bool

    @property
    def where(self) -> str:
        return f"{self.file.where}:{self.file.line(self.offset)}"


def mentions(files: tuple[Prose, ...]) -> Iterator[Mention]:
    """Every bracketed note name in ``files``, each marked as a definition or a reference."""
    for file in files:
        text = file.text
        for match in _NOTE.finditer(text):
            name = " ".join(match.group(1).split())
            start, end = match.start(), match.end()
            line_start = text.rfind("\n", 0, start) + 1
            line_end = text.find("\n", end)
            line_end = len(text) if line_end < 0 else line_end
            alone = bool(_OPENS_LINE.match(file.raw[line_start:start])) and not file.raw[end:line_end].strip()
            following = text[line_end + 1:text.find("\n", line_end + 1)].strip() if line_end < len(text) else ""
            yield Mention(name, file, start, end, alone and "\n" not in match.group(0) and bool(following))


@cache
def notes(files: tuple[Prose, ...] | None = None) -> tuple[dict[str, list[Mention]], list[Mention]]:
    """Note name -> its definitions; and every reference (in ``files``, every file read by default)."""
    definitions: dict[str, list[Mention]] = {}
    references: list[Mention] = []
    for mention in mentions(prose() if files is None else files):
        if mention.definition:
            definitions.setdefault(mention.name, []).append(mention)
        else:
            references.append(mention)
    return definitions, references


@cache
def modules() -> dict[str, Path]:
    """Dotted module or package name -> its file, under every source root."""
    found: dict[str, Path] = {}
    for file in prose():
        if file.module is not None:
            found[file.module] = file.path
    return found


@cache
def bound_names(module: str) -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """The names ``module`` binds at top level (if/try blocks included), and each class's own names."""
    tree = ast.parse(modules()[module].read_text(encoding="utf-8"))
    names: set[str] = set()
    classes: dict[str, frozenset[str]] = {}

    def targets(node: ast.AST) -> Iterator[str]:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                yield sub.id

    def body_names(body: list[ast.stmt]) -> set[str]:
        out: set[str] = set()
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    out.update(targets(target))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                out.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For)):
                for block in ("body", "orelse", "finalbody", "handlers"):
                    for part in getattr(node, block, []):
                        out.update(body_names(part.body if isinstance(part, ast.ExceptHandler) else [part]))
        return out

    names = body_names(tree.body)
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            own = body_names(node.body)
            for sub in ast.walk(node):  # self.x = ... in methods: attributes of the instances
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and \
                        isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    own.add(sub.attr)
            classes[node.name] = frozenset(own)
    return frozenset(names), classes


def resolve(dotted: str, home: str | None = None) -> str | None:
    """Why ``dotted`` does not resolve (None when it does); ``home``: the module a short name is read in."""
    mods = modules()
    parts = dotted.split(".")
    if home is not None and parts[0] not in PACKAGES:
        if home not in mods:
            return None
        names, classes = bound_names(home)
        if parts[0] not in names:
            return None  # a name from elsewhere (torch's, a builtin's): not ours to check
        if parts[0] in classes and parts[1] not in classes[parts[0]] and not _inherits(home, parts[0]):
            return f"class {parts[0]} of {home} has no {parts[1]!r}"
        return None
    for cut in range(len(parts), 0, -1):
        if ".".join(parts[:cut]) in mods:
            break
    else:
        return f"no module or package {parts[0]!r} under the source trees"
    module, rest = ".".join(parts[:cut]), parts[cut:]
    if not rest:
        return None
    names, classes = bound_names(module)
    if rest[0] not in names:
        kind = "module" if rest[0].startswith("_") or rest[0].islower() else "name"
        return f"{module} has no {kind} {rest[0]!r}"
    if len(rest) > 1 and rest[0] in classes and rest[1] not in classes[rest[0]] and not _inherits(module, rest[0]):
        return f"class {module}.{rest[0]} has no {rest[1]!r}"
    return None


def enclosing_classes(module: str) -> list[tuple[int, int, str]]:
    """(first line, last line, name) of each top-level class of ``module``."""
    tree = ast.parse(modules()[module].read_text(encoding="utf-8"))
    return [(node.lineno, node.end_lineno or node.lineno, node.name) for node in tree.body
            if isinstance(node, ast.ClassDef)]


def _inherits(module: str, cls: str) -> bool:
    """Whether ``cls`` of ``module`` has a base other than ``object`` (its names may come from there)."""
    tree = ast.parse(modules()[module].read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return any(not (isinstance(b, ast.Name) and b.id in ("object", "Protocol", "Generic")) and
                       not (isinstance(b, ast.Subscript)) for b in node.bases)
    return False


# ---------------------------------------------------------------------------------------------------------------
def defined_twice(definitions: dict[str, list[Mention]]) -> list[str]:
    return [f"  [Note: {n}]: " + ", ".join(m.where for m in found)
            for n, found in sorted(definitions.items()) if len(found) > 1]


def unreferenced(definitions: dict[str, list[Mention]], references: list[Mention]) -> list[str]:
    used = {m.name for m in references if m.file.kind != "test"}
    return [f"  {definitions[n][0].where}: [Note: {n}]" for n in sorted(set(definitions) - used)]


def dangling(definitions: dict[str, list[Mention]], references: list[Mention]) -> list[str]:
    return [f"  {m.where}: [Note: {m.name}]" for m in references if m.name not in definitions]


def wrong_modules(definitions: dict[str, list[Mention]], references: list[Mention]) -> list[str]:
    wrong = []
    for m in references:
        if m.name not in definitions:
            continue
        named = _IN_MODULE.match(" ".join(m.file.text[m.end - 1:m.end + 200].split()))
        if named is None:
            continue
        home = definitions[m.name][0].file.module or definitions[m.name][0].file.where
        if named.group(1) not in (home, home.split(".")[0]):
            wrong.append(f"  {m.where}: [Note: {m.name}] names {named.group(1)}; it is defined in {home}")
    return wrong


def _fake(name: str, module: str | None, source: str, kind: str = "source") -> Prose:
    path = ROOT / name
    text = _python_prose(source) if name.endswith(".py") else source
    return Prose(path, module, text, kind, source)


def test_the_reader_finds_notes():
    definitions, references = notes()
    assert len(definitions) > 50 and len(references) > 200, (len(definitions), len(references))
    assert "chunk layout" in definitions and "zero_core.chunks.chunk" in modules()
    assert definitions["two ranks on gloo"][0].file.module == "zero_comm._torch_backend"
    text = _python_prose('x = 1  # see [Note: a\n# b] in ``zero_core.y``\n"""[Note: c d]\nwhy."""\n')
    assert "[Note: a" in text and "x" not in text and '"""' not in text


def test_the_checks_find_what_they_look_for():
    files = (
        _fake("a.py", "zero_core.a", '"""A.\n\n[Note: one]\nWhy one.\n\n[Note: two]\nWhy two.\n"""\n'
              "x = 1  # [Note: one]\n# see [Note: one] in ``zero_core.b``, [Note: three] and\n"
              "# [Note: two\n# wrapped] in `zero_core.a`\n"),
        _fake("b.py", "zero_core.b", "# [Note: one]\n# a second definition\n# See [Note: two] in\n# zero_core.a.\n"),
        _fake("t.py", None, '"""See [Note: two]."""\n', kind="test"),
        _fake("d.md", None, "See `[Note: one]` in `zero_core.c`.\n", kind="doc"),
    )
    definitions, references = notes(files)
    assert sorted(definitions) == ["one", "two"] and len(definitions["one"]) == 2
    assert [m.name for m in references] == ["one", "one", "three", "two wrapped", "two", "two", "one"]
    assert defined_twice(definitions) == ["  [Note: one]: a.py:3, b.py:1"]
    assert unreferenced({"two": definitions["two"]}, [m for m in references if m.name != "two"]) == [
        "  a.py:6: [Note: two]"]
    assert dangling(definitions, references) == ["  a.py:10: [Note: three]", "  a.py:11: [Note: two wrapped]"]
    assert wrong_modules(definitions, references) == [
        "  a.py:10: [Note: one] names zero_core.b; it is defined in zero_core.a",
        "  d.md:1: [Note: one] names zero_core.c; it is defined in zero_core.a"]
    assert resolve("zero_core.chunks._slots") is None and resolve("zero_core.plugin.CollectiveKind") is None
    assert resolve("zero_core.chunks._chunk_layout.ChunkLayout.from_gather_order") is None
    assert resolve("zero_core._chunk_grads") == "zero_core has no module '_chunk_grads'"
    assert resolve("zero_core.chunks._chunk_layout.ChunkLayout.gone") == \
        "class zero_core.chunks._chunk_layout.ChunkLayout has no 'gone'"


def test_every_note_is_defined_once():
    found = defined_twice(notes()[0])
    assert not found, "notes defined more than once (keep one definition, alone on its line; make the others " \
        "references, 'See [Note: ...] in ``module``'):\n" + "\n".join(found)


def test_every_note_is_referenced():
    found = unreferenced(*notes())
    assert not found, "notes no library source or doc page refers to (add 'See [Note: ...]' where the code " \
        "relies on it, or fold the note into one that is referenced):\n" + "\n".join(found)


def test_every_reference_resolves():
    found = dangling(*notes())
    assert not found, "references to notes that are not defined (correct the name to a defined note, or define " \
        "it):\n" + "\n".join(found)


def test_references_name_the_module_that_holds_the_note():
    found = wrong_modules(*notes())
    assert not found, "references that name the wrong module (name the module that defines the note):\n" + \
        "\n".join(found)


def test_named_zero_modules_exist():
    broken = []
    for file in prose():
        if file.kind == "test":  # tests name made-up modules on purpose
            continue
        for match in _DOTTED.finditer(file.text):
            dotted = match.group(1).rstrip(".")
            why = resolve(dotted)
            if why:
                broken.append(f"  {file.where}:{file.line(match.start())}: {dotted}: {why}")
        if file.module is None:
            continue
        for match in _ROLE.finditer(file.text):
            if match.group(1).startswith("zero_"):
                continue
            why = resolve(match.group(1), home=file.module)
            if why:
                broken.append(f"  {file.where}:{file.line(match.start())}: {match.group(1)}: {why}")
        for match in _METHOD_ROLE.finditer(file.text):  # :meth:`name` inside a class: a method of that class
            line = file.line(match.start())
            owner = [name for first, last, name in enclosing_classes(file.module) if first <= line <= last]
            if owner and not _inherits(file.module, owner[0]):
                names, classes = bound_names(file.module)
                if match.group(1) not in classes[owner[0]] | names:
                    broken.append(f"  {file.where}:{line}: :meth:`{match.group(1)}`: class {owner[0]} of "
                                  f"{file.module} has no method {match.group(1)!r}")
    assert not broken, "names of zero modules and attributes that do not exist (correct them to the current " \
        "module or name):\n" + "\n".join(broken)
