"""Every ``pip install`` command the documentation shows, and whether each works from a fresh clone as written.

The commands are taken from the Markdown a user reads first (README.md, docs/, examples/*/README.md and each
distribution's README.md): fenced code blocks and inline code spans. tests/test_install_lines.py checks each one
against what the repository provides (see ``problems``); ``nox -s install_lines`` runs them for real, each in a
fresh virtual environment inside a fresh clone with the wheels of ``nox -s build`` in dist/ (see ``run``).

    python tools/install_lines.py                  # list them: file:line  command
    python tools/install_lines.py --check          # the static checks only; exit 1 naming each problem
    python tools/install_lines.py --run CLONE      # install each in a fresh venv inside CLONE (slow; --only TEXT: a subset)
"""

from __future__ import annotations

import argparse
import functools
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]

# The one torch the documentation installs: the CPU build CI tests (an unpinned torch would pull CUDA wheels).
TORCH = "torch==2.13.0"
# Placeholders the text uses for "your checkout" and "your dist folder", and what they stand for in a clone.
PLACEHOLDERS = {"CHECKOUT/": "", "/path/to/zero/": "", ".../dist": "dist"}
# Folders of built wheels: dist/, which `nox -s build` writes; any other must be the --outdir of a
# tools/build_dists.py command on the same page.
BUILT = {"dist"}
# pip options the commands use; one that takes a value lists it here.
OPTIONS_WITH_VALUE = {"-e", "--editable", "-f", "--find-links", "--target", "-r", "--requirement"}
FLAGS = {"--no-index", "--no-deps", "--dry-run", "-U", "--upgrade"}
# zero as the README's editable install has it: where a quoted hint is run.
ZERO_EDITABLE = ("packages/core", "packages/comm", "packages/strategies/chunk", "packages/strategies/tensor", "packages/offload")
# The pages that quote the install hint zero itself prints (zero_core.base._install.install_command): that hint is
# given inside an environment where zero is installed, so the zero distributions it needs are there already, and
# it is checked for its names, paths and extras only. (page, command as tokens joined by one space): the hint.
QUOTED_HINTS = {
    ("docs/cli.md", "-e CHECKOUT/benchmarks[plot,rich]"): "what `zero bench` prints when zero-bench is missing",
    ("docs/troubleshooting.md", "-e benchmarks[plot,rich]"): "what `zero bench` prints when zero-bench is missing",
    ("docs/plugins.md", "-e /path/to/zero/packages/offload"): "what a registry lookup prints for an uninstalled built-in",
}


def documents(root: Path = ROOT) -> list[Path]:
    """The Markdown files whose install commands are checked."""
    found = [root / "README.md", *sorted((root / "docs").rglob("*.md")), *sorted((root / "examples").glob("*/README.md")),
             *sorted((root / "packages").rglob("README.md")), root / "benchmarks" / "README.md"]
    return [p for p in found if p.is_file() and not any(part.startswith(".") or part in {"site", "build", "dist"}
                                                         for part in p.relative_to(root).parts)]


@dataclass
class InstallLine:
    path: Path  # the Markdown file
    line: int  # where the command starts in it
    command: str  # everything after "pip install", placeholders as written
    tokens: list[str] = field(default_factory=list)

    def where(self, root: Path = ROOT) -> str:
        return f"{self.path.relative_to(root)}:{self.line}"


_FENCE = re.compile(r"^(\s*)(```+|~~~+)")
_INLINE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_PIP = re.compile(r"\bpip install\b")
# Where a command ends inside a span: a shell separator, a comment, or the end of a parenthesis in prose.
_END = re.compile(r"\s(?:#|&&|\|\|)|[;|)]|(?<!\.)\.(?:\s|$)")


def _commands_in(text: str) -> list[str]:
    out = []
    for match in _PIP.finditer(text):
        rest = text[match.end():]
        end = _END.search(rest)
        command = (rest[:end.start()] if end else rest).strip()
        if command:
            out.append(command)
    return out


