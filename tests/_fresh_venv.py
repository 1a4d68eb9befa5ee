"""Fresh virtual environments for the install tests, with torch installed once per suite run.

Three tests install zero from its wheels or sources into an environment that holds nothing of this checkout
(tests/test_packaging.py, test_offload_plugin_install.py and test_strategy_plugin_install.py). Each needs
torch, and installing torch's CPU wheel (about 750 MB unpacked, byte-compiled by default) cost each of them
30-80 s of a core. Here pip installs torch once per run into a template environment, and pytest and
pytest-timeout into a second one made of the first's hard links (the floors test takes the first: pytest 8
would not accept its pluggy floor). Every xdist worker of the run shares them through lock files beside the
workers' temporary folders; each test gets a new ``python -m venv`` whose site-packages are hard links to a
template's.
What a test installs or removes afterwards is its own: pip unlinks or renames files and writes new ones, so
the template is never written through a link. The environments stay fresh in what the tests check: no system
site-packages, nothing importable from the checkout, zero installed by the test's own pip call.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
from _checked_run import run_checked

TORCH = "torch==2.13.0"
PYTEST = ["pytest>=8", "pytest-timeout>=2.3"]


@dataclass(frozen=True, kw_only=True)
class FreshVenv:
    """A new environment: its interpreter, an environment mapping that runs it first, and pip for it."""

    root: Path
    python: str
    bindir: Path
    env: dict[str, str]

    @property
    def pip(self) -> list[str]:
        # This interpreter's pip installs into the venv (--python): the venv carries no pip of its own.
        # --no-compile: byte-compiling what is installed would cost more than the tests that import it.
        return [sys.executable, "-m", "pip", "--python", self.python, "install", "--disable-pip-version-check",
                "--no-input", "--no-compile"]


def _site_packages(venv: Path) -> Path:
    relative = Path(sysconfig.get_path("purelib")).relative_to(sysconfig.get_path("data"))
    return venv / relative


def _new_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=60)
    return path / "bin"


def _environment(bindir: Path) -> dict[str, str]:
    # The caller's environment (pip's index and find-links settings among them), with the venv first on PATH and
    # nothing that would import from the checkout or user site-packages, disable plugins, set zero's options or
    # tell torchrun's ranks a local world size of their own.
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "LOCAL_WORLD_SIZE") and not k.startswith("ZERO_")}
    env.update(VIRTUAL_ENV=str(bindir.parent), PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}", PYTHONNOUSERSITE="1")
    return env


def _link_site_packages(source: Path, venv: Path) -> None:
    subprocess.run(["cp", "-al", f"{_site_packages(source)}/.", str(_site_packages(venv))], check=True, timeout=120)


def _template(shared: Path, layers: list[list[str]]) -> Path:
    """The environment with every layer's packages, made by the first test of the run that asks for it: each
    layer's template is the one before it (hard links) plus one pip call, so torch is installed once per run."""
    below: Path | None = None
    installed: list[str] = []
    for packages in layers:
        installed = [*installed, *packages]
        name = "zero-venv-" + "-".join(p.split("=")[0].split(">")[0] for p in installed)
        template = shared / name
        shared.mkdir(parents=True, exist_ok=True)
        with open(shared / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other workers wait here while the first one installs
            marker = template / "complete"
            if not marker.exists() or marker.read_text() != " ".join(installed):
                shutil.rmtree(template, ignore_errors=True)  # a half-made one from an interrupted run
                bindir = _new_venv(template)
                if below is not None:
                    _link_site_packages(below, template)
                run_checked([sys.executable, "-m", "pip", "--python", str(bindir / "python"), "install",
                             "--disable-pip-version-check", "--no-input", "--no-compile", *packages],
                            env=_environment(bindir), cwd=shared, timeout=600)
                marker.write_text(" ".join(installed))
        below = template
    assert below is not None
    return below


def run_temp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temporary folder all xdist workers of this run share (the workers' own folders are its children)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def make_fresh_venv(path: Path, *, shared: Path, with_pytest: bool = True) -> FreshVenv:
    """A new venv at ``path`` holding torch, and pytest and pytest-timeout unless ``with_pytest`` is false
    (hard links to the run's template in ``shared``, a folder every worker of the run sees: the conftest's
    ``fresh_venv`` fixture passes it)."""
    template = _template(shared, [[TORCH], PYTEST] if with_pytest else [[TORCH]])
    bindir = _new_venv(path)
    _link_site_packages(template, path)
    return FreshVenv(root=path, python=str(bindir / "python"), bindir=bindir, env=_environment(bindir))
