"""Sharded checkpoints: every rank writes its own shards, rank 0 commits them with the metadata, written last.

[Note: sharded checkpoint format]
A checkpoint is a directory. Each save writes, under a fresh save id:

- ``<id>.rank<r>-of-<N>.safetensors``, one per rank: for every parameter piece in the
  rank's shards (of the first replica only, on a mesh with replicas: each shard is
  written once; every rank's, when they are cut over the replicas too), ``p/<name>`` (the master values of elements ``[lo, hi)`` of the
  flattened parameter, or of ``count`` such ranges ``stride`` elements apart, one after another, for a
  parameter cut along a later dimension: see [Note: shard dimension] in ``zero_core.chunks._slots``) and
  ``o/<name>/<key>`` (each per-element optimizer state of the same ranges); rank 0 adds ``b/<name>`` for
  each buffer; ``rng/cpu`` (and ``rng/cuda``) hold the rank's random state;
- ``<id>.extra.pt`` (rank 0, when the caller passes ``extra``);
- ``zero_checkpoint.json``, the metadata: for every parameter its shape, dtype and the
  pieces each rank saved (``[rank, lo, hi]``, or ``[rank, lo, hi, stride, count]``; a metadata that
  has the second form is version 2, which older readers refuse), the files with their sizes and sha256, the optimizer's
  hyperparameters per group and its scalar states (step counts; with several optimizers, every
  optimizer's groups in order and ``optimizer_groups``, how many are each one's: parameters are in
  one optimizer at most, so their states share the keys by name), the loss scaler, the
  engine's step, and an HF-style model's ``config.json`` (for ``zero consolidate``).

Pieces are keyed by parameter name and element range, not by chunk, so any strategy,
chunk size, world size and mesh shape can read them (resharding is reading other ranges). Every
file is written to a temporary name, fsynced and renamed; the metadata is renamed into
place only after every rank reported its file complete, and names the save id. A crash
at any earlier point leaves the previous metadata, which names the previous files,
which are deleted only after the new metadata is in place: the last complete
checkpoint in a directory always loads.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from zero_core.base._atomic import TMP_MARK, atomic_write, file_sha256, fsync_dir
from zero_core.base._trace import CHECKPOINT_LOAD, CHECKPOINT_SAVE, traced
from zero_core.base._version import __version__
from zero_core.base.errors import CheckpointError
from zero_core.checkpoint._hf_folder import model_config_texts
from zero_core.checkpoint._safetensors_stream import SafetensorsRangeReader, SafetensorsWriter
from zero_core.checkpoint._state_keys import ModelKeys, check_names, refresh_kept
from zero_core.chunks.chunk import to_local
from zero_core.comm._agreement import agree_ok, gather_objects, raise_if_any_failed, rank0_value
from zero_core.setup._setup import group_offsets

if TYPE_CHECKING:
    from zero_core.chunks.chunk import Chunk
    from zero_core.runtime._engine import Engine
    from zero_core.runtime._whole_step import WholeTensorSteps

__all__ = ["METADATA", "read_sharded", "write_sharded"]

METADATA = "zero_checkpoint.json"
FORMAT = "zero-sharded-checkpoint"
VERSION = 2
# Version 1 is version 2 without strided pieces: both are read; a save writes 1 unless it has strided pieces.
_READS = (1, 2)
_OURS = re.compile(r"^[0-9a-f]{16}\.(rank\d{5}-of-\d{5}\.safetensors|extra\.pt)(" + re.escape(TMP_MARK) + r"\d+)?$")
_METADATA_TMP = re.compile("^" + re.escape(METADATA + TMP_MARK) + r"\d+$")


def _rank_file(save_id: str, rank: int, world: int) -> str:
    return f"{save_id}.rank{rank:05d}-of-{world:05d}.safetensors"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"the checkpoint names an unknown dtype {name!r}")
    return dtype


# -- what a rank holds ------------------------------------------------------------------------
def _segment_states(engine: Engine) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """Each segment parameter's optimizer state as the optimizer holds it (by id: disk-resident values are
    stand-ins of the right shape and dtype, read chunk by chunk while writing); and each param group's
    hyperparameters."""
    optimizers = engine.optimizers  # each parameter in one of them at most: states keyed by parameter never clash
    states: dict[int, dict[str, Any]] = {
        id(seg.param): next((s for o in optimizers if (s := o.state.get(seg.param)) is not None), {})
        for chunk in engine.chunks for seg in chunk.segments}
    groups = [{k: _jsonable(v) for k, v in group.items() if k != "params"}
              for optimizer in optimizers for group in optimizer.param_groups]
    return states, groups


def _optimizer_of(engine: Engine, chunk: Chunk) -> tuple[Any, WholeTensorSteps | None, int | None] | None:
    """The optimizer that steps ``chunk``'s parameters, its whole-tensor steps and the chunk's group in it; ``None``
    for a chunk in no optimizer when there are several (one optimizer takes every chunk, as it always did)."""
    bridge = engine.bridge
    if len(bridge.optimizers) == 1:
        return bridge.optimizers[0], bridge.wholes[0], chunk.param_group
    if chunk.param_group is None:
        return None
    offsets = group_offsets(bridge.optimizers)
    i = max(k for k, at in enumerate(offsets) if at <= chunk.param_group)
    return bridge.optimizers[i], bridge.wholes[i], chunk.param_group - offsets[i]


def _pieces(chunk: Chunk) -> list[tuple[int, str, list[Any]]]:
    """``(slot, name, ranges)`` for each parameter piece in this rank's shard of ``chunk``: ``ranges`` is ``[lo, hi]``
    or ``[lo, hi, stride, count]`` (see [Note: sharded checkpoint format]).

    On a mesh with replicas only the first replica writes (its shards are every replica's), so each
    shard is written once, unless the shards are cut over the replicas too (each rank then holds its own); the
    loader reads ranges, whichever rank wrote them."""
    if chunk.comms is not None and chunk.comms.replicate_rank != 0 and chunk.outer == 1:
        return []
    out: list[tuple[int, str, list[Any]]] = []
    for i, slot in enumerate(chunk.slots):
        runs = slot.runs(chunk.rank, held=False)
        if not runs:
            continue
        lo, hi, _ = runs[0]
        ranges = [lo, hi] if len(runs) == 1 else [lo, hi, runs[1][0] - lo, len(runs)]
        out.append((i, slot.name, ranges))
    return out


def piece_runs(piece: list[Any]) -> list[tuple[int, int, int, int]]:
    """``(rank, lo, hi, at)`` for each range of a metadata piece: elements ``[lo, hi)`` of the flattened parameter,
    at element ``at`` of the rank's saved tensor."""
    rank, lo, hi = piece[0], piece[1], piece[2]
    stride, count = (piece[3], piece[4]) if len(piece) > 3 else (0, 1)
    return [(rank, lo + i * stride, hi + i * stride, i * (hi - lo)) for i in range(count)]


def _numel(ranges: list[Any]) -> int:
    return (ranges[1] - ranges[0]) * (ranges[3] if len(ranges) > 3 else 1)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    raise CheckpointError(f"optimizer hyperparameter value {value!r} ({type(value).__name__}) cannot be saved as JSON")


# -- save -----------------------------------------------------------------------------------------
def begin_save(engine: Engine, directory: str | os.PathLike[str]) -> tuple[Path, str]:
    """A save's first collective part: the engine settled, the directory made (rank 0) and the save id agreed."""
    engine.settle("save_checkpoint", collective=True)
    directory = Path(directory)
    comm = engine.comm
    error = None
    save_id = None
    if comm.rank == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if not os.access(directory, os.W_OK):
                raise CheckpointError(f"{directory} is not writable")
            save_id = uuid.uuid4().hex[:16]
        except (OSError, CheckpointError) as exc:
            error = f"cannot use {directory} as a checkpoint directory ({exc})"
    raise_if_any_failed(engine.comm, error, f"saving a checkpoint to {directory} failed")
    save_id = rank0_value(comm, save_id)
    assert save_id is not None
    return directory, save_id


@traced(CHECKPOINT_SAVE)
def write_sharded(engine: Engine, directory: str | os.PathLike[str], *, extra: Any = None,
                  with_optimizer: bool = True) -> None:
    """Write a sharded checkpoint of the model, optimizer, loss scaler and step. Collective.

    See [Note: sharded checkpoint format]. Needs no gather: each rank writes what it holds.
    """
    directory, save_id = begin_save(engine, directory)
    comm = engine.comm
    rank, world = comm.rank, comm.world_size
    description: dict[str, Any] | None = None
    try:
        description = _write_rank_file(engine, directory, save_id, rank, world, with_optimizer)
        if rank == 0 and extra is not None:
            name = f"{save_id}.extra.pt"
            size, digest = atomic_write(directory / name, lambda stream: torch.save(extra, stream))  # type: ignore[arg-type]  # save() needs write/flush only
            description["extra"] = {"name": name, "bytes": size, "sha256": digest}
        error = None
    except Exception as exc:  # noqa: BLE001 - any failure here must reach the other ranks, not leave them waiting
        error = f"{type(exc).__name__}: {exc}"
    commit_save(comm, directory, save_id, engine_metadata(engine), description, error)


def commit_save(comm: Any, directory: Path, save_id: str, base: dict[str, Any], description: dict[str, Any] | None,
                error: str | None) -> None:
    """The end of a save, collective over ``comm``: every rank's file is written (or ``error`` says why not); rank 0
    writes the metadata (``base``, :func:`engine_metadata`, and the descriptions), then removes earlier saves' files.
    A failure anywhere is raised on every rank, and the previous checkpoint stays."""
    what = f"saving a checkpoint to {directory} failed; the previous checkpoint there is intact"
    raise_if_any_failed(comm, error, what)
    try:
        descriptions = gather_objects(comm, description)
    except RuntimeError as exc:
        raise CheckpointError(f"{what}: another rank failed or stopped responding ({exc})") from exc
    error = None
    if comm.rank == 0:
        try:
            metadata = assemble_metadata(base, save_id, descriptions)
            atomic_write(directory / METADATA, lambda stream: stream.write(json.dumps(metadata, indent=1).encode()))
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = f"writing the metadata failed ({type(exc).__name__}: {exc}); the previous checkpoint there is intact"
        else:
            try:  # the new checkpoint is complete; what is left is housekeeping
                remove_stale(directory, save_id)
            except OSError as exc:
                warnings.warn(f"the checkpoint in {directory} is complete, but files of earlier saves could not be "
                              f"removed ({exc}); the next save tries again", stacklevel=2)
    raise_if_any_failed(comm, error, f"saving a checkpoint to {directory} failed")


class RankFilePlan:
    """One rank's file of a save: its safetensors entries (name, dtype, shape) in write order, the description
    rank 0 merges into the metadata, and :meth:`tensors`, which yields each entry's values in that order (a
    disk-resident shard read in for its chunk and dropped after it)."""

    def __init__(self, name: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], save_id: str,
                 description: dict[str, Any], tensors: Any) -> None:
        self.name, self.entries, self.save_id, self.description = name, entries, save_id, description
        self.tensors = tensors

    @property
    def nbytes(self) -> int:
        """Bytes of the values (the file adds its header)."""
        return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in self.entries)

    def write(self, stream: Any, values: Any) -> None:
        """The file, from ``values`` (``(name, tensor)`` in entry order) into ``stream``."""
        writer = SafetensorsWriter(stream, self.entries, {"format": "pt", "producer": "zero", "save_id": self.save_id})
        for key, value in values:
            writer.write(key, value)
        writer.close()


