"""The README's install works from built wheels, at the declared dependency floors.

tools/build_dists.py (what ``nox -s build`` runs) builds every distribution's wheel and checks its
contents; meanwhile a fresh venv (no system site-packages: nothing from this checkout) gets torch and
every floor that zero-core, zero-comm, zero-strategy-chunk and zero-comm-quantized declare, pinned exactly. Then
the README's line ``pip install --find-links dist zero-core zero-strategy-chunk`` runs as written; it must keep
the floors, so what the metadata promises is what ran; zero-comm-quantized then installs on its own beside them and
registers its backends through the entry points. Two steps train at 2 ranks under torchrun, a full state
dict round-trips through safetensors' reader, ``zero --help`` runs from the venv, and the example's
progress bar draws with the ``[examples]`` extra's rich at its floor.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
from _checked_run import run_checked as _run
from _fresh_venv import make_fresh_venv, run_temp
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = ["packages/core", "packages/comm", "packages/strategies/chunk", "packages/comm-quantized"]

TRAIN = textwrap.dedent(
    """
    import math
    import sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import zero_core
    from zero_core import ChunkPolicy, ZeroConfig

    assert "site-packages" in zero_core.__file__, zero_core.__file__  # the wheel, not the checkout


    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))


    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    config = ZeroConfig(strategy="chunk", chunk=ChunkPolicy(chunk_size=128), collective_timeout_s=60)
    before = {name: p.detach().clone() for name, p in build().named_parameters()}
    model = build()
    model, optimizer = zero_core.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        loss = model(inputs).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    after = model.full_parameters()
    assert all(math.isfinite(x) for x in losses), losses
    unchanged = [name for name, value in before.items() if torch.equal(value, after[name])]
    assert not unchanged, f"two steps left {unchanged} unchanged"

    # load_from reads with safetensors' safe_open: the declared safetensors floor is exercised too
    path = sys.argv[1]
    zero_core.save_full_state_dict(model, path)
    model.close()
    fresh = build()
    reloaded, _ = zero_core.shard(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), config=config, load_from=path)
    again = reloaded.full_parameters()
    assert all(torch.equal(again[name], after[name]) for name in after), "the reloaded parameters differ"
    reloaded.close()
    print(f"rank {rank}: ok, losses " + " ".join(f"{x:.5f}" for x in losses), flush=True)
    dist.destroy_process_group()

    if rank == 0:  # here rather than in a process of its own, which would import torch once more
        sys.path.insert(0, sys.argv[2])
        import train_gpt

        progress = train_gpt.progress_display("zero x2", total=2)
        assert progress is not None, "zero-core[examples] installed rich, yet the example fell back to plain lines"
        progress.update(progress.task_ids[0], completed=2, info="loss 1.000")
        progress.stop()
        print("the example's progress display: ok", flush=True)
    """
)



def declared_floors(projects: list[str], extras: tuple[str, ...] = ("examples",)) -> dict[str, str]:
    """``name: version`` of every ``>=`` floor the projects' pyproject.toml declare (zero's own excluded)."""
    floors: dict[str, str] = {}
    for project in projects:
        meta = tomllib.loads((ROOT / project / "pyproject.toml").read_text())["project"]
        lines = [*meta.get("dependencies", []),
                 *(line for extra in extras for line in meta.get("optional-dependencies", {}).get(extra, []))]
        for req in map(Requirement, lines):
            if req.name.startswith("zero-"):
                continue
            lower = [spec.version for spec in req.specifier if spec.operator == ">="]
            assert lower, f"{project} declares {req} without a floor"
            assert floors.setdefault(req.name, lower[0]) == lower[0], f"{req.name}: two floors, {floors[req.name]} and {lower[0]}"
    return floors


def _build_dists():
    spec = importlib.util.spec_from_file_location("build_dists", ROOT / "tools" / "build_dists.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FAKE_PYPROJECT = """