def extract(path: Path) -> list[InstallLine]:
    """The ``pip install`` commands of one Markdown file, from code blocks (with ``\\`` continuations) and inline code."""
    lines = path.read_text().splitlines()
    found: list[InstallLine] = []
    prose: list[tuple[int, str]] = []  # (line number, text) outside code blocks
    fence = None
    i = 0
    while i < len(lines):
        text = lines[i]
        opened = _FENCE.match(text)
        if fence is None and opened:
            fence = opened.group(2)
        elif fence is not None and text.strip().startswith(fence):
            fence = None
        elif fence is not None:
            start = i
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i].strip()
            found += [InstallLine(path, start + 1, c) for c in _commands_in(text)]
        else:
            prose.append((i + 1, text))
        i += 1
    # Inline code can wrap across lines of one paragraph; join the paragraph, then map a span back to its line.
    paragraph: list[tuple[int, str]] = []
    for number, text in [*prose, (0, "")]:
        if text.strip():
            paragraph.append((number, text))
            continue
        joined = "\n".join(t for _, t in paragraph)
        for span in _INLINE.finditer(joined):
            line = paragraph[joined[:span.start()].count("\n")][0]
            found += [InstallLine(path, line, c) for c in _commands_in(span.group(2).replace("\n", " "))]
        paragraph = []
    for item in found:
        item.tokens = shlex.split(item.command)
    return sorted(found, key=lambda item: item.line)


def all_lines(root: Path = ROOT) -> list[InstallLine]:
    return [line for path in documents(root) for line in extract(path)]


@functools.cache
def projects(root: Path = ROOT) -> dict[str, Path]:
    """Every distribution the repository holds (packages/, benchmarks/, examples/): canonical name -> folder."""
    found = {}
    for top in ("packages", "benchmarks", "examples"):
        for pyproject in sorted((root / top).rglob("pyproject.toml")):
            if any(part.startswith(".") or part in {"build", "dist"} for part in pyproject.relative_to(root).parts):
                continue
            meta = tomllib.loads(pyproject.read_text()).get("project")
            if meta:
                found[canonicalize_name(meta["name"])] = pyproject.parent
    return found


def _meta(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]


def _zero_dependencies(folder: Path) -> set[str]:
    return {canonicalize_name(Requirement(d).name) for d in _meta(folder).get("dependencies", [])
            if canonicalize_name(Requirement(d).name).startswith("zero-")}


def _substitute(token: str) -> str:
    for placeholder, value in PLACEHOLDERS.items():
        token = token.replace(placeholder, value)
    return token


def _is_path(token: str) -> bool:
    return token.startswith((".", "/")) or "/" in token.split("[")[0] or token.endswith(".whl")


@dataclass
class Parsed:
    names: list[Requirement] = field(default_factory=list)  # requirements by name
    paths: list[tuple[str, set[str]]] = field(default_factory=list)  # (path relative to the clone, extras)
    find_links: list[str] = field(default_factory=list)
    flags: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)


def parse(item: InstallLine) -> Parsed:
    out = Parsed()
    tokens = iter(item.tokens)
    for token in tokens:
        if token in OPTIONS_WITH_VALUE:
            value = _substitute(next(tokens, ""))
            if token in ("-f", "--find-links"):
                out.find_links.append(value)
            elif token in ("-e", "--editable"):
                path, _, extras = value.partition("[")
                out.paths.append((path, set(extras.rstrip("]").split(",")) - {""}))
            elif token in ("-r", "--requirement") and not (ROOT / value).is_file():
                out.problems.append(f"requirements file {value} does not exist")
        elif token in FLAGS:
            out.flags.add(token)
        elif token.startswith("-"):
            out.problems.append(f"option {token} is not one tools/install_lines.py knows: add it there")
        elif _is_path(_substitute(token)):
            path, _, extras = _substitute(token).partition("[")
            out.paths.append((path, set(extras.rstrip("]").split(",")) - {""}))
        else:
            try:
                out.names.append(Requirement(token))
            except InvalidRequirement as error:
                out.problems.append(f"{token!r} is neither a path nor a requirement: {error}")
    return out


