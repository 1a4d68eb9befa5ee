"""Every ``pip install`` command the documentation shows works from a fresh clone as written.

tools/install_lines.py extracts them (README.md, docs/, examples/*/README.md, each distribution's README.md) and
checks each against what the repository provides: zero's distribution names and extras exist, paths are project
folders, zero's distributions come from ``--find-links dist`` (they are on no index) or from the same command,
torch is ``torch==2.13.0``. Here: that check over every command, that it catches each kind of mistake, that the
names from the package index resolve there (one ``pip --dry-run``), and that the README states zero-core's real
dependencies and floors. ``nox -s install_lines`` runs every command for real in a fresh clone.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("install_lines", ROOT / "tools" / "install_lines.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["install_lines"] = module  # dataclasses resolve annotations through the module
    spec.loader.exec_module(module)
    return module


install_lines = _tool()


def _line(command: str, page: str = "README.md"):
    return install_lines.InstallLine(ROOT / page, 1, command, shlex.split(command))


def test_every_install_command_in_the_docs_works_from_a_fresh_clone() -> None:
    lines = install_lines.all_lines()
    found = {(item.path.relative_to(ROOT).as_posix(), " ".join(item.tokens)) for item in lines}
    # The extraction finds the commands a reader runs first (a regression to finding nothing would pass vacuously).
    for expected in [("README.md", "--find-links dist zero-core zero-strategy-chunk"),
                     ("docs/getting-started.md", "torch==2.13.0 -e packages/core -e packages/comm -e packages/strategies/chunk "
                                                 "-e packages/strategies/tensor -e packages/offload"),
                     ("examples/placement-lru/README.md",
                      "torch==2.13.0 --find-links dist zero-core zero-strategy-chunk zero-offload ./examples/placement-lru")]:
        assert expected in found, sorted(found)
    assert len(lines) >= 40, [item.where() for item in lines]
    for key in install_lines.QUOTED_HINTS:
        assert key in found, f"QUOTED_HINTS names {key}, which no page shows any more: remove it from tools/install_lines.py"
    report = [f"{item.where()}  pip install {item.command}: {problem}" for item in lines for problem in install_lines.problems(item)]
    assert not report, "\n".join(report)


@pytest.mark.parametrize(("command", "expected"), [
    ("torch zero-core", "installs torch: pin torch==2.13.0"),
    ("--find-links dist torch>=2.13 zero-core", "installs torch>=2.13: pin torch==2.13.0"),
    ("zero-core", "zero-core is not on any package index: add --find-links dist"),
    ("--find-links dist zero-cor", "zero-cor is not a distribution of this repository"),
    ("--find-links dist zero-integrations[hff]", "zero-integrations has no extra ['hff']"),
    ("-e packages/nope", "packages/nope is not a project folder of this repository"),
    ("-e benchmarks[plots]", "benchmarks has no extra ['plots']"),
    ("torch==2.13.0 -e packages/offload", "zero-offload needs zero-core, which is on no package index"),
    ("--find-links wheels2 zero-core", "--find-links wheels2: no command on this page builds wheels2/"),
    ("--no-deps --target /tmp/x wheels2/*.whl", "nothing on this page builds wheels2/"),
    ("--frobnicate zero-core", "option --frobnicate is not one tools/install_lines.py knows"),
])
def test_the_check_names_each_mistake(command: str, expected: str) -> None:
    problems = install_lines.problems(_line(command))
    assert any(expected in problem for problem in problems), problems


def test_a_good_command_has_no_problems() -> None:
    for command in ["torch==2.13.0 -e packages/core -e packages/offload -e examples/placement-lru pytest",
                    "--find-links dist zero-core zero-strategy-chunk \"zero-integrations[hf]\"",
                    "--no-index --no-deps --target /tmp/site .gpuwheels/*.whl"]:
        assert install_lines.problems(_line(command, "docs/benchmarks-gpu.md")) == [], command


def test_extraction_reads_code_blocks_continuations_and_inline_code(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("Prose `pip install --find-links\ndist zero-core` wraps; `pip install` alone is a word.\n\n"
                    "```bash\npip install torch==2.13.0 -e packages/core \\\n    -e packages/comm   # a comment\n"
                    "python -m pip install nox && python -m nox -s build\n```\n"
                    "Then `pip install pyyaml`. Or (`pip install -e 'x'`).\n")
    got = [(item.line, item.tokens) for item in install_lines.extract(page)]
    assert got == [(1, ["--find-links", "dist", "zero-core"]),
                   (5, ["torch==2.13.0", "-e", "packages/core", "-e", "packages/comm"]),
                   (7, ["nox"]), (9, ["pyyaml"]), (9, ["-e", "x"])], got


def test_the_names_from_the_index_resolve_there() -> None:
    """The third-party names the commands install exist on the configured index (no download of torch: --dry-run)."""
    names = install_lines.third_party(install_lines.all_lines())
    assert "torch==2.13.0" in names and "nox" in names, names
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
                           "--disable-pip-version-check", "--no-input", *names], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Would install" in proc.stdout, proc.stdout


def test_the_readme_states_zero_cores_real_dependencies_and_floors() -> None:
    core = tomllib.loads((ROOT / "packages" / "core" / "pyproject.toml").read_text())["project"]
    declared = [Requirement(line) for line in core["dependencies"]]
    names = [req.name for req in declared]
    for page in ("README.md", "docs/getting-started.md"):
        text = " ".join((ROOT / page).read_text().split())
        stated = re.search(r"\(zero-core's: ([^)]*)\)", text)
        assert stated, f"{page} no longer says \"(zero-core's: ...)\""
        assert [n.strip() for n in stated.group(1).split(",")] == names, f"{page}: {stated.group(0)} but pyproject.toml: {names}"

    # The floors the README says tests/test_packaging.py installs: zero-core's, plus its [examples] extra's.
    floors = {}
    for line in [*core["dependencies"], *core["optional-dependencies"]["examples"]]:
        req = Requirement(line)
        floors[req.name] = next(spec.version for spec in req.specifier if spec.operator == ">=")
    text = " ".join((ROOT / "README.md").read_text().split())
    sentence = re.search(r"at every declared floor \((.*?)\) and trains", text)
    assert sentence, "README.md no longer lists the floors as \"at every declared floor (...) and trains\""
    stated_floors = dict(re.findall(r"\b([a-z][a-z0-9-]*) (\d+(?:\.\d+)*)\b", sentence.group(1)))
    assert stated_floors == floors, f"README.md: {stated_floors}; pyproject.toml: {floors}"
