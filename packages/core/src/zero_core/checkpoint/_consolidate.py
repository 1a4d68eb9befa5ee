"""``zero consolidate``: a sharded checkpoint into plain weights, offline (no process group, no model code).

The pieces of each parameter are read from whichever rank files hold them (any world size
or mesh the checkpoint was saved at) and streamed into the output in blocks of at most
``block_elements`` elements: what is in memory at once is one block read and its cast copy,
whatever the size of the parameters or of the output shards. Tensors go out in the
checkpoint's order (the model's parameters chunk by chunk, then its buffers).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from zero_core.base._atomic import atomic_write
from zero_core.base.errors import CheckpointError
from zero_core.checkpoint._checkpoint import _dtype, _Reader, _verify, piece_runs, read_metadata
from zero_core.checkpoint._hf_folder import (
    DEFAULT_MAX_SHARD_SIZE,
    HFDirectoryWriter,
    cast_dtype,
    parse_dtype,
    parse_shard_size,
    with_dtype,
)
from zero_core.checkpoint._safetensors_stream import SafetensorsWriter

__all__ = ["ConsolidateReport", "consolidate"]

BLOCK_ELEMENTS = 1 << 24  # 64 MiB of fp32 read at a time: large enough that reads are not the cost


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConsolidateReport:
    """What :func:`consolidate` wrote.

    Attributes:
        output: The directory or file written.
        files: The weight files written (names inside ``output``, or ``output``'s own name).
        tensors: How many tensors were written.
        total_bytes: Their bytes, as stored.
        largest_shard_bytes: The bytes of tensors in the largest file written.
        peak_bytes_held: The most tensor bytes held at once while consolidating (one block read plus its
            cast copy): the memory bound, counted, not measured.
        configs: The config files written beside the weights (``config.json``, ``generation_config.json``).
    """

    output: Path
    files: tuple[str, ...]
    tensors: int
    total_bytes: int
    largest_shard_bytes: int
    peak_bytes_held: int
    configs: tuple[str, ...]


class _Held:
    """Counts the tensor bytes alive in the consolidator (each block read and its cast copy)."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def take(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def drop(self, nbytes: int) -> None:
        self.now -= nbytes


def _check_output(output: Path, overwrite: bool) -> None:
    if not output.exists() or overwrite:
        if output.exists() and output.is_dir() and output.suffix == ".safetensors":
            raise CheckpointError(f"{output} is a directory; give a file path ending in .safetensors or another OUT")
        return
    if output.is_dir():
        if any(output.iterdir()):
            raise CheckpointError(f"{output} exists and is not empty; pass --overwrite (overwrite=True) to replace the "
                                  "weights and configs in it (other files there are kept), or give a new OUT")
        return
    raise CheckpointError(f"{output} exists; pass --overwrite (overwrite=True) to replace it, or give a new OUT")


def _check_complete(directory: Path, metadata: dict[str, Any]) -> None:
    """Every piece of every parameter present, and every file intact (size and sha256), before writing anything."""
    for name, info in metadata["params"].items():
        numel = math.prod(info["shape"])
        covered = sorted((a, b) for piece in info["pieces"] for _, a, b, _ in piece_runs(piece))
        at = 0
        for a, b in covered:
            if a != at:
                break
            at = b
        if at != numel:
            raise CheckpointError(f"the checkpoint at {directory} lacks elements [{at}, {numel}) of {name!r}: it is "
                                  "incomplete or damaged; consolidate an earlier checkpoint")
    for entry in metadata["files"]:
        _verify(directory, entry)


def consolidate(checkpoint: str | os.PathLike[str], output: str | os.PathLike[str], *,
                max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, dtype: torch.dtype | str | None = None,
                single_file: bool = False, overwrite: bool = False,
                block_elements: int = BLOCK_ELEMENTS) -> ConsolidateReport:
    """Turn the sharded checkpoint in ``checkpoint`` (written by ``zero_core.save_checkpoint``) into plain weights.

    ``output`` ending in ``.safetensors`` is one file holding every key of the model's
    ``state_dict()`` (tied parameters under each name), as ``save_full_state_dict`` writes it.
    Any other ``output`` is a Hugging Face directory (see [Note: Hugging Face folder format]):
    shards of at most ``max_shard_size`` and an index, or one ``model.safetensors`` with
    ``single_file``; tied parameters once; ``config.json`` when the checkpoint recorded the
    model's HF config. ``dtype`` casts floating tensors. Optimizer states and random states are
    not written. Raises :class:`~zero_core.CheckpointError` before writing anything when the
    checkpoint is not one, is incomplete or damaged, or ``output`` is in the way.
    """
    checkpoint, output = Path(checkpoint), Path(output)
    cast = parse_dtype(dtype)
    limit = parse_shard_size(max_shard_size)
    if block_elements <= 0:
        raise CheckpointError(f"block_elements must be positive, got {block_elements}")
    metadata = read_metadata(checkpoint)
    _check_complete(checkpoint, metadata)
    _check_output(output, overwrite)
    plain_file = output.suffix == ".safetensors" and not output.is_dir()
    if plain_file and max_shard_size != DEFAULT_MAX_SHARD_SIZE:
        raise CheckpointError(f"{output} is one file; --max-shard-size applies to a directory OUT only")

    # (output key, stored key in the checkpoint, source dtype, shape); twins follow their parameter in a plain file
    tensors: list[tuple[str, str, torch.dtype, tuple[int, ...]]] = []
    tied = metadata.get("tied", {})
    for name, info in metadata["params"].items():
        shape, source = tuple(info["shape"]), _dtype(info["dtype"])
        for key in [name, *tied.get(name, [])] if plain_file else [name]:
            tensors.append((key, f"p/{name}", source, shape))
    for key, info in metadata["buffers"].items():
        tensors.append((key, f"b/{key}", _dtype(info["dtype"]), tuple(info["shape"])))
    entries = [(key, cast_dtype(source, cast), shape) for key, _, source, shape in tensors]

    held = _Held()
    reader = _Reader(checkpoint, metadata)

    def blocks(stored: str, source: torch.dtype, numel: int) -> Iterator[torch.Tensor]:
        target = cast_dtype(source, cast)
        for lo in range(0, numel, block_elements):
            n = min(block_elements, numel - lo)
            block = torch.empty(n, dtype=source)
            held.take(block.nbytes)
            if stored.startswith("p/"):
                reader.read_into(stored, stored[2:], lo, block)
            else:  # buffers: whole in rank 0's file
                reader._file(0).read_into(stored, lo, block)
            out = block if target == source else block.to(target)
            if out is not block:
                held.take(out.nbytes)
            yield out
            if out is not block:
                held.drop(out.nbytes)
            held.drop(block.nbytes)
            del block, out

    files: tuple[str, ...]
    configs_written: tuple[str, ...]
    try:
        if plain_file:
            def write(stream: Any) -> None:
                writer = SafetensorsWriter(stream, entries, {"format": "pt", "producer": "zero"})
                for key, stored, source, shape in tensors:
                    writer.write_parts(key, blocks(stored, source, math.prod(shape)))
                writer.close()

            atomic_write(output, write)
            files, largest, configs_written = (output.name,), sum(_bytes(e) for e in entries), ()
        else:
            stored_dtype = cast
            if stored_dtype is None:
                masters = {_dtype(info["dtype"]) for info in metadata["params"].values()}
                stored_dtype = masters.pop() if len(masters) == 1 else None
            configs = with_dtype(metadata.get("model_configs") or {}, stored_dtype)
            writer = HFDirectoryWriter(output, entries, max_shard_size=limit, configs=configs, single_file=single_file)
            try:
                for key, stored, source, shape in tensors:
                    writer.write_parts(key, blocks(stored, source, math.prod(shape)))
                writer.commit()
            except BaseException:
                writer.abort()
                raise
            files, largest, configs_written = tuple(writer.names), writer.largest_shard, tuple(configs)
    except CheckpointError:
        raise
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"consolidating {checkpoint} into {output} failed ({type(exc).__name__}: {exc}); "
                              f"{output} holds what it held before") from exc
    finally:
        reader.close()
    return ConsolidateReport(output=output, files=files, tensors=len(entries),
                             total_bytes=sum(_bytes(e) for e in entries), largest_shard_bytes=largest,
                             peak_bytes_held=held.peak, configs=configs_written)


def _bytes(entry: tuple[str, torch.dtype, tuple[int, ...]]) -> int:
    return math.prod(entry[2]) * entry[1].itemsize
