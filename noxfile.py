"""Sessions: ``nox -s tests`` (the test suite), ``nox -s build`` (sdists and wheels into dist/),
``nox -s demo`` (2-rank training of a byte-level GPT on the standard library's sources),
``nox -s docs`` (strict docs build), ``nox -s docs_screenshots`` (the built site checked in headless Chromium),
``nox -s hf_trainer`` (the HF Trainer example on 2 ranks), ``nox -s soak`` (long fuzz and soak runs),
``nox -s "frameworks(lowest)"`` and ``nox -s "frameworks(newest)"`` (the integrations' tests at each end of the
transformers, accelerate and lightning ranges the extras allow),
``nox -s bench`` (every strategy and policy against DDP and FSDP2),
``nox -s gpu`` (one GPU's figures into a report; ``-- --dry-run`` on the CPU),
``nox -s microbench`` (pytest-benchmark micro-benchmarks of the collectives on 2 gloo ranks;
pass pytest-benchmark options after ``--``, e.g. ``--benchmark-compare``),
``nox -s install_lines`` (every ``pip install`` command of the docs, run as written in a fresh clone),
``nox -s lint`` (``ruff check .`` with pyproject.toml's rules; ruff options after ``--``) and
``nox -s typecheck`` (mypy over the seven libraries, settings in pyproject.toml's ``[tool.mypy]``;
mypy options after ``--``). CI (.ci/run) runs tests, "frameworks(lowest)", docs, lint and typecheck."""

from __future__ import annotations

import shutil
from pathlib import Path

import nox

nox.options.sessions = ["tests", "docs"]
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True

# The CPU build of torch 2.13.0 is what CI provides; an unpinned torch would pull CUDA wheels.
TORCH = "torch==2.13.0"
# the suite's default: as many workers as cores, at most 4 (each worker spawns worlds of up to 4 ranks)
PARALLEL = ["-n", "auto", "--maxprocesses", "4", "--dist", "loadfile"]
PACKAGES = ["packages/core", "packages/comm", "packages/comm-quantized", "packages/strategies/chunk", "packages/strategies/tensor",
            "packages/offload"]


def install_zero(session: nox.Session, *extra: str) -> None:
    # pip is silent under nox for the minute torch's first install takes: say what is coming first.
    session.log(f"installing {TORCH} (about 200 MB on a first run, quiet for up to a minute or two)")
    session.install(TORCH)
    session.log("installing zero (" + ", ".join(PACKAGES) + ")" + (f" and {' '.join(extra)}" if extra else ""))
    session.install(*[arg for path in PACKAGES for arg in ("-e", path)], *extra)


@nox.session
def tests(session: nox.Session) -> None:
    """Unit tests of every package plus the cross-package parity, counting and demo tests."""
    # build: tests/test_packaging.py builds the wheels as `nox -s build` does; matplotlib: the bench's plots are tested;
    # benchmarks: the bench's tests run it, and `zero bench` is the command it registers (entry-point group zero.cli)
    # pytest-xdist: most tests run Python on one core (one rank, or ranks waiting on each other), so two workers
    # keep both of CI's cores busy; --dist loadfile keeps a file on one worker, so its module-scoped models,
    # checkpoints and spawned worlds are made once. Options after -- replace these (``-- -n 0`` runs serially).
    install_zero(session, "pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "rich>=13", "build>=1.2",
                 "matplotlib>=3.8", "-e", "packages/integrations[hf,lightning]", "-e", "benchmarks")
    session.run("pytest", *(session.posargs or PARALLEL))


@nox.session(default=False)
def build(session: nox.Session) -> None:
    """Every distribution's sdist and wheel into dist/, each wheel's contents checked.

    The distributions are the pyproject.toml files under packages/ and benchmarks/; tools/build_dists.py
    builds each wheel from its sdist and checks py.typed, LICENSE, entry points and that no tests ship.
    Install from them with ``pip install --find-links dist zero-core zero-strategy-chunk``.
    """
    session.log("installing build (pypa's sdist and wheel builder)")
    session.install("build>=1.2")
    session.run("python", "tools/build_dists.py", "--outdir", "dist", *session.posargs)


@nox.session(default=False)
def soak(session: nox.Session) -> None:
    """The long runs of the robustness tests: the random user-action driver with more seeds and longer
    sequences, and the 1,000-step heap and hook soak at every stage; and the cases the suite runs fewer of:
    every DeepSpeed schedule under ZeroTrainer at 2 ranks (the suite runs two there, all six at 1 rank)
    (``ZERO_SOAK=1``)."""
    install_zero(session, "pytest>=8", "pytest-timeout>=2.3", "-e", "packages/integrations[hf]")
    session.run("pytest", "tests/test_fuzz.py", "tests/test_robust.py::test_long_run_keeps_heap_and_hooks_flat",
                "tests/test_deepspeed_scheduler.py::"
                "test_zero_trainer_at_two_ranks_follows_each_schedule_and_training_arguments_deepspeed_works",
                "-p", "no:cacheprovider", *session.posargs, env={"ZERO_SOAK": "1"})