[project]
name = "zero-fake"
license = "Apache-2.0"
scripts = { zero-fake = "zero_fake.cli:main" }
entry-points.zero = { fake = "zero_fake.plugin" }
[tool.hatch.build.targets.wheel]
packages = ["src/zero_fake"]
"""


def _fake_wheel(outdir: Path, files: dict[str, str | bytes]) -> None:
    outdir.mkdir(exist_ok=True)
    with zipfile.ZipFile(outdir / "zero_fake-0.1.0-py3-none-any.whl", "w") as archive:
        for name, content in files.items():
            archive.writestr(name, content)


def test_the_framework_sessions_pin_the_ends_of_the_extras_ranges() -> None:
    """``nox -s "frameworks(lowest)"`` tests the extras' floors exactly and ``frameworks(newest)`` a release inside
    their ranges; the support table of the docs names both ends (noxfile.py read as text: nox need not be installed)."""
    import ast

    tree = ast.parse((ROOT / "noxfile.py").read_text())
    ends = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "FRAMEWORKS" for t in node.targets))
    assert set(ends) == {"lowest", "newest"}
    extras = tomllib.loads((ROOT / "packages/integrations/pyproject.toml").read_text())["project"]["optional-dependencies"]
    ranges: dict[str, list] = {}
    for extra in ("hf", "lightning", "accelerate"):
        for line in extras[extra]:
            requirement = Requirement(line)
            ranges.setdefault(requirement.name, []).append(requirement.specifier)
    table = (ROOT / "docs/integrations/hf-trainer.md").read_text()
    for end, pins in ends.items():
        pinned = {Requirement(pin).name: Version(str(Requirement(pin).specifier).removeprefix("==")) for pin in pins}
        assert set(pinned) == {"transformers", "accelerate", "lightning"} <= set(ranges), (end, pinned)
        for name, version in pinned.items():
            for specifier in ranges[name]:
                assert specifier.contains(version), f"frameworks({end}) pins {name}=={version}, outside the extras' {specifier}"
                floor = next(Version(s.version) for s in specifier if s.operator == ">=")
                assert end != "lowest" or version == floor, f"frameworks(lowest) pins {name}=={version}, the floor is {floor}"
            assert f"{name} {version}" in table, f"the support table of docs/integrations/hf-trainer.md lacks {name} {version}"


def test_the_wheel_check_names_each_problem(tmp_path: Path) -> None:
    build_dists = _build_dists()
    assert {p.relative_to(ROOT).as_posix() for p in build_dists.distributions()} >= {*INSTALLED, "packages/offload",
                                                                                    "packages/strategies/tensor", "packages/integrations"}
    (tmp_path / "pyproject.toml").write_text(FAKE_PYPROJECT)
    licence = (ROOT / "LICENSE").read_bytes()
    good = {"zero_fake/__init__.py": "", "zero_fake/py.typed": "", "zero_fake-0.1.0.dist-info/METADATA": "License-Expression: Apache-2.0\n",
            "zero_fake-0.1.0.dist-info/licenses/LICENSE": licence,
            "zero_fake-0.1.0.dist-info/entry_points.txt": "[console_scripts]\nzero-fake = zero_fake.cli:main\n\n[zero]\nfake = zero_fake.plugin\n"}
    _fake_wheel(tmp_path / "good", good)
    assert build_dists.wheel_problems(tmp_path, tmp_path / "good", licence) == []

    bad = {name: content for name, content in good.items() if not name.endswith(("py.typed", "entry_points.txt"))}
    bad["zero_fake/tests/test_it.py"] = ""
    bad["zero_fake-0.1.0.dist-info/licenses/LICENSE"] = b"another licence"
    _fake_wheel(tmp_path / "bad", bad)
    problems = "\n".join(build_dists.wheel_problems(tmp_path, tmp_path / "bad", licence))
    for expected in ("zero_fake/py.typed is missing", "tests are inside the wheel: ['zero_fake/tests/test_it.py']",
                     "differs from the repository's LICENSE", "[console_scripts] zero-fake = zero_fake.cli:main is not in",
                     "[zero] fake = zero_fake.plugin is not in"):
        assert expected in problems, problems


@pytest.mark.timeout(600)
def test_wheels_install_at_their_floors_and_train(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    started = time.perf_counter()

    def lap(what: str) -> None:  # shown with -s, and with a failure: where the time goes
        print(f"{time.perf_counter() - started:6.1f}s  {what}", flush=True)

    dist_dir = tmp_path / "dist"
    build = subprocess.Popen([sys.executable, str(ROOT / "tools" / "build_dists.py"), "--wheel", "--outdir", str(dist_dir)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # torch alone (hard links to the run's template, tests/_fresh_venv.py); nothing of the checkout
        venv = make_fresh_venv(tmp_path / "venv", shared=run_temp(tmp_path_factory), with_pytest=False)
        python, bindir, env, pip = venv.python, venv.bindir, venv.env, venv.pip

        floors = declared_floors(INSTALLED)
        assert floors["torch"] == "2.13", floors  # the first torch with all_gather_single / reduce_scatter_single
        # torch==2.13 is the CPU build from the configured find-links, as in CI
        _run([*pip, *(f"{name}=={version}" for name, version in floors.items())], env=env, cwd=tmp_path, timeout=400)
        lap("torch and the floors installed: " + " ".join(f"{name}=={version}" for name, version in floors.items()))
        out, _ = build.communicate(timeout=400)
    finally:
        build.kill()
    assert build.returncode == 0, out
    for project in (ROOT / p for p in INSTALLED):
        assert f"built {project.relative_to(ROOT)}" in out, out
    lap("wheels built and checked")

    # The README's line as written, from the wheels just built; then its offline form for the extra
    _run([*pip, "--find-links", str(dist_dir), "zero-core", "zero-strategy-chunk"], env=env, cwd=tmp_path, timeout=120)
    _run([*pip, "--no-index", "--find-links", str(dist_dir), "zero-core[examples]"], env=env, cwd=tmp_path, timeout=120)
    versions = _run([python, "-c", "import importlib.metadata as m, sys; print('\\n'.join(f'{n} {m.version(n)}' for n in sys.argv[1:]))",
                     *floors], env=env, cwd=tmp_path, timeout=180).stdout
    installed = dict(line.split() for line in versions.splitlines())
    for name, floor in floors.items():
        assert Version(Version(installed[name]).public) == Version(floor), f"{name} {installed[name]} was installed, not its floor {floor}"
    lap("zero-core, zero-comm, zero-strategy-chunk installed from dist/; the floors kept")
    # a distribution of its own: installed by name beside the others, found through the `zero` entry points
    _run([*pip, "--no-index", "--find-links", str(dist_dir), "zero-comm-quantized"], env=env, cwd=tmp_path, timeout=120)
    found = _run([python, "-c", "from zero_core.plugin import ZeroPlugins; b = ZeroPlugins.load().comm_backends; "
                  "print(*(b.get(n).__module__ for n in ('quantized', 'quantized-params', 'quantized-grads', "
                  "'quantized-int4', 'quantized-int4-params', 'quantized-int4-grads')))"],
                 env=env, cwd=tmp_path, timeout=180).stdout.split()
    assert found == ["zero_comm_quantized._backend"] * 6, found
    lap("zero-comm-quantized installed from dist/; its backends registered")

    help_text = _run([str(bindir / "zero"), "--help"], env=env, cwd=tmp_path, timeout=120).stdout
    assert "usage: zero" in help_text, help_text

    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    proc = _run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
                 str(tmp_path / "model.safetensors"), str(ROOT / "examples")], env=env, cwd=tmp_path, timeout=180)
    assert proc.stdout.count(": ok, losses") == 2, proc.stdout + proc.stderr
    assert "the example's progress display: ok" in proc.stdout, proc.stdout + proc.stderr
    lap("zero --help; two steps at 2 ranks; the example's progress bar: " + proc.stdout.strip().replace("\n", "; "))
