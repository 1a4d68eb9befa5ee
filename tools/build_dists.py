"""Build every zero distribution with pypa ``build`` and check what each wheel holds.

``nox -s build`` runs this; tests/test_packaging.py runs it too (``--wheel``), so the wheels the
test installs are built the way the session builds them. The distributions are every
pyproject.toml with a ``[project]`` table under packages/ and benchmarks/.

    python tools/build_dists.py                      # sdists and wheels of all of them into dist/
    python tools/build_dists.py --wheel --outdir /tmp/w packages/core packages/comm
"""

from __future__ import annotations

import argparse
import configparser
import subprocess
import sys
import tomllib
import zipfile
from email.parser import HeaderParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEARCHED = ("packages", "benchmarks")


def distributions(root: Path = ROOT) -> list[Path]:
    """The folders under packages/ and benchmarks/ whose pyproject.toml declares a ``[project]``."""
    found = []
    for top in SEARCHED:
        for pyproject in sorted((root / top).rglob("pyproject.toml")):
            if any(part in {".nox", "build", "dist"} or part.startswith(".") for part in pyproject.relative_to(root).parts):
                continue
            if "project" in tomllib.loads(pyproject.read_text()):
                found.append(pyproject.parent)
    return found


def clean(outdir: Path) -> None:
    """Remove earlier sdists and wheels only, so a mistyped --outdir loses nothing else."""
    outdir.mkdir(parents=True, exist_ok=True)
    for old in [*outdir.glob("*.whl"), *outdir.glob("*.tar.gz")]:
        old.unlink()


def build(project: Path, outdir: Path, *, wheel_only: bool) -> None:
    # Without --wheel, build makes the sdist and then the wheel from that sdist, which also proves the
    # sdist is complete.
    cmd = [sys.executable, "-m", "build", "--outdir", str(outdir), *(["--wheel"] if wheel_only else []), str(project)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"building {project.relative_to(ROOT)} failed:\n{proc.stdout}\n{proc.stderr}")


def _wheel_of(project: dict, outdir: Path) -> Path:
    stem = project["name"].replace("-", "_")
    wheels = sorted(outdir.glob(f"{stem}-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"expected one wheel of {project['name']} in {outdir}, found {[w.name for w in wheels]}")
    return wheels[0]


def wheel_problems(project_dir: Path, outdir: Path, license_text: bytes) -> list[str]:
    """What is wrong with the wheel built from ``project_dir``: empty when it is fine."""
    pyproject = tomllib.loads((project_dir / "pyproject.toml").read_text())
    project = pyproject["project"]
    wheel = _wheel_of(project, outdir)
    problems = []
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        packages = pyproject.get("tool", {}).get("hatch", {}).get("build", {}).get("targets", {}).get("wheel", {}).get("packages", [])
        for package in packages:
            name = Path(package).name
            if f"{name}/py.typed" not in names:
                problems.append(f"{name}/py.typed is missing: type checkers would ignore the package's annotations")
        # The repository's tests/ folders and pytest files stay out; the test kit zero_core.testing is shipped on purpose.
        shipped_tests = [n for n in names if "tests" in n.split("/")[:-1] or Path(n).name.startswith("test_") or Path(n).name == "conftest.py"]
        if shipped_tests:
            problems.append(f"tests are inside the wheel: {shipped_tests[:5]}")
        licence = f"{dist_info}/licenses/LICENSE"
        if licence not in names:
            problems.append(f"{licence} is missing: copy the root LICENSE into {project_dir} and list it in license-files")
        elif archive.read(licence) != license_text:
            problems.append(f"{licence} differs from the repository's LICENSE: copy the root LICENSE into {project_dir}")
        metadata = HeaderParser().parsestr(archive.read(f"{dist_info}/METADATA").decode())
        if metadata.get("License-Expression") != project.get("license"):
            problems.append(f"METADATA says License-Expression {metadata.get('License-Expression')!r}, pyproject {project.get('license')!r}")
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode() if f"{dist_info}/entry_points.txt" in names else ""
    shipped = configparser.ConfigParser(delimiters=("=",), interpolation=None)
    shipped.optionxform = str  # entry-point names are case-sensitive
    shipped.read_string(entry_points)
    declared = {("console_scripts", k, v) for k, v in project.get("scripts", {}).items()}
    declared |= {(group, k, v) for group, points in project.get("entry-points", {}).items() for k, v in points.items()}
    for group, name, target in sorted(declared):
        if shipped.get(group, name, fallback="").strip() != target:
            problems.append(f"entry point [{group}] {name} = {target} is not in entry_points.txt")
    return [f"{wheel.name}: {p}" for p in problems]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("projects", nargs="*", type=Path, help="distribution folders (default: every one found)")
    parser.add_argument("--outdir", type=Path, default=ROOT / "dist", help="where the files go; its old sdists and wheels are removed")
    parser.add_argument("--wheel", action="store_true", help="wheels only, built straight from the source tree (no sdists)")
    args = parser.parse_args(argv)
    projects = [p.resolve() for p in args.projects] or distributions()
    license_text = (ROOT / "LICENSE").read_bytes()
    clean(args.outdir)
    for project in projects:
        build(project, args.outdir, wheel_only=args.wheel)
        print(f"built {project.relative_to(ROOT)}", flush=True)
    problems = [p for project in projects for p in wheel_problems(project, args.outdir, license_text)]
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 1
    for path in sorted(args.outdir.iterdir()):
        if path.suffix == ".whl" or path.name.endswith(".tar.gz"):
            print(f"{path.stat().st_size / 1024:8.0f} KiB  {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
