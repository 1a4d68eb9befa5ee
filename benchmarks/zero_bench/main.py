"""The command line of ``nox -s bench`` (options after ``--``).

    nox -s bench -- --quick                     # the tiny model, 6 steps, 2 launches per row: about 5 minutes on 2 quiet CPU cores
    nox -s bench                                # GPT-2 small's shape, 10 steps
    nox -s bench -- --model demo --world-size 4 --strategies chunk --stages 3 --policies device,gemini
    nox -s bench -- --quick --meshes 2x2,1x4,4x1 --mesh-stages 1,2,3   # HSDP 2x2, full sharding 1x4, plain DP 4x1
    nox -s bench -- --quick --compare benchmarks/results/baseline.json --threshold 0.15
    nox -s bench -- --compare-only benchmarks/results/baseline.json   # no run: latest.json against it
    nox -s bench -- --host-overhead             # host cost per unit: the 48-block MLP on 1 and 2 ranks, host-overhead.*
    nox -s bench -- --quick --repeat 1          # one launch per row (default 2: each row's spread, and which order holds)

Each configuration trains in its own torchrun launch (so peak memory is its own), for the same steps
on the same data (a mesh row, and the references beside it, on the mesh's own ranks), ``--repeat`` times,
interleaved; a row's step time is the median over every timed step of its launches, with their spread. Results go
to ``--out`` (a checkout's ``benchmarks/results``, else ``./bench-results``): ``latest.json``
(schema in docs/benchmarks.md), a Markdown table to stdout and ``latest.md``, the plot to
``latest.png`` and each row's memory across one sampled step to ``latest-memory.png``. The exit status is 1 when
any configuration failed, trained a different model (losses disagree), or regressed against
``--compare``; 0 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from zero_bench import compare as compare_mod
from zero_bench import host_overhead
from zero_bench.configs import MODELS, ModelSize, build_model, discover
from zero_bench.launch import launch, sigterm_raises
from zero_bench.plot import plot, plot_memory
from zero_bench.report import add_ratios, check_losses, comm_table, compact_table, peak_table, table
from zero_bench.spread import add_ranks, merge_repeats
from zero_core import __version__, estimate
from zero_core.plugin import ZeroPlugins

PACKAGE_PARENT = Path(__file__).resolve().parents[1]
# Run from a zero checkout (an editable install included): the package is benchmarks/zero_bench
CHECKOUT = PACKAGE_PARENT.parent if PACKAGE_PARENT.name == "benchmarks" and (PACKAGE_PARENT / "bench.py").is_file() else None
RESULTS = CHECKOUT / "benchmarks" / "results" if CHECKOUT is not None else Path("bench-results")
SCHEMA_VERSION = 5  # 2: records carry comm_timing_per_step; 3: the memory timeline, in-use and setup peaks; 4: repeats;
# 5: rank 0's process CPU time per step (cpu_times_s, median_cpu_step_s)
# Two launches per row: the least that shows whether a row's time holds from one process to the next (rows moved
# 20-30% between two single-launch runs on a shared machine); the places in the table say where the order holds.
REPEAT = 2


def _number(kind: type, minimum: float, what: str) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value

    return parse


positive_int = _number(int, 1, "a positive integer")
non_negative_int = _number(int, 0, "a non-negative integer")
positive_float = _number(float, 1e-9, "a positive number")


def parse_args(argv: list[str] | None, prog: str = "nox -s bench --") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--quick", action="store_true",
                   help="the tiny model for 6 steps (about 5 minutes on 2 quiet CPU cores with 2 launches per row; "
                        "--repeat 1 halves it)")
    p.add_argument("--host-overhead", action="store_true",
                   help=f"the host-overhead section instead: the {host_overhead.MODEL} model (48 thin MLP blocks) under plain "
                        f"PyTorch (DDP on 2 ranks and more), chunk stages 2 and 3, tensor stage 3 and FSDP2 on each of "
                        f"--world-sizes, {host_overhead.STEPS} steps ({host_overhead.WARMUP} warm-up), one thread per rank; "
                        "writes host-overhead.{json,md,png}")
    p.add_argument("--world-sizes", default=",".join(map(str, host_overhead.WORLD_SIZES)),
                   help="with --host-overhead: comma-separated world sizes to run every row at")
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="model preset (default gpt2-small; tiny with --quick, mlp-48 with --host-overhead)")
    for name in ("vocab", "d-model", "layers", "heads", "seq-len", "batch-size", "ffn", "kv-heads", "experts"):
        p.add_argument(f"--{name}", type=positive_int, default=None, help=f"override the preset's {name.replace('-', ' ')}")
    p.add_argument("--world-size", type=positive_int, default=2, help="ranks (processes) per configuration")
    p.add_argument("--repeat", type=positive_int, default=REPEAT,
                   help=f"launches of every row, interleaved (default {REPEAT}): the plot's bars and the table's spread and "
                        "place come from every timed step of every launch; 1 for a single pass")
    p.add_argument("--steps", type=positive_int, default=None, help="optimizer steps per configuration (default 10; 6 with --quick)")
    p.add_argument("--warmup", type=non_negative_int, default=None,
                   help=f"leading steps left out of the median step time (default 2; {host_overhead.WARMUP} with --host-overhead)")
    p.add_argument("--strategies", default=None, help="comma-separated strategy names (default: every registered one)")
    p.add_argument("--stages", default="1,2,3", help="comma-separated ZeRO stages for every strategy")
    p.add_argument("--policies", default=None, help="comma-separated placement policies (default: every registered one)")
    p.add_argument("--comms", default=None, help="comma-separated comm backends (default: every registered one)")
    p.add_argument("--references", default="ddp,fsdp2", help="comma-separated references among ddp, fsdp2 ('' for none)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="compute dtype of the zero runs")
    p.add_argument("--meshes", default="2x2,1x4",
                   help="comma-separated device meshes RxS (or S), each run with the base strategy on its own R*S "
                        "ranks, e.g. 2x2 (HSDP: shard over 2, replicate over 2); '' for none")
    p.add_argument("--mesh-stages", default="3", help="comma-separated ZeRO stages of the mesh rows")
    p.add_argument("--placement-options", action="append", default=[], metavar="NAME=JSON",
                   help='options of one placement policy, e.g. lru=\'{"device_chunks": 2}\' (repeatable)')
    p.add_argument("--loss-rtol", type=float, default=1e-4, help="relative loss tolerance of fp32 runs against DDP")
    p.add_argument("--loss-rtol-16", type=float, default=3e-2, help="the same for bf16/fp16 runs")
    p.add_argument("--timeout", type=positive_float, default=600.0, help="seconds one configuration may take")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="results folder: latest.json, .md, .png and -memory.png (default: a checkout's benchmarks/results, else "
                        "./bench-results; host-overhead.* with --host-overhead); a path ending in .json names the results "
                        "file, the .md and .png go beside it")
    p.add_argument("--compare", type=Path, default=None, help="after the run, compare with this saved results file")
    p.add_argument("--compare-only", type=Path, default=None, metavar="BASELINE", help="compare --out with BASELINE; run nothing")
    p.add_argument("--threshold", type=float, default=0.10, help="step-time and memory regression threshold (fraction)")
    p.add_argument("--save-baseline", type=Path, default=None, help="also copy the results to this path")
    p.add_argument("--no-progress", action="store_true", help="plain lines instead of a progress display")
    p.add_argument("--wide", action="store_true",
                   help="print every table with all its columns (the Markdown file always has them); by default the "
                        "terminal gets the main table's 12 columns, which fit 120 characters")
    args = p.parse_args(argv)
    stem = "host-overhead" if args.host_overhead else "latest"
    args.out = args.out or RESULTS
    if args.out.suffix != ".json":
        args.out = args.out / f"{stem}.json"
    if args.world_size < 1:
        p.error(f"--world-size must be at least 1, got {args.world_size}")
    for path in (args.compare, args.compare_only):
        if path is not None and not path.is_file():
            p.error(f"no saved bench results at {path}; save one with --save-baseline PATH first")
    plugins = ZeroPlugins.load()
    for option, registry in (("strategies", plugins.strategies), ("policies", plugins.placement_policies),
                             ("comms", plugins.comm_backends)):
        unknown = [n for n in (getattr(args, option) or "").split(",") if n and n not in registry]
        if unknown:
            p.error(f"--{option}: {', '.join(unknown)} not registered; registered: {', '.join(registry.names())}")
    if args.host_overhead and args.quick:
        p.error("--host-overhead runs a model of its own; leave out --quick (--steps and --layers make it shorter)")
    text = args.world_sizes
    try:
        args.world_sizes = [int(n) for n in text.split(",") if n]
    except ValueError:
        args.world_sizes = []
    if not args.world_sizes or min(args.world_sizes) < 1:
        p.error(f"--world-sizes takes comma-separated positive integers, e.g. 1,2; got {text!r}")
    if args.host_overhead:
        args.model = args.model or host_overhead.MODEL
        args.steps = args.steps or host_overhead.STEPS
        args.warmup = host_overhead.WARMUP if args.warmup is None else args.warmup
    args.model = args.model or ("tiny" if args.quick else "gpt2-small")
    args.steps = args.steps or (6 if args.quick else 10)
    args.warmup = 2 if args.warmup is None else args.warmup
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) so that some steps are timed")
    for option in ("stages", "mesh_stages"):
        flag, text = "--" + option.replace("_", "-"), getattr(args, option)
        try:
            setattr(args, option, [int(s) for s in text.split(",") if s])
        except ValueError:
            p.error(f"{flag} takes comma-separated integers among 1, 2, 3, got {text!r}")
        if not getattr(args, option) or any(s not in (1, 2, 3) for s in getattr(args, option)):
            p.error(f"{flag} takes stages among 1, 2, 3, got {getattr(args, option)}")
    args.references = [r for r in args.references.split(",") if r]
    bad = [r for r in args.references if r not in ("ddp", "fsdp2")]
    if bad:
        p.error(f"--references takes ddp and/or fsdp2, got {bad}")
    if args.precision != "fp32" and args.references:
        print("note: the references train in fp32; 16-bit zero runs are checked against them with --loss-rtol-16")
    meshes = []
    for item in (m for m in args.meshes.split(",") if m):
        try:
            mesh = tuple(int(n) for n in item.lower().split("x"))
        except ValueError:
            mesh = ()
        if len(mesh) not in (1, 2) or min(mesh) < 1:
            p.error(f"--meshes takes comma-separated shapes RxS (replicate x shard) or S, e.g. 2x2,1x4; got {item!r}")
        meshes.append(mesh)
    args.meshes = meshes
    options = {}
    for item in args.placement_options:
        name, sep, text = item.partition("=")
        try:
            options[name] = json.loads(text) if sep else None
        except json.JSONDecodeError as exc:
            p.error(f"--placement-options {item!r}: the part after '=' must be JSON ({exc})")
        if not isinstance(options[name], dict):
            p.error(f"--placement-options {item!r}: give NAME=JSON with a JSON object, e.g. gemini='{{\"device_budget_mb\": 512}}'")
    args.placement_options = options
    return args


def model_size(args: argparse.Namespace) -> ModelSize:
    base = MODELS[args.model].options()
    for key in base:
        override = getattr(args, key, None)  # the architecture (block) has no option
        if override is not None:
            base[key] = override
    if base["d_model"] % base["heads"]:
        raise SystemExit(f"--d-model ({base['d_model']}) must be a multiple of --heads ({base['heads']})")
    return ModelSize(**base)


def machine() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "zero_core": __version__,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu", "backend": "nccl" if cuda else "gloo"}


class Progress:
    """A rich progress bar on a terminal (when rich is installed); one line per configuration otherwise."""

    def __init__(self, total: int, plain: bool) -> None:
        self.bar = None
        if not plain and sys.stdout.isatty():
            try:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            except ImportError:  # rich is optional (zero-bench[rich]): plain lines then
                pass
            else:
                self.bar = Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.description}"), TimeElapsedColumn())
                self.bar.start()
                self.task = self.bar.add_task("", total=total)
        self.total, self.done = total, 0

    def start(self, name: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=f"running {name}")
        else:
            print(f"[{self.done + 1}/{self.total}] {name} ...", end="", flush=True)
        self.t0 = time.perf_counter()

    def finish(self, name: str, record: dict[str, Any]) -> None:
        self.done += 1
        took = time.perf_counter() - self.t0
        what = record["status"] if record.get("median_step_s") is None else f"{1000 * record['median_step_s']:.1f} ms/step"
        if self.bar is not None:
            self.bar.update(self.task, advance=1)
            self.bar.console.print(f"{name}: {what} ({took:.0f} s)")
        else:
            print(f" {what} ({took:.0f} s)", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = model_size(args)
    with torch.device("meta"):
        meta_model = build_model(size.options())
    num_params = sum(p.numel() for p in meta_model.parameters())
    state_mib = estimate(meta_model, world_size=args.world_size).max_model_state_bytes / 2**20
    plugins = ZeroPlugins.load()
    if args.host_overhead:  # its rows are fixed: the strategy, reference and mesh options do not apply
        configs = host_overhead.configs(args.world_sizes)
        ranks = f"at world sizes {', '.join(map(str, args.world_sizes))}, 1 thread per rank"
    else:
        configs = discover(plugins=plugins, strategies=args.strategies and args.strategies.split(","), stages=args.stages,
                           policies=args.policies and args.policies.split(","), comms=args.comms and args.comms.split(","),
                           references=args.references, precision=args.precision, state_mib=state_mib, size=size,
                           placement_options=args.placement_options, meshes=args.meshes,
                           mesh_stages=args.mesh_stages, world_size=args.world_size)
        mesh_rows = sum(c.world_size not in (None, args.world_size) for c in configs)
        ranks = f"x {args.world_size} ranks" + (f" ({mesh_rows} on their own ranks)" if mesh_rows else "")
    print(f"bench: {len(configs)} configurations {ranks}, model {args.model} ({num_params / 1e6:.2f}M "
          f"parameters), {args.steps} steps ({args.warmup} warm-up), {machine()['backend']}", flush=True)
    # collectives give up well before the launch is killed, so a stuck rank reports which collective hung
    spec = {"model": size.options(), "steps": args.steps, "warmup": args.warmup, "timeout_s": max(10.0, 0.8 * args.timeout)}
    if args.host_overhead:
        spec["threads"] = host_overhead.THREADS
    launches: list[list[dict[str, Any]]] = [[] for _ in configs]
    progress = Progress(len(configs) * args.repeat, args.no_progress)
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="zero-bench-") as tmp, sigterm_raises():
            # interleaved, so that a machine that slows down part way slows every row alike
            for repeat in range(args.repeat):
                for config, runs in zip(configs, launches, strict=True):
                    if runs and runs[-1].get("median_step_s") is None:
                        continue  # failed or not applicable: once says so, and a failed row is not ranked
                    label = config.name if args.repeat == 1 else f"{config.name} (repeat {repeat + 1}/{args.repeat})"
                    progress.start(label)
                    world = config.world_size or args.world_size
                    record = {"name": config.name, "config": config.as_dict(), "world_size": world,
                              **launch(config, spec, world, args.timeout, Path(tmp), pythonpath=PACKAGE_PARENT if CHECKOUT else None)}
                    runs.append(record)
                    progress.finish(label, record)
    finally:
        progress.close()
    records = [merge_repeats(runs, warmup=args.warmup) for runs in launches if runs]
    reference = check_losses(records, rtol=args.loss_rtol, rtol_16=args.loss_rtol_16)
    add_ratios(records)
    add_ranks(records)
    result = {"schema_version": SCHEMA_VERSION, "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": machine(), "world_size": args.world_size, "steps": args.steps, "warmup": args.warmup,
              "repeat": args.repeat, "model": {"preset": args.model, **size.options(), "params": num_params},
              "loss_reference": reference, "loss_rtol": args.loss_rtol, "loss_rtol_16": args.loss_rtol_16,
              "wall_s": time.perf_counter() - started, "records": records}
    if args.host_overhead:
        result["world_sizes"] = args.world_sizes
        result["host_overhead"] = host_overhead.summary(records, units=size.layers)
    return result


def main(argv: list[str] | None = None, *, prog: str = "nox -s bench --") -> int:
    """Run the bench with ``argv`` (default: the process's arguments); ``prog`` names the command in its messages."""
    args = parse_args(argv, prog)
    if args.compare_only is not None:
        text, regressions = compare_mod.compare(compare_mod.load(args.compare_only), compare_mod.load(args.out),
                                                threshold=args.threshold)
        print(text)
        print(f"\n{len(regressions)} regression(s) past {args.threshold:.0%}" + "".join(f"\n  {r}" for r in regressions))
        return 1 if regressions else 0
    result = run(args)
    records = result["records"]
    host = result.get("host_overhead")
    head = ("" if host is None else
            f"Host overhead: each row's step against plain PyTorch's on its ranks (DDP on 2 and more) and FSDP2's, and the "
            f"host time above plain PyTorch's per block ({result['model']['layers']}) and step:\n\n"
            + host_overhead.host_table(host) + "\n\n" + "\n".join(host_overhead.targets(host)) + "\n\nEvery row:\n\n")
    text = head + (table(records) + "\n\nCollectives per step by kind, zero rows, rank 0, measured after warm-up:\n\n" + comm_table(records)
            + "\n\nWhere the peak goes (rank 0, MiB, at the highest RSS of one sampled step after the timed ones):\n\n"
            + peak_table(records))
    m = result["model"]
    own = sorted({r["world_size"] for r in records} - {result["world_size"]})
    ranks = f"{result['world_size']} ranks" + (f" ({', '.join(map(str, own))} for the mesh rows)" if own else "")
    if host is not None:
        ranks = f"world sizes {', '.join(map(str, result['world_sizes']))}, 1 thread per rank"
    title = (f"{m['preset']} {'MLP' if m.get('block') == 'mlp' else 'GPT'} ({m['params'] / 1e6:.2f}M params), {ranks}, "
             f"{result['machine']['backend']}, torch {result['machine']['torch']}")
    shown = text if args.wide else (head + compact_table(records) + f"\n\nAll {table([]).splitlines()[0].count('|') - 1} columns, the "
                                    f"collectives by kind and where the peak goes: {args.out.with_suffix('.md')} (or --wide)")
    launches = "" if result.get("repeat", 1) == 1 else f" of {result['repeat']} launches each, interleaved"
    print(f"\n{title}; median of steps {args.warmup + 1}..{args.steps}{launches}; place: 1 = fastest on its ranks, "
          f"a range where the spreads overlap\n\n{shown}\n")
    for r in records:
        if r.get("log_tail"):
            print(f"--- {r['name']} failed: {r['error']}\n{r['log_tail']}\n")
        elif r["status"] == "not applicable":
            print(f"{r['name']}: not applicable here: {r['error']}")
    failed = [r for r in records if r["status"] not in ("ok", "not applicable")]
    wrong = [r["name"] for r in records if r.get("losses_agree") is False]
    agree = [r for r in records if r.get("losses_agree")]
    if result["loss_reference"] is None:
        print("losses: UNCHECKED (neither DDP nor FSDP2 ran; keep at least one in --references)")
    else:
        print(f"losses: {len(agree)} configurations agree with {result['loss_reference']} within {args.loss_rtol} "
              f"(fp32) / {args.loss_rtol_16} (16-bit)" + (f"; DISAGREE: {', '.join(wrong)}" if wrong else ""))
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(f"{title}\n\n{text}\n")
    plotted = plot(records, out.with_suffix(".png"), title=title)
    memory_plot = out.with_name(out.stem + "-memory.png")
    plotted_memory = plot_memory(records, memory_plot, title=title)
    print(f"wrote {out}, {out.with_suffix('.md')}" + (f", {out.with_suffix('.png')}" if plotted else "")
          + (f", {memory_plot}" if plotted_memory else "")
          + f" in {result['wall_s']:.0f} s")
    if args.save_baseline is not None:
        args.save_baseline.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, args.save_baseline)
        print(f"saved as baseline {args.save_baseline}")
    status = 1 if failed or wrong else 0
    if args.compare is not None:
        text, regressions = compare_mod.compare(compare_mod.load(args.compare), result, threshold=args.threshold)
        print(f"\nagainst {args.compare}:\n\n{text}\n\n{len(regressions)} regression(s) past {args.threshold:.0%}"
              + "".join(f"\n  {r}" for r in regressions))
        status = status or (1 if regressions else 0)
    if failed:  # the row and why, last, where a log or CI summary shows it
        print(f"FAILED: {len(failed)} configuration(s)" + "".join(f"\n  {r['name']}: {r['error']}" for r in failed))
    return status
