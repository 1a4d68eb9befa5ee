"""``zero estimate``: what a configuration holds per rank and sends per step, from ``zero_core.estimate``."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zero_core.cli._cli_common import USAGE, CommandError, aligned, human_bytes

if TYPE_CHECKING:
    from zero_core import Estimate, ZeroConfig

__all__ = ["add_parser", "parse_count", "parse_mesh", "run"]

_DESCRIPTION = """\
Predict, without running anything, the model-state bytes each rank holds (by kind, and by tier when
the placement policy places them) and the bytes each rank sends per step (by collective and by
group, with call counts), beside ZeRO's closed formulas and plain DDP. The figures are those of
zero_core.estimate (see docs/estimator.md): exact for a model, padding included; from a parameter
count, the formulas with the count rounded up to the shard group size.

Give the model as a parameter count (--params) or a Hugging Face config (--model, needs
transformers: the model is built on the meta device, so a 70B model takes no memory), and the
ranks as a world size (--world-size) or a mesh shape (--mesh RxS: R replicas, each sharding every
chunk over S ranks). The configuration is zero's default, or --config FILE; the other flags
override its fields."""

_EXAMPLES = """\
examples:
  zero estimate --params 7e9 --world-size 64 --stage 3
  zero estimate --params 70B --mesh 16x8 --precision bf16          # HSDP: 16 nodes of 8 GPUs
  zero estimate --params 1.3b --world-size 8 --placement static --placement-option offload_optim_frac=1
  zero estimate --model ./Llama-2-7b-hf/config.json --world-size 64 --json
  zero estimate --params 7B --config zero.toml --world-size 256 --gpus-per-node 8"""

_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_DTYPES = ("fp32", "bf16", "fp16")


def parse_count(text: str) -> int:
    """A parameter count: ``7000000000``, ``7e9``, ``7B``, ``350M``, ``1.3b``, ``125k``, ``7_000_000_000``."""
    cleaned = text.strip().replace("_", "").replace(",", "")
    suffix = cleaned[-1:].lower() if cleaned[-1:].isalpha() and cleaned[-1:].lower() != "e" else ""
    try:
        value = Decimal(cleaned[: len(cleaned) - len(suffix)]) * _SCALE[suffix]
    except (InvalidOperation, KeyError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count; write e.g. 7e9, 7B, 350M, 1.3b, 125k or 7000000000") from None
    if not value.is_finite() or value != value.to_integral_value() or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number of parameters")
    return int(value)


def parse_mesh(text: str) -> tuple[int, ...]:
    """A mesh shape: ``RxS`` (``16x8``: 16 replicas sharding over 8 ranks each) or ``S``."""
    parts = text.lower().replace("×", "x").split("x")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a mesh shape; write RxS with positive ints, e.g. 16x8 for 16 replicas each sharding "
            "over 8 ranks (HSDP), 1x64 for full sharding over 64 ranks, or one number S")
    return tuple(int(p) for p in parts)


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _non_negative(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer (Adam: 8, SGD with momentum: 4, SGD: 0)")
    return int(text)


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE; write e.g. offload_optim_frac=0.5")
    try:
        return key.strip(), json.loads(value)  # numbers, true/false, null, lists
    except json.JSONDecodeError:
        return key.strip(), value  # a plain string, such as a directory


def add_parser(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser("estimate", help="predict memory per rank and bytes sent per step, without running",
                              description=_DESCRIPTION, epilog=_EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    model = sub.add_argument_group("the model (one of)").add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=parse_count, metavar="N",
                       help="parameter count: 7e9, 7B, 350M, 1.3b, 125k or 7000000000")
    model.add_argument("--model", metavar="PATH",
                       help="a Hugging Face config.json, or a local directory holding one (never downloaded); "
                            "built with fp32 parameters on the meta device, so the figures are exact, chunk by chunk")
    ranks = sub.add_argument_group("the ranks (one or both)")
    ranks.add_argument("--world-size", type=_positive, metavar="N", help="ranks, all sharding every chunk")
    ranks.add_argument("--mesh", type=parse_mesh, metavar="RxS",
                       help="R replicas, each sharding every chunk over S ranks (HSDP); 1xN is --world-size N")
    ranks.add_argument("--gpus-per-node", type=_positive, metavar="G",
                       help="also print the bytes per GPU per step that cross nodes (a ring model of the cluster)")
    cfg = sub.add_argument_group("the configuration (flags override --config)")
    cfg.add_argument("--config", metavar="FILE", help="a zero config file (JSON, TOML, or YAML with PyYAML)")
    cfg.add_argument("--stage", type=int, choices=(1, 2, 3), help="ZeRO stage (default 3)")
    cfg.add_argument("--precision", choices=_DTYPES,
                     help="compute dtype (default: the parameters' own, fp32); fp16 adds dynamic loss scaling")
    cfg.add_argument("--reduce", choices=_DTYPES, help="dtype gradients are reduced in (default fp32)")
    cfg.add_argument("--strategy", metavar="NAME", help="shard strategy plugin: chunk (default), tensor, ...")
    cfg.add_argument("--comm-backend", "--comm", dest="comm_backend", metavar="NAME",
                     help="comm backend plugin: torch, bucketed (default: the strategy's); --comm is its old name")
    cfg.add_argument("--placement", metavar="NAME", help="placement policy plugin: device (default), host, static, gemini")
    cfg.add_argument("--placement-option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                     help="an option of the placement policy (repeat it), e.g. offload_optim_frac=1")
    cfg.add_argument("--shard-optimizer-across-replicas", action="store_true", default=None,
                     help="with --mesh RxS at stage 3: master values, gradients and optimizer states over all R*S ranks "
                          "(ZeroConfig.shard_optimizer_across_replicas)")
    cfg.add_argument("--optimizer-bytes-per-element", type=_non_negative, default=8, metavar="B",
                     help="optimizer-state bytes per fp32 parameter: Adam 8 (default), SGD with momentum 4, SGD 0")
    sub.add_argument("--compare-strategies", action="store_true",
                     help="also print every registered shard strategy side by side: padding, collectives, bytes")
    sub.add_argument("--json", action="store_true", help="print the Estimate as JSON instead of the table")
    sub.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.world_size is None and args.mesh is None:
        raise CommandError("give the ranks: --world-size N (N ranks shard every chunk) or --mesh RxS "
                           "(R replicas, each sharding over S ranks)", exit_code=USAGE)
    config = _config(args)
    model = args.params if args.params is not None else _meta_model(args.model)
    from zero_core import ZeroConfig, estimate  # here, not at import: `zero --help` should not pay for torch
    from zero_core.interfaces._plugins import ZeroPlugins

    plugins = ZeroPlugins.load()
    # a misspelt name must not pass unnoticed (estimate looks the backend up too: it decides the bytes sent)
    strategy = plugins.strategies.get(config.strategy)
    plugins.comm_backends.get(config.comm_backend or strategy.comm)
    e = estimate(model, world_size=args.world_size, mesh_shape=args.mesh, config=config,
                 optimizer_bytes_per_element=args.optimizer_bytes_per_element, plugins=plugins)
    # DDP for comparison: every rank a full fp32 replica, one fp32 all-reduce of the gradients per step,
    # which is what the estimator predicts for fp32 stage 1 on a mesh of W replicas of one rank each
    ddp = estimate(e.params, mesh_shape=(e.world_size, 1), config=ZeroConfig(stage=1),
                   optimizer_bytes_per_element=args.optimizer_bytes_per_element, plugins=plugins)
    inter_node = e.inter_node_bytes(args.gpus_per_node) if args.gpus_per_node else None
    if args.json:
        data = dataclasses.asdict(e)
        data.update(max_model_state_bytes=e.max_model_state_bytes, total_bytes_sent=e.total_bytes_sent,
                    ddp={"model_state_bytes": ddp.max_model_state_bytes, "bytes_sent": ddp.total_bytes_sent})
        if inter_node is not None:
            data["inter_node_bytes"] = {"gpus_per_node": args.gpus_per_node, "bytes": inter_node}
        print(json.dumps(data, indent=2))
    else:
        print(render(e, config, ddp, source=args.model, opt_bytes=args.optimizer_bytes_per_element,
                     inter_node=inter_node, gpus_per_node=args.gpus_per_node))
    if args.compare_strategies:
        print("\n" + compare_strategies(model, args, config, plugins))
    return 0


def compare_strategies(model: Any, args: argparse.Namespace, config: ZeroConfig, plugins: Any) -> str:
    """Every registered strategy on the same model, ranks and configuration: one row each."""
    from zero_core import estimate
    from zero_core.base.errors import ZeroError

    rows = [["strategy", "padding", "all-gathers", "reduce-scatters", "all-reduces", "sent per step", "model states"]]
    for name in plugins.strategies.names():
        try:
            e = estimate(model, world_size=args.world_size, mesh_shape=args.mesh, config=config.replace(strategy=name),
                         optimizer_bytes_per_element=args.optimizer_bytes_per_element, plugins=plugins)
        except ZeroError as exc:  # a strategy that cannot plan this model or mesh says why in its row
            rows.append([name, f"cannot estimate: {exc}"[:100], "", "", "", "", ""])
            continue
        calls = e.calls or {}
        rows.append([name, f"{100 * (e.padded_params - e.params) / e.params:.2f}%",
                     *(str(calls.get(kind, 0)) if e.calls else "-" for kind in ("all_gather", "reduce_scatter", "all_reduce")),
                     human_bytes(e.total_bytes_sent), human_bytes(e.max_model_state_bytes)])
    return (aligned(rows, right=(1, 2, 3, 4, 5, 6)) + "\n  per rank per step; model states of the largest rank"
            + ("; calls need --model" if isinstance(model, int) else ""))


def _config(args: argparse.Namespace) -> ZeroConfig:
    from zero_core import LossScale, ZeroConfig

    if args.config is None:
        config = ZeroConfig()
    else:
        path = Path(args.config)
        if not path.is_file():
            raise CommandError(f"--config {args.config}: no such file; give a zero config file (JSON, TOML or YAML)")
        config = ZeroConfig.from_file(path)
    changes: dict[str, Any] = {name: getattr(args, name) for name in ("stage", "strategy", "comm_backend", "placement",
                                                                      "shard_optimizer_across_replicas")
                               if getattr(args, name, None) is not None}
    if args.precision is not None or args.reduce is not None:
        precision = config.precision
        if args.precision is not None:
            # fp16 compute must scale the loss (Precision refuses it otherwise); scaling costs no model-state bytes
            scale = precision.loss_scale or (LossScale() if args.precision == "fp16" else None)
            precision = dataclasses.replace(precision, compute=args.precision, loss_scale=scale)
        if args.reduce is not None:
            precision = dataclasses.replace(precision, reduce=args.reduce)
        changes["precision"] = precision
    if args.placement_option:
        placement = changes.get("placement", config.placement)
        current = config.placement_options if placement == config.placement else {}
        if not isinstance(current, Mapping):
            raise CommandError(f"--placement-option cannot add to the placement options of {args.config}, which are a "
                               f"{type(current).__name__}; write them all in the file, or all as --placement-option")
        changes["placement_options"] = {**current, **dict(args.placement_option)}
    return config.replace(**changes) if changes else config


def _meta_model(source: str) -> Any:
    """A Hugging Face causal LM from a local config, with fp32 parameters on the meta device."""
    path = Path(source)
    if not path.exists():
        raise CommandError(f"--model {source}: no such file or directory; zero estimate reads a local config.json or "
                           "a directory holding one and never downloads: fetch it first (for example "
                           "`hf download REPO config.json --local-dir DIR`), or give --params N")
    if path.is_dir() and not (path / "config.json").is_file():
        raise CommandError(f"--model {source}: the directory holds no config.json; give a Hugging Face model directory "
                           "or the config.json itself")
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise CommandError("--model needs transformers: pip install transformers, or give --params N") from None
    try:
        hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        with torch.device("meta"):  # no memory: shapes only, which is all the estimator reads
            return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__  # not its list of every model
        raise CommandError(f"--model {source}: transformers cannot build a causal LM from it: {first}") from None


def render(e: Estimate, config: ZeroConfig, ddp: Estimate, *, source: str | None, opt_bytes: int,
           inter_node: int | None = None, gpus_per_node: int | None = None) -> str:
    """The estimate as plain text: model states, traffic, and the DDP line."""
    replicas, shards = e.mesh_shape
    across = replicas > 1 and config.shard_optimizer_across_replicas
    layout = (f"{e.world_size} ranks" + (f" as a {replicas}x{shards} mesh: {replicas} replicas, each sharding over {shards}"
                                         if replicas > 1 else ", all sharding every chunk")
              + (f"; masters, gradients and optimizer states over all {e.world_size}" if across else ""))
    dtypes = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
    compute, reduce = (dtypes.get(str(d), str(d)) for d in (config.precision.compute, config.precision.reduce))
    # the CLI's parameters are fp32 either way: a count has fp32 masters, --model builds them in fp32
    precision = f"compute {compute if config.precision.compute is not None else 'fp32 (the masters)'}, reduce {reduce}"
    padding = 100 * (e.padded_params - e.params) / e.params
    how = (f"from {source}: exact, chunk by chunk ({e.padded_params:,} elements with padding: {padding:.2f}%)" if source else
           f"from a parameter count: ZeRO's formulas on {e.padded_params:,} (a multiple of "
           f"{e.world_size if across else shards})")
    options = config.placement_options
    lines = [f"{e.params:,} parameters on {layout}; stage {e.stage}",
             f"strategy {config.strategy}, placement {config.placement}"
             + (f" {dict(options)}" if isinstance(options, Mapping) and options else "") + f", {precision}",
             f"optimizer states: {opt_bytes} bytes per fp32 parameter", how, ""]

    state = e.per_rank[0]  # the largest: padding only ever removes bytes, from the last ranks
    rows = [["model states per rank", "exact", "formula"],
            *([kind.replace("_", " "), human_bytes(n), ""] for kind, n in state.items()),
            ["total (rank 0, the largest)", human_bytes(e.max_model_state_bytes), human_bytes(e.formula["model_state_bytes"])]]
    smallest = min(sum(r.values()) for r in e.per_rank)
    if smallest != e.max_model_state_bytes:
        rows.append(["total (the smallest rank: padding)", human_bytes(smallest), ""])
    if e.tiers is not None:
        rows += [[f"  on {tier}", human_bytes(n), ""] for tier, n in e.tiers[0].items() if n]
    lines.append(aligned(rows, right=(1, 2)))
    if e.tiers is None:
        lines.append(f"  by tier: placement {config.placement!r} decides at run time (the total is exact)")

    groups = {"shard": f"shard ({shards} ranks)", "replicate": f"replicate ({replicas} ranks)",
              "both": f"shard ({shards}) + replicate ({replicas})"}
    group_of = {"all_gather": "both" if across else "shard", "reduce_scatter": "both" if across else "shard",
                "all_reduce": "replicate"}
    calls = e.calls or {}
    rows = [["sent per step per rank", "group", "calls", "exact", "formula"],
            *([kind, groups[group_of[kind]], str(calls[kind]) if e.calls else "-", human_bytes(n), ""]
              for kind, n in e.bytes_sent.items()),
            *([f"{group} group total", "", "", human_bytes(e.bytes_sent_by_group[group]),
               human_bytes(e.formula[f"bytes_sent_{group}"])] for group in ("shard", "replicate") if replicas > 1),
            ["total", "", str(sum(calls.values())) if e.calls else "-", human_bytes(e.total_bytes_sent),
             human_bytes(e.formula["bytes_sent"])]]
    lines += ["", aligned(rows, right=(2, 3, 4))]
    if e.calls is None:
        lines.append("  calls: one per chunk or bucket, so they depend on the model (--model counts them)")
    if inter_node is not None:
        lines.append(f"  crossing nodes of {gpus_per_node} GPUs (ring model): {human_bytes(inter_node)} per GPU per step")

    ddp_state, ddp_sent = ddp.max_model_state_bytes, ddp.total_bytes_sent
    rows = [["DDP (fp32 replicas, fp32 all-reduce)", "per rank", "zero / DDP"],
            ["model states", human_bytes(ddp_state), f"{e.max_model_state_bytes / ddp_state:.3g}x"],
            ["sent per step", human_bytes(ddp_sent), f"{e.total_bytes_sent / ddp_sent:.3g}x" if ddp_sent else "-"]]
    lines += ["", aligned(rows, right=(1, 2)),
              "", "GiB = 2**30 bytes; ring collectives; activations are not model states, not estimated."]
    return "\n".join(lines)