def problems(item: InstallLine, root: Path = ROOT) -> list[str]:
    """What makes the command fail, or install something else than meant, when run as written from a fresh clone
    (after ``nox -s build`` where it uses dist/). Empty when it is fine."""
    parsed = parse(item)
    found = list(parsed.problems)
    known = projects(root)
    page = item.path.read_text()
    installed: dict[str, Path] = {}  # the zero distributions the command installs, name -> folder
    for req in parsed.names:
        name = canonicalize_name(req.name)
        if name == "torch" and str(req) != TORCH:
            found.append(f"installs {req}: pin {TORCH}, the build CI tests (an unpinned torch pulls CUDA wheels)")
        if not name.startswith("zero-"):
            continue
        if name not in known:
            found.append(f"{req.name} is not a distribution of this repository (they are {', '.join(sorted(known))})")
            continue
        installed[name] = known[name]
        missing = req.extras - set(_meta(known[name]).get("optional-dependencies", {}))
        if missing:
            found.append(f"{req.name} has no extra {sorted(missing)}")
        if not parsed.find_links:
            found.append(f"{req.name} is not on any package index: add --find-links dist (the wheels of `nox -s build`)")
    for path, extras in parsed.paths:
        folder = root / path
        if "*" in path:
            built = path.split("/")[0]
            if built not in BUILT and f"--outdir {built}" not in page.replace("\n", " "):
                found.append(f"{path}: nothing on this page builds {built}/ (tools/build_dists.py --outdir {built})")
            continue
        if not (folder / "pyproject.toml").is_file():
            found.append(f"{path} is not a project folder of this repository")
            continue
        name = canonicalize_name(_meta(folder)["name"])
        installed[name] = folder
        missing = extras - set(_meta(folder).get("optional-dependencies", {}))
        if missing:
            found.append(f"{path} has no extra {sorted(missing)}")
    for folder in parsed.find_links:
        if folder not in BUILT and f"--outdir {folder}" not in page.replace("\n", " "):
            found.append(f"--find-links {folder}: no command on this page builds {folder}/")
    quoted = (item.path.relative_to(root).as_posix(), " ".join(item.tokens)) in QUOTED_HINTS
    if not parsed.find_links and "--no-deps" not in parsed.flags and not quoted:
        for name, folder in installed.items():
            for dependency in sorted(_zero_dependencies(folder) - set(installed)):
                found.append(f"{name} needs {dependency}, which is on no package index: install it in the same command "
                             f"(-e {known[dependency].relative_to(root)}) or add --find-links dist")
    return found


def third_party(lines: list[InstallLine]) -> list[str]:
    """The names from a package index that the commands install (not zero's, which come from dist/ or the clone)."""
    names = {str(req) for item in lines for req in parse(item).names if not canonicalize_name(req.name).startswith("zero-")}
    return sorted(names)


def run(clone: Path, only: str = "") -> int:
    """Each command as written (``pip`` being a fresh venv's), inside ``clone``, which holds dist/ already.

    The pages say to install torch first (the build your machine needs), so each venv starts with torch 2.13.0, the
    CPU build CI tests: installed once into a folder that each venv sees through a .pth file (a command naming
    ``torch==2.13.0`` finds it satisfied; without it, pip would fetch the newest CUDA torch for every command).
    Commands with ``--target`` or a wheel glob need folders only another machine's instructions make: skipped. A
    quoted hint (QUOTED_HINTS) runs where zero is installed: its venv gets zero's editable install of the README first."""
    work = clone / ".install-lines"
    torch_dir = work / "torch"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    if not torch_dir.is_dir():
        subprocess.run([*pip, "install", "--no-compile", "--target", str(torch_dir), TORCH], check=True)
    failed = []
    for index, item in enumerate(all_lines(clone)):
        shown = f"{item.where(clone)}  pip install {item.command}"
        tokens = [_substitute(t) for t in item.tokens]
        if only not in shown:
            continue
        if "--target" in tokens or any("*" in t for t in tokens):
            print(f"skipped (needs another machine's folders): {shown}", flush=True)
            continue
        venv = work / str(index)
        subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)], check=True)
        site = next(venv.glob("lib/python*/site-packages"))
        (site / "zero_install_lines_torch.pth").write_text(f"{torch_dir}\n")
        print(shown, flush=True)
        install = [*pip, "--python", str(venv / "bin" / "python"), "install", "--no-compile"]
        if (item.path.relative_to(clone).as_posix(), " ".join(item.tokens)) in QUOTED_HINTS:
            subprocess.run([*install, *(arg for path in ZERO_EDITABLE for arg in ("-e", path))], cwd=clone, check=True)
        if subprocess.run([*install, *tokens], cwd=clone).returncode != 0:
            failed.append(shown)
    for shown in failed:
        print(f"FAILED: {shown}", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="the static checks; exit 1 naming each problem")
    parser.add_argument("--run", type=Path, metavar="CLONE", help="install each command in a fresh venv inside CLONE")
    parser.add_argument("--only", default="", metavar="TEXT", help="with --run: only the commands whose 'file:line  command' holds TEXT")
    args = parser.parse_args(argv)
    if args.run:
        return run(args.run.resolve(), args.only)
    lines = all_lines()
    bad = 0
    for item in lines:
        print(f"{item.where()}  pip install {item.command}")
        for problem in problems(item) if args.check else []:
            print(f"    {problem}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