def _write_rank_file(engine: Engine, directory: Path, save_id: str, rank: int, world: int,
                     with_optimizer: bool) -> dict[str, Any]:
    plan = plan_rank_file(engine, save_id, rank, world, with_optimizer)
    directory.mkdir(parents=True, exist_ok=True)  # rank 0 made it; on a slow shared file system it may not show yet
    with torch.no_grad():
        size, digest = atomic_write(directory / plan.name, lambda stream: plan.write(stream, plan.tensors()))
    return {**plan.description, "file": {"name": plan.name, "bytes": size, "sha256": digest}}


def plan_rank_file(engine: Engine, save_id: str, rank: int, world: int, with_optimizer: bool) -> RankFilePlan:
    """What this rank's file of save ``save_id`` holds; see :class:`RankFilePlan`."""
    states, groups = _segment_states(engine) if with_optimizer else ({}, None)
    model_keys = ModelKeys.of(engine.module, engine.chunks)
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    pieces: list[list[Any]] = []
    scalars: dict[str, dict[str, Any]] = {}
    state_keys: dict[str, list[str]] = {}
    segment_of = {(chunk.index, seg.slot): seg for chunk in engine.chunks for seg in chunk.segments}
    wholes = [w for w in engine.bridge.wholes if w is not None] if with_optimizer else []
    # A whole-tensor optimizer's states: saved whole by the parameter's owner (see [Note: whole-tensor optimizer
    # steps]), under w/<name>/<key>, and read back by whichever rank owns the parameter at the load.
    whole_keys: dict[str, list[str]] = {}
    whole_states: list[tuple[str, torch.Tensor]] = []
    for whole in wholes:
        for entry in whole.entries:
            if entry.owner != rank:
                continue
            for key, value in states.pop(id(entry.param), {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    whole_keys.setdefault(entry.name, []).append(key)
                    whole_states.append((f"w/{entry.name}/{key}", value))
                elif isinstance(value, torch.Tensor):
                    scalars.setdefault(entry.name, {})[key] = {"tensor": _dtype_name(value.dtype), "value": value.item()}
                else:
                    scalars.setdefault(entry.name, {})[key] = {"value": _jsonable(value)}
        for entry in whole.entries:
            states.pop(id(entry.param), None)
    for chunk in engine.chunks:
        for slot, name, ranges in _pieces(chunk):
            numel = _numel(ranges)
            entries.append((f"p/{name}", chunk.master_dtype, (numel,)))
            pieces.append([name, *ranges])
            seg = segment_of.get((chunk.index, slot))
            state = states.get(id(seg.param), {}) if seg is not None else {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and (value.dim() > 0 or isinstance(value, DTensor)):
                    value = to_local(value)
                    if value.numel() != numel:
                        raise CheckpointError(
                            f"optimizer state {key!r} of {name!r} has {value.numel()} elements for a {numel}-element "
                            "piece: only elementwise optimizer states can be saved sharded"
                        )
                    entries.append((f"o/{name}/{key}", value.dtype, (numel,)))
                    state_keys.setdefault(name, [])
                    if key not in state_keys[name]:
                        state_keys[name].append(key)
                elif isinstance(value, torch.Tensor):
                    scalars.setdefault(name, {})[key] = {"tensor": _dtype_name(value.dtype), "value": value.item()}
                else:
                    scalars.setdefault(name, {})[key] = {"value": _jsonable(value)}
    entries += [(key, value.dtype, tuple(value.shape)) for key, value in whole_states]  # written in this order
    if rank == 0:
        entries += [(f"b/{key}", buf.dtype, tuple(buf.shape)) for key, buf in model_keys.buffers.items()]
    rng = torch.random.get_rng_state()
    entries.append(("rng/cpu", rng.dtype, tuple(rng.shape)))
    cuda_rng = torch.cuda.get_rng_state(engine.device) if engine.device.type == "cuda" else None
    if cuda_rng is not None:
        entries.append(("rng/cuda", cuda_rng.dtype, tuple(cuda_rng.shape)))

    def tensors() -> Any:
        placement = engine.placement
        for chunk in engine.chunks:
            chunk_pieces = _pieces(chunk)
            if not chunk_pieces:
                continue
            placement.before_gather([chunk])  # a shard on disk is read in for the save, and dropped after
            try:
                # states kept out of memory are read back one chunk at a time, and dropped after it
                # (several optimizers are only on the device placement, which keeps their states as they are)
                readable = (placement.optimizer_states(chunk) if len(engine.optimizers) == 1 else states) \
                    if with_optimizer else {}
                for slot, name, ranges in chunk_pieces:
                    yield f"p/{name}", chunk.held(slot)[: _numel(ranges)]
                    seg = segment_of.get((chunk.index, slot))
                    state = readable.get(id(seg.param), {}) if seg is not None and id(seg.param) in states else {}
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor) and (value.dim() > 0 or isinstance(value, DTensor)):
                            yield f"o/{name}/{key}", to_local(value).reshape(-1)
                del readable
            finally:
                placement.after_release([chunk])
        for key, value in whole_states:
            yield key, value.reshape(-1)
        if rank == 0:
            for key, buf in model_keys.buffers.items():
                yield f"b/{key}", buf
        yield "rng/cpu", rng
        if cuda_rng is not None:
            yield "rng/cuda", cuda_rng

    description = {
        # with several optimizers, how many of the groups are each one's (see [Note: sharded checkpoint format])
        **({"optimizer_groups": [len(o.param_groups) for o in engine.optimizers]}
           if with_optimizer and len(engine.optimizers) > 1 else {}),
        "pieces": pieces, "scalars": scalars, "state_keys": state_keys, "whole_keys": whole_keys, "groups": groups,
        "params": {s.name: {"shape": list(s.shape), "dtype": _dtype_name(c.master_dtype), "group": c.param_group,
                            "requires_grad": c.requires_grad}
                   for c in engine.chunks for s in c.slots},
        "buffers": {k: {"shape": list(b.shape), "dtype": _dtype_name(b.dtype)} for k, b in model_keys.buffers.items()},
        "tied": {names[0]: names[1:] for names in model_keys.names.values() if len(names) > 1}}
    return RankFilePlan(_rank_file(save_id, rank, world), entries, save_id, description, tensors)


def engine_metadata(engine: Engine) -> dict[str, Any]:
    """What the metadata says of the engine (its step, chunk geometry, loss scaler, the model's configs), read now: an
    asynchronous save reads it when it stages, not when it commits."""
    scaler = engine.bridge.scaler.state_dict() if engine.bridge.scaler is not None else None
    return {
        "step": engine.step_count, "strategy": engine.config.strategy, "stage": engine.config.stage,
        "placement": engine.config.placement, "zero_version": __version__, "torch_version": torch.__version__,
        "host": platform.node(), "loss_scaler": scaler,
        # an HF-style model's config.json (and generation_config.json), so that `zero consolidate` can write a
        # directory from_pretrained loads without the model's code; {} for other models
        "model_configs": model_config_texts(engine.module),
    }


def assemble_metadata(base: dict[str, Any], save_id: str, descriptions: list[dict[str, Any]]) -> dict[str, Any]:
    """The metadata of save ``save_id``: ``base`` (:func:`engine_metadata`) and every rank's file description."""
    first = descriptions[0]
    params = {name: {**info, "pieces": []} for name, info in first["params"].items()}
    scalars: dict[str, dict[str, Any]] = {}
    state_keys: dict[str, list[str]] = {}
    whole: dict[str, dict[str, Any]] = {}
    for rank, description in enumerate(descriptions):
        for name, *ranges in description["pieces"]:
            params[name]["pieces"].append([rank, *ranges])
        for name, values in description["scalars"].items():
            scalars.setdefault(name, values)
        for name, keys in description["state_keys"].items():
            state_keys.setdefault(name, keys)
        for name, keys in description.get("whole_keys", {}).items():
            whole[name] = {"rank": rank, "keys": keys}
    return {
        "format": FORMAT, "save_id": save_id, "world_size": len(descriptions),
        "version": VERSION if any(len(p) > 3 for d in descriptions for p in d["pieces"]) else 1,
        "step": base["step"], "strategy": base["strategy"], "stage": base["stage"], "placement": base["placement"],
        "zero_version": base["zero_version"], "torch_version": base["torch_version"], "host": base["host"],
        "files": [d["file"] for d in descriptions], "extra": first.get("extra"),
        "params": params, "buffers": first["buffers"], "tied": first["tied"],
        "optimizer": None if first["groups"] is None else
        {"param_groups": first["groups"], "state_keys": state_keys, "scalars": scalars,
         # states of a whole-tensor optimizer: the rank whose file holds each parameter's, and their keys
         "whole": whole,
         **({"optimizer_groups": first["optimizer_groups"]} if "optimizer_groups" in first else {})},
        "loss_scaler": base["loss_scaler"],
        "model_configs": base["model_configs"],
    }


def remove_stale(directory: Path, save_id: str) -> None:
    """Files of earlier saves (and interrupted ones) in this directory, now that the metadata names the new ones."""
    for path in directory.iterdir():
        if (_OURS.match(path.name) and not path.name.startswith(save_id + ".")) or _METADATA_TMP.match(path.name):
            path.unlink(missing_ok=True)
    fsync_dir(directory)


# -- load -----------------------------------------------------------------------------------------
def read_metadata(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's metadata, with a clear error for a directory that holds no complete checkpoint."""
    directory = Path(directory)
    if not directory.exists():
        raise CheckpointError(f"no checkpoint at {directory}: the path does not exist")
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is a file, not a checkpoint directory written by zero_core.save_checkpoint"
                              " (for a plain state dict file use model.load_full_state_dict)")
    path = directory / METADATA
    if not path.is_file():
        ours = sorted(p.name for p in directory.iterdir() if _OURS.match(p.name))
        if ours:
            raise CheckpointError(
                f"{directory} holds an incomplete checkpoint: shard files ({', '.join(ours[:3])}"
                f"{', ...' if len(ours) > 3 else ''}) but no {METADATA}, which a save writes last. The save was "
                "interrupted; load an earlier checkpoint"
            )
        inside = checkpoint_inside(directory)
        if inside is not None:
            raise CheckpointError(
                f"{directory} is not a zero checkpoint, but {inside} inside it is (an HF Trainer checkpoint-N "
                f"folder keeps zero's shards in its zero/ subfolder): pass {inside}")
        present = sorted(p.name for p in directory.iterdir())[:5]
        raise CheckpointError(
            f"{directory} is not a zero checkpoint: it has no {METADATA} (it holds {present or 'nothing'}); "
            "pass the directory given to zero_core.save_checkpoint"
        )
    try:
        metadata = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} cannot be read as JSON ({exc}); the metadata file is damaged") from exc
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not the metadata of a zero sharded checkpoint (format {FORMAT!r})")
    if metadata.get("version") not in _READS:
        raise CheckpointError(f"{path} has checkpoint format version {metadata.get('version')}; this zero reads "
                              f"versions {', '.join(map(str, _READS))}: load it with the zero that saved it")
    return metadata


def checkpoint_inside(directory: str | os.PathLike[str]) -> Path | None:
    """The one subfolder of ``directory`` that holds a zero checkpoint (an HF Trainer ``checkpoint-N/zero``), if any."""
    found = [p for p in sorted(Path(directory).iterdir()) if (p / METADATA).is_file()]
    return found[0] if len(found) == 1 else None


def _verify(directory: Path, entry: dict[str, Any]) -> None:
    path = directory / entry["name"]
    if not path.is_file():
        raise CheckpointError(f"shard file {path} named by the metadata is missing")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"shard file {path} has {size} bytes but the metadata records {entry['bytes']}: the file is "
                              "truncated or was replaced; restore it or load an earlier checkpoint")
    digest = file_sha256(path)
    if digest != entry["sha256"]:
        raise CheckpointError(f"shard file {path} fails its checksum (sha256 {digest[:12]}..., the metadata records "
                              f"{entry['sha256'][:12]}...): the file is corrupt; restore it or load an earlier checkpoint")


