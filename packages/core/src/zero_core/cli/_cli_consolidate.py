"""``zero consolidate CKPT_DIR OUT``: a sharded checkpoint into plain weights."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_parser", "run"]

_DESCRIPTION = """\
Turn a sharded checkpoint written by zero_core.save_checkpoint (at any world size) into plain
weights, offline: no process group, no GPU, no model code. Memory holds one read block
(64 MiB) and its cast copy, whatever the model's size.

OUT ending in .safetensors: one file with every key of the model's state_dict() (tied
parameters under each name), as zero_core.save_full_state_dict writes it.
Any other OUT: a Hugging Face directory (model.safetensors, or model-0000i-of-0000N.safetensors
files and model.safetensors.index.json), loadable with AutoModelForCausalLM.from_pretrained(OUT)
and zero_core.shard(..., load_from=OUT). config.json (and generation_config.json) are written
when the checkpoint recorded the model's Hugging Face config, which save_checkpoint does for a
model with config.to_json_string(). Without one, OUT holds the weights only: copy the model's
config.json into OUT before from_pretrained, or load OUT with shard(..., load_from=OUT).

Optimizer and random states are not written; the checkpoint is not changed."""

_EXAMPLES = """\
examples:
  zero consolidate runs/ckpt-1000 runs/hf                  # a Hugging Face directory, 5GB files
  zero consolidate runs/ckpt-1000 model.safetensors --dtype bf16
  zero consolidate runs/ckpt-1000 runs/hf --single-file --overwrite"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser("consolidate", help="turn a sharded checkpoint into Hugging Face safetensors weights",
                              description=_DESCRIPTION, epilog=_EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_argument("checkpoint", metavar="CKPT_DIR", help="the directory given to zero_core.save_checkpoint")
    sub.add_argument("output", metavar="OUT", help="a directory (Hugging Face format) or a .safetensors file")
    sub.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                     help="the largest weight file in a directory OUT: bytes or a size like 5GB, 500MB, 2GiB "
                          "(default: 5GB, as transformers)")
    sub.add_argument("--dtype", default=None, metavar="DTYPE",
                     help="cast floating tensors to bf16, fp16 or fp32 (default: keep the saved master dtype)")
    sub.add_argument("--single-file", action="store_true",
                     help="a directory OUT with one model.safetensors, however large")
    sub.add_argument("--overwrite", action="store_true",
                     help="write into an OUT that exists and is not empty (its weights and configs are replaced; "
                          "other files there are kept)")
    sub.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zero_core.checkpoint._checkpoint import METADATA, checkpoint_inside
    from zero_core.checkpoint._consolidate import consolidate  # here, not at import: `zero --help` should not pay for torch

    checkpoint = Path(args.checkpoint)
    if checkpoint.is_dir() and not (checkpoint / METADATA).is_file() and (inside := checkpoint_inside(checkpoint)):
        print(f"{checkpoint} holds its zero checkpoint in {inside.name}/ (an HF Trainer checkpoint folder); "
              f"consolidating {inside}")
        checkpoint = inside
    # a CheckpointError (a ZeroError) is reported by the dispatcher in zero_core.cli._cli
    report = consolidate(checkpoint, args.output, max_shard_size=args.max_shard_size, dtype=args.dtype,
                         single_file=args.single_file, overwrite=args.overwrite)
    mib = report.total_bytes / 2**20
    print(f"wrote {report.tensors} tensors ({mib:.1f} MiB) to {report.output}: {', '.join(report.files)}"
          + (f"; with {', '.join(report.configs)}" if report.configs else "; no config (weights only)"))
    return 0