@nox.session
def demo(session: nox.Session) -> None:
    """Train a byte-level GPT on the Python standard library's own sources on 2 CPU ranks, launched by
    torchrun (examples/text_lm): lazy init, accumulation with no_sync, clipping, evaluation, a checkpoint,
    Hugging Face export and a sample. Options after -- go to the example, e.g. ``-- --stop-after 100`` then
    ``-- --resume``. The synthetic-data GPT of examples/train_gpt.py runs with torchrun directly."""
    install_zero(session)  # the example needs nothing beyond zero and torch (safetensors comes with zero-core)
    session.run("python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "examples/text_lm/train.py", *session.posargs)


@nox.session(default=False)
def hf_trainer(session: nox.Session) -> None:
    """Fine-tune a small GPT-2 with the HuggingFace Trainer under zero on 2 CPU ranks, then reload it with
    ``from_pretrained`` (examples/hf_trainer.py)."""
    install_zero(session, "-e", "packages/integrations[hf]")
    session.run("python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "examples/hf_trainer.py", *session.posargs)


# Each end of the framework ranges the zero-integrations extras allow (packages/integrations/pyproject.toml), pinned:
# the lowest releases the integrations' tests pass with, and the newest the package index has (transformers 5.25
# needs kernels>=0.19.1, which it lacks). Raising a bound is a change here, in the extras and in the docs' tables.
FRAMEWORKS = {
    "lowest": ("transformers==5.5.4", "accelerate==1.14.0", "lightning==2.5.0"),
    "newest": ("transformers==5.24.0", "accelerate==1.16.0", "lightning==2.6.6"),
}
# the tests that import the frameworks through zero_integrations, and transformers' own models under zero
FRAMEWORK_TESTS = ("packages/integrations/tests", "tests/test_transformers.py", "tests/test_deepspeed_scheduler.py")


@nox.session(default=False)
@nox.parametrize("end", list(FRAMEWORKS), ids=list(FRAMEWORKS))
def frameworks(session: nox.Session, end: str) -> None:
    """The integrations' tests (HF Trainer, Accelerate loops, Lightning strategy, transformers models) against one
    end of the ranges the extras allow: ``nox -s "frameworks(lowest)"`` or ``nox -s "frameworks(newest)"``.

    The pins are installed together with the extras, so pip refuses a pin the extras' ranges exclude. Serial (the
    files spawn their own 2-rank worlds); options after -- go to pytest. CI runs the lowest end: ``nox -s tests``
    covers whatever pip resolves, the newest releases as they come out.
    """
    install_zero(session, "pytest>=8", "pytest-timeout>=2.3", "-e", "packages/integrations[hf,lightning,accelerate]",
                 *FRAMEWORKS[end])
    session.run("pytest", *FRAMEWORK_TESTS, "-p", "no:cacheprovider", *session.posargs)


@nox.session(default=False)
def install_lines(session: nox.Session) -> None:
    """Every ``pip install`` command of README.md, docs/ and the examples' and distributions' READMEs, run as
    written, each in a fresh virtual environment inside a fresh clone of the committed tree with the wheels of
    ``nox -s build`` in its dist/ (tools/install_lines.py; the suite's tests/test_install_lines.py checks the same
    commands without installing). Slow: each command installs torch anew; ``-- --list`` only lists them."""
    session.log("installing build and packaging (to build the wheels and read the commands)")
    session.install("build>=1.2", "packaging>=24")
    if "--list" in session.posargs:
        session.run("python", "tools/install_lines.py")
        return
    clone = Path(session.create_tmp()).resolve() / "clone"
    shutil.rmtree(clone, ignore_errors=True)
    session.log(f"cloning the committed tree into {clone} and building every wheel into its dist/")
    session.run("git", "clone", "--quiet", "--no-hardlinks", ".", str(clone), external=True)
    session.run("python", str(clone / "tools" / "build_dists.py"), "--wheel", "--outdir", str(clone / "dist"))
    session.run("python", str(clone / "tools" / "install_lines.py"), "--run", str(clone))


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site with the pinned packages of docs/requirements.txt; warnings are errors."""
    session.log("installing docs/requirements.txt (mkdocs and its plugins, pinned)")
    session.install("-r", "docs/requirements.txt")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")


@nox.session(default=False)
def docs_screenshots(session: nox.Session) -> None:
    """Build the site, open its key pages in headless Chromium with no network beyond localhost, check them
    (diagrams drawn as SVG, nothing fetched off the machine, no sideways scrolling) and save screenshots to
    site-screenshots/. Needs a system Chromium (``apt-get install chromium``); ``-- --pages a/index.html ...``
    checks other pages (docs/_ext/site_check.py). Without apt, npm's registry has a self-contained build:
    ``npm install @sparticuz/chromium@143`` then ``node -e "require('@sparticuz/chromium').executablePath()
    .then(console.log)"`` unpacks it to /tmp/chromium; run ``nox -s docs_screenshots -- --chromium /tmp/chromium``."""
    session.log("installing docs/requirements.txt and playwright (pinned; Chromium is the system's)")
    session.install("-r", "docs/requirements.txt", "playwright==1.65.2")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")
    session.run("python", "docs/_ext/site_check.py", "--site", "site", "--out", "site-screenshots", *session.posargs)


@nox.session(default=False)
def gpu(session: nox.Session) -> None:
    """What one GPU says about zero, in about 8 minutes: ``nox -s gpu -- --out DIR`` writes DIR/report.md and results.json.

    The environment, copy bandwidth, gloo's CUDA collectives, GPT-2-medium training against plain PyTorch and
    FSDP2, the CUDA test subset and the largest model under one device budget (docs/benchmarks-gpu.md).
    ``-- --dry-run --out DIR`` runs it all on the CPU with tiny sizes. On a GPU machine pip's torch 2.13.0 is
    the CUDA build.
    """
    install_zero(session, "-e", "benchmarks", "pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5")
    session.run("python", "-m", "zero_bench.gpu", *session.posargs)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Every registered strategy, stage, comm backend and placement policy against DDP and FSDP2,
    plus device-mesh rows at 4 ranks: HSDP on a 2x2 mesh and full sharding on 1x4 (``--meshes``),
    each beside DDP and FSDP2 on the same 4 ranks.

    Writes benchmarks/results/latest.{json,md,png} and latest-memory.png (``-- --out DIR`` for another folder). Options after
    -- go to the bench, e.g. ``nox -s bench -- --quick`` (about 5 minutes on 2 quiet CPU cores), ``-- --meshes ''``
    to leave the mesh rows out, ``-- --help`` for the rest. The bench is the zero-bench distribution
    (benchmarks/pyproject.toml), installed editable with its plot and rich extras; where it is installed,
    ``zero bench ARGS`` and ``zero-bench ARGS`` run the same.
    """
    install_zero(session, "-e", "benchmarks[plot,rich]")
    session.run("python", "-m", "zero_bench", *session.posargs)


@nox.session(default=False)
def microbench(session: nox.Session) -> None:
    """Reduce-scatter and gather micro-benchmarks on 2 gloo ranks; results in benchmarks/results/.

    Writes benchmarks/results/micro.json and autosaves each run under benchmarks/results/micro/,
    so ``nox -s microbench -- --benchmark-compare`` compares with the last saved run. The test
    paths in pyproject.toml leave benchmarks/ out, so ``nox -s tests`` never runs these.
    """
    install_zero(session, "pytest>=8", "pytest-benchmark>=4", "pytest-timeout>=2.3")
    session.run("pytest", "benchmarks/micro", "-p", "no:cacheprovider", "--benchmark-json", "benchmarks/results/micro.json",
                "--benchmark-autosave", "--benchmark-storage", "benchmarks/results/micro", *session.posargs)


# Exact linter and checker versions: a new release brings new rules and new inferences, so moving to one is a
# change of its own (fix what it finds, then raise the pin).
RUFF = "ruff>=0.17.6,<0.18"
MYPY = "mypy==2.4.1"


@nox.session(default=False)
def lint(session: nox.Session) -> None:
    """``ruff check .`` with the rules of pyproject.toml's ``[tool.ruff]``: every Python file in the repository.

    Needs nothing but ruff (no torch, no zero). Options after -- go to ruff, e.g. ``nox -s lint -- --fix``.
    """
    session.log(f"installing {RUFF}")
    session.install(RUFF)
    session.run("ruff", "check", ".", *session.posargs)


@nox.session(default=False)
def typecheck(session: nox.Session) -> None:
    """mypy over the seven libraries (zero_core, zero_comm, zero_comm_quantized, the two strategies, zero_offload, zero_integrations).

    The packages, search path and strictness are pyproject.toml's ``[tool.mypy]``; torch, pluggy,
    safetensors and numpy are typed and installed here, the integrations' optional frameworks
    (transformers, lightning) are not: mypy treats them as untyped. Options after -- go to mypy,
    e.g. ``nox -s typecheck -- --no-incremental``. The cache lives in the session's virtual environment.
    """
    install_zero(session, MYPY, "types-PyYAML", "-e", "packages/integrations")
    session.run("mypy", "--cache-dir", f"{session.virtualenv.location}/mypy-cache", *session.posargs)