class _Reader:
    """Reads flat ranges of parameters and states from whichever rank files hold them."""

    def __init__(self, directory: Path, metadata: dict[str, Any]) -> None:
        self.directory = directory
        self.metadata = metadata
        self._files: dict[int, SafetensorsRangeReader] = {}
        self._runs: dict[str, list[tuple[int, int, int, int]]] = {}

    def runs(self, name: str) -> list[tuple[int, int, int, int]]:
        """``(rank, lo, hi, at)`` for every saved range of parameter ``name`` (see :func:`piece_runs`)."""
        if name not in self._runs:
            self._runs[name] = [run for piece in self.metadata["params"][name]["pieces"] for run in piece_runs(piece)]
        return self._runs[name]

    def _file(self, rank: int) -> SafetensorsRangeReader:
        if rank not in self._files:
            self._files[rank] = SafetensorsRangeReader(self.directory / self.metadata["files"][rank]["name"])
        return self._files[rank]

    def read_into(self, prefix: str, name: str, lo: int, out: torch.Tensor) -> None:
        """Elements ``[lo, lo + out.numel())`` of ``prefix + name`` from the saved pieces, into ``out``."""
        hi = lo + out.numel()
        for rank, a, b, at in self.runs(name):
            x, y = max(a, lo), min(b, hi)
            if x < y:
                self._file(rank).read_into(prefix, at + x - a, out[x - lo : y - lo])

    def read(self, prefix: str, name: str, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=dtype)
        self.read_into(prefix, name, lo, out)
        return out

    def tensor(self, rank: int, name: str) -> torch.Tensor:
        return self._file(rank).tensor(name)

    def has(self, rank: int, name: str) -> bool:
        return name in self._file(rank).entries

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files = {}


@traced(CHECKPOINT_LOAD)
def read_sharded(
    engine: Engine, directory: str | os.PathLike[str], *, load_optimizer: bool = True, strict: bool = True,
    load_rng: bool = True,
) -> Any:
    """Load a sharded checkpoint saved at any world size, strategy or chunk size. Collective.

    Every rank first validates what it will read (metadata, names and shapes against the
    model, each file's size and sha256); if anything is wrong on any rank, every rank
    raises and nothing is changed. Returns the ``extra`` object saved with it, or ``None``.
    """
    engine.settle("load_checkpoint", collective=True)
    directory = Path(directory)
    comm = engine.comm
    model_keys = ModelKeys.of(engine.module, engine.chunks)
    error = None
    extra = None
    metadata: dict[str, Any] = {}
    reads: list[tuple[Chunk, int, str]] = []
    needed = {0} if model_keys.buffers else set()
    try:
        metadata = read_metadata(directory)
        shapes = {**{n: tuple(i["shape"]) for n, i in metadata["params"].items()},
                  **{n: tuple(i["shape"]) for n, i in metadata["buffers"].items()}}
        # the saved model's ties: a twin's values are stored under its first name only
        aliases = {twin: name for name, twins in metadata.get("tied", {}).items() for twin in twins}
        check_names(model_keys, shapes, strict=strict, what=f"the checkpoint at {directory}", aliases=aliases)
        if load_optimizer:
            if metadata["optimizer"] is None:
                raise CheckpointError(
                    f"the checkpoint at {directory} was saved without optimizer states (save_checkpoint(model, None, "
                    "...)); pass optimizer=None to load_checkpoint to load the parameters only"
                )
            _check_groups(engine, metadata["optimizer"])
            for value in metadata["optimizer"]["scalars"].values():
                for entry in value.values():
                    if "tensor" in entry:
                        _dtype(entry["tensor"])
            needed |= _check_whole_states(engine, metadata, directory)
        reader_meta = metadata["params"]
        saved_runs = _Reader(directory, metadata)
        for chunk in engine.chunks:
            for i, slot in enumerate(chunk.slots):
                name = model_keys.param_source(slot.param, reader_meta, aliases)
                if name is None:
                    continue
                # a rank without rows of the parameter reads none, but its optimizer states are loaded all the same
                # (empty, with the saved step counts), as a step would have made them
                reads.append((chunk, i, name))
                runs = chunk.runs(i)
                for lo, hi, _ in runs:
                    pieces = [(r, a, b) for r, a, b, _ in saved_runs.runs(name) if a < hi and b > lo]
                    if sum(min(b, hi) - max(a, lo) for _, a, b in pieces) != hi - lo:
                        raise CheckpointError(f"the metadata does not cover elements [{lo}, {hi}) of {name!r}: the "
                                              "checkpoint is damaged")
                    needed |= {r for r, _, _ in pieces}
        if load_rng and comm.rank < metadata["world_size"]:
            needed.add(comm.rank)
        if metadata.get("extra") is not None:
            _verify(directory, metadata["extra"])
            # unpickled now: an object that cannot be unpickled must fail the load before anything changes
            extra = torch.load(directory / metadata["extra"]["name"], map_location="cpu", weights_only=False)
        for rank in sorted(needed):
            _verify(directory, metadata["files"][rank])
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - a damaged file or an extra object that cannot be unpickled
        error = f"{directory} holds a damaged checkpoint ({type(exc).__name__}: {exc})"
    raise_if_any_failed(engine.comm, error, f"loading the checkpoint at {directory} failed; nothing was changed")

    reader = _Reader(directory, metadata)
    with torch.no_grad():
        _load_params(engine, reader, reads, model_keys, metadata, load_optimizer)
    if engine.bridge.scaler is not None and metadata.get("loss_scaler") is not None:
        engine.bridge.scaler.load_state_dict(metadata["loss_scaler"])
    engine.step_count = int(metadata["step"])
    if load_rng and comm.rank < metadata["world_size"]:  # the same rank's generator, where it was at the save
        torch.random.set_rng_state(reader.tensor(comm.rank, "rng/cpu"))
        if engine.device.type == "cuda" and reader.has(comm.rank, "rng/cuda"):
            torch.cuda.set_rng_state(reader.tensor(comm.rank, "rng/cuda"), engine.device)
    reader.close()
    return extra


def _load_params(engine: Engine, reader: _Reader, reads: list[tuple[Any, int, str]], model_keys: ModelKeys,
                 metadata: dict[str, Any], load_optimizer: bool) -> None:
    """Parameters (and optimizer states) chunk by chunk: read straight into the shard, states beside it,
    then the placement policy takes both where it keeps them before the next chunk is read."""
    by_chunk: dict[int, list[tuple[int, str]]] = {}
    for chunk, i, name in reads:
        by_chunk.setdefault(chunk.index, []).append((i, name))
    placement = engine.placement
    for chunk in engine.chunks:
        todo = by_chunk.get(chunk.index, [])
        placement.before_load([chunk])
        try:
            error = None
            try:
                for i, name in todo:  # straight into the shard: no intermediate copy
                    held = chunk.held(i)
                    for lo, hi, at in chunk.runs(i):
                        reader.read_into(f"p/{name}", name, lo, held[at : at + hi - lo])
                if load_optimizer:
                    _load_states(engine, chunk, reader, dict(todo), metadata)
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it before the next collective
                error = f"{type(exc).__name__}: {exc}"
            agree_ok(engine.comm, error, "loading the checkpoint stopped partway; the model is partly loaded, load it again")
            refresh_kept(chunk, engine.comm)
            engine.residency.mark_refreshed([chunk])
        finally:
            placement.after_load([chunk])
    for key, buf in model_keys.buffers.items():
        source = model_keys.source_name(key, reader.metadata["buffers"])
        if source is not None:
            buf.copy_(reader.tensor(0, f"b/{source}").view(buf.shape))
    if load_optimizer:
        groups = [group for optimizer in engine.optimizers for group in optimizer.param_groups]
        for group, hyper in zip(groups, metadata["optimizer"]["param_groups"]):
            group.update({k: v for k, v in hyper.items() if k != "params"})


def _check_groups(engine: Engine, saved: dict[str, Any]) -> None:
    """The checkpoint's optimizers have the groups of this engine's (one optimizer: as many groups)."""
    ours = [len(o.param_groups) for o in engine.optimizers]
    theirs = saved.get("optimizer_groups", [len(saved["param_groups"])])
    if theirs == ours:
        return
    if len(theirs) == 1 and len(ours) == 1:
        raise CheckpointError(
            f"the checkpoint's optimizer has {theirs[0]} param group(s) but this optimizer has {ours[0]}; build the "
            "optimizer with the same groups, or pass optimizer=None to load_checkpoint to load the parameters only")
    raise CheckpointError(
        f"the checkpoint was saved with {len(theirs)} optimizer(s) of {theirs} param group(s), and this model was "
        f"sharded with {len(ours)} of {ours}; pass shard() the same optimizers in the same order (a tuple for "
        "several), or optimizer=None to load_checkpoint to load the parameters only")


def _check_whole_states(engine: Engine, metadata: dict[str, Any], directory: Path) -> set[int]:
    """The rank files this rank reads whole-tensor optimizer states from; raises when the checkpoint's optimizer
    states are of the other kind (element-wise pieces for a whole-tensor optimizer, or the reverse)."""
    saved = metadata["optimizer"]
    held = saved.get("whole", {})
    bridge = engine.bridge
    several = len(bridge.optimizers) > 1
    needed: set[int] = set()
    for optimizer, whole, chunks in zip(bridge.optimizers, bridge.wholes, bridge.chunks_of or [engine.chunks]):
        if whole is None:
            names = {slot.name for chunk in chunks for slot in chunk.slots}
            found = next((name for name in held if name in names or not several), None)
            if found is not None:
                raise CheckpointError(
                    f"the checkpoint at {directory} holds the states of an optimizer stepped whole per parameter "
                    f"(Muon, Adafactor, ...; for example {found!r}), and this optimizer "
                    f"({type(optimizer).__name__}) is element-wise; load it with the same optimizer, or pass "
                    "optimizer=None to load the parameters only")
            continue
        pieces = [e.name for e in whole.entries if saved["state_keys"].get(e.name)]
        if pieces:
            raise CheckpointError(
                f"the checkpoint at {directory} holds element-wise optimizer states (for example of {pieces[0]!r}), "
                f"and this optimizer ({type(optimizer).__name__}) is stepped whole per parameter; load it with the "
                "same optimizer, or pass optimizer=None to load the parameters only")
        for entry in whole.entries:
            if entry.owner == engine.comm.rank and entry.name in held and held[entry.name]["rank"] >= len(metadata["files"]):
                raise CheckpointError(f"the metadata names a missing file for {entry.name!r}: the checkpoint is damaged")
        needed |= {held[e.name]["rank"] for e in whole.entries if e.owner == engine.comm.rank and e.name in held}
    return needed


def _load_states(engine: Engine, chunk: Chunk, reader: _Reader, where: dict[int, str],
                 metadata: dict[str, Any]) -> None:
    """Replace the optimizer states of ``chunk``'s segments by the saved ones, as torch's
    ``load_state_dict`` places them: per-element states on the segment's device and dtype, step counts
    on the CPU (on the device for fused and capturable groups)."""
    stepped_by = _optimizer_of(engine, chunk)
    if stepped_by is None:  # in no optimizer: it has no states
        return
    optimizer, whole, index = stepped_by
    saved = metadata["optimizer"]
    group = optimizer.param_groups[index] if index is not None else {}
    on_device = bool(group.get("fused") or group.get("capturable"))
    for seg in chunk.segments:
        found = where.get(seg.slot)
        owner = whole.owner_of(seg.param) if whole is not None else None
        if whole is not None and owner is not None and owner != whole.rank:  # another rank steps it and holds its states
            optimizer.state.pop(seg.param, None)
            continue
        if found is None and owner is None:
            continue
        # an owner may hold no rows of its parameter: its states are whole all the same
        name = found if found is not None else chunk.slots[seg.slot].name
        entry: dict[str, Any] = {}
        for key, value in saved["scalars"].get(name, {}).items():
            if "tensor" in value:
                scalar = torch.tensor(value["value"], dtype=_dtype(value["tensor"]))
                entry[key] = scalar.to(seg.local.device) if on_device else scalar
            else:
                entry[key] = value["value"]
        if owner is not None:
            held = saved.get("whole", {}).get(name)
            for key in held["keys"] if held else []:
                entry[key] = reader.tensor(held["rank"], f"w/{name}/{key}").to(seg.local.device)
            if entry:
                optimizer.state[seg.param] = entry
            else:
                optimizer.state.pop(seg.param, None)
            continue
        for key in saved["state_keys"].get(name, []):
            values = torch.empty(chunk.held(seg.slot).numel(), dtype=seg.param.dtype)
            for lo, hi, at in chunk.runs(seg.slot):
                reader.read_into(f"o/{name}/{key}", name, lo, values[at : at + hi - lo])
            local = values.to(seg.local.device).view(chunk.slots[seg.slot].local_shape(chunk.rank))
            entry[key] = chunk.wrap(seg.slot, local)
        if entry:
            optimizer.state[seg.param] = entry
        else:
            optimizer.state.pop(seg.param, None)
