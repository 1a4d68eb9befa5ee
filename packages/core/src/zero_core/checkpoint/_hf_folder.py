"""The Hugging Face checkpoint folder format, written one tensor at a time.

[Note: Hugging Face folder format]
A directory holds ``model.safetensors`` when every tensor fits in one shard, else
``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {key: file}}``), split the way
``transformers``' ``save_pretrained`` splits: tensors in order, a new file whenever the
next tensor would take the current one past ``max_shard_size``, a tensor bigger than
that alone in its own file. ``config.json`` and ``generation_config.json`` sit beside
them when the model has an HF-style config. A tied parameter is stored once, under its
first name, as ``save_pretrained`` does (``from_pretrained`` ties it again).

Atomicity: every file is first written completely under a temporary name in the target
directory (``<name>.tmp-<pid>``, which no reader globs), fsynced. Then the commit: the
old index goes first, then weight files of an earlier save that this one does not
replace, then the new files are renamed into place, the index last. So a reader sees
either the previous checkpoint, or the new one complete, or (during a crash mid-commit)
shard files without their index, which ``from_pretrained`` and zero refuse rather than
load half: never a mix presented as complete. Files the writer does not own (a
Trainer's ``training_args.bin``, a tokenizer) are never touched.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from zero_core.base._atomic import TMP_MARK, fsync_dir
from zero_core.base.errors import CheckpointError
from zero_core.checkpoint._safetensors_stream import SafetensorsWriter

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE", "HFDirectoryWriter", "INDEX", "SINGLE", "model_config_texts", "parse_dtype",
    "parse_shard_size", "plan_shards", "with_dtype",
]

DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' default
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_OWNED = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|config\.json|"
                    r"generation_config\.json)" + re.escape(TMP_MARK) + r"\d+$")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_DTYPE_NAMES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
    "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}

Entry = tuple[str, torch.dtype, tuple[int, ...]]


def parse_shard_size(value: int | str) -> int:
    """Bytes from an int or a size as transformers writes it: ``"5GB"`` (10^9), ``"500MiB"`` (2^20), ``"1000"``."""
    if isinstance(value, bool):
        raise CheckpointError(f"max_shard_size must be a number of bytes or a size like '5GB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise CheckpointError(f"max_shard_size {value!r} is not a size; give bytes (an int) or a number with "
                                  "a unit, like '5GB', '500MB' or '2GiB'")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise CheckpointError(f"max_shard_size must be positive, got {value!r}")
    return size


def parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """A floating dtype to cast to (``None``: keep), from a torch dtype or a name like ``"bf16"``."""
    if value is None or value in ("", "none", "keep"):
        return None
    dtype = value if isinstance(value, torch.dtype) else _DTYPE_NAMES.get(str(value).lower().removeprefix("torch."))
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise CheckpointError(f"dtype {value!r} is not one to cast weights to; use torch.bfloat16, torch.float16 or "
                              "torch.float32 (on the command line: bf16, fp16 or fp32), or leave it out to keep the "
                              "master dtype")
    return dtype


def cast_dtype(dtype: torch.dtype, to: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor is stored in: floating tensors take ``to``; integer and bool ones keep theirs."""
    return to if to is not None and dtype.is_floating_point else dtype


def plan_shards(entries: Sequence[Entry], max_bytes: int) -> list[list[Entry]]:
    """``entries`` split into files as ``save_pretrained`` splits them (see the note above)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        nbytes = _nbytes(entry)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _nbytes(entry: Entry) -> int:
    _, dtype, shape = entry
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


def file_names(count: int) -> list[str]:
    return [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


# -- the model's config ------------------------------------------------------------------------------
def _plain_class_name(model: Any) -> str:
    """The model's own class name, not the ``Zero<name>`` subclass that ``shard`` makes it (which records the
    model's class as ``_zero_plain_class``)."""
    return getattr(type(model), "_zero_plain_class", type(model)).__name__


def _json_of(obj: Any, file_name: str) -> dict[str, Any] | None:
    """An HF-style config object as a dict: ``to_json_string()``, else ``save_pretrained`` into a scratch dir."""
    text = None
    if callable(getattr(obj, "to_json_string", None)):
        text = obj.to_json_string()
    elif callable(getattr(obj, "save_pretrained", None)):
        with tempfile.TemporaryDirectory() as scratch:
            obj.save_pretrained(scratch)
            path = Path(scratch) / file_name
            text = path.read_text() if path.is_file() else None
    if text is None:
        return None
    value = json.loads(text)
    return value if isinstance(value, dict) else None


def model_config_texts(model: Any) -> dict[str, dict[str, Any]]:
    """``{"config.json": ..., "generation_config.json": ...}`` for a model with an HF-style ``config``
    (duck-typed: no transformers import); ``{}`` for any other model."""
    out: dict[str, dict[str, Any]] = {}
    config = getattr(model, "config", None)
    if config is None:
        return out
    value = _json_of(config, "config.json")
    if value is None:
        return out
    # save_pretrained records the class; under zero it must be the plain one, which from_pretrained knows
    value["architectures"] = [_plain_class_name(model)]
    out["config.json"] = value
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        gen = _json_of(generation, "generation_config.json")
        if gen is not None:
            out["generation_config.json"] = gen
    return out


def with_dtype(configs: dict[str, dict[str, Any]], dtype: torch.dtype | None) -> dict[str, dict[str, Any]]:
    """The configs with the stored floating dtype recorded, so ``from_pretrained(dtype="auto")`` loads it as stored."""
    if dtype is None or "config.json" not in configs:
        return configs
    config = dict(configs["config.json"])
    name = str(dtype).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    for key in keys:
        config[key] = name
    return {**configs, "config.json": config}


# -- the writer --------------------------------------------------------------------------------------
class HFDirectoryWriter:
    """Streams tensors into a Hugging Face folder: :meth:`write` each entry in order, then :meth:`commit`.

    Holds no tensor: each value goes straight to the open shard file. Files are written under
    temporary names and renamed into place by :meth:`commit` (see the note above); :meth:`abort`
    removes them.
    """

    def __init__(self, directory: str | os.PathLike[str], entries: Sequence[Entry], *, max_shard_size: int,
                 configs: dict[str, dict[str, Any]] | None = None, single_file: bool = False) -> None:
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory} is a file; give a directory to write the Hugging Face format "
                                  "into, or a path ending in .safetensors for one file")
        self.directory.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.directory)
        self.shards = [list(entries)] if single_file else plan_shards(entries, max_shard_size)
        self.names = file_names(len(self.shards))
        self.weight_map = {key: name for name, shard in zip(self.names, self.shards) for key, _, _ in shard}
        self.total_size = sum(_nbytes(e) for e in entries)
        self.largest_shard = max(sum(_nbytes(e) for e in shard) for shard in self.shards)
        self._configs = configs or {}
        self._tmp: dict[str, Path] = {}
        self._shard = -1
        self._left = 0
        self._file: Any = None
        self._writer: SafetensorsWriter | None = None

    def _temporary(self, name: str) -> Path:
        path = self.directory / f"{name}{TMP_MARK}{os.getpid()}"
        self._tmp[name] = path
        return path

    def _next_file(self) -> None:
        self._close_file()
        self._shard += 1
        shard = self.shards[self._shard]
        self._file = open(self._temporary(self.names[self._shard]), "wb")  # noqa: SIM115 - closed in _close_file
        self._writer = SafetensorsWriter(self._file, shard, {"format": "pt", "producer": "zero"})
        self._left = len(shard)

    def _close_file(self) -> None:
        if self._file is not None:
            assert self._writer is not None
            self._writer.close()
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def _advance(self, key: str) -> torch.dtype:
        while self._left == 0:
            if self._shard + 1 >= len(self.shards):
                raise CheckpointError(f"tensor {key!r} is one more than the {len(self.weight_map)} planned")
            self._next_file()
        return self.shards[self._shard][len(self.shards[self._shard]) - self._left][1]

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """The next entry's values (cast to the entry's dtype here, one tensor at a time)."""
        dtype = self._advance(key)
        assert self._writer is not None
        self._writer.write(key, tensor if tensor.dtype == dtype else tensor.to(dtype))
        self._left -= 1

    def write_parts(self, key: str, parts: Iterable[torch.Tensor]) -> None:
        """The next entry's values as consecutive flat pieces, already in the entry's dtype."""
        self._advance(key)
        assert self._writer is not None
        self._writer.write_parts(key, parts)
        self._left -= 1

    def commit(self) -> None:
        while self._shard + 1 < len(self.shards):  # shards of no tensors (an empty model): still one file
            self._next_file()
        self._close_file()
        if len(self.names) > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map}
            _write_small(self._temporary(INDEX), json.dumps(index, indent=2, sort_keys=True).encode() + b"\n")
        for name, value in self._configs.items():
            _write_small(self._temporary(name), json.dumps(value, indent=2, sort_keys=True).encode() + b"\n")
        # the old index first: from here until the new index is in place, no complete checkpoint is claimed
        (self.directory / INDEX).unlink(missing_ok=True)
        for path in self.directory.iterdir():
            if (path.name == SINGLE or _SHARD.match(path.name)) and path.name not in self.names:
                path.unlink(missing_ok=True)
        last = INDEX if INDEX in self._tmp else SINGLE
        for name in [n for n in self._tmp if n != last] + [last]:
            os.replace(self._tmp[name], self.directory / name)
        self._tmp = {}
        fsync_dir(self.directory)

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for path in self._tmp.values():
            path.unlink(missing_ok=True)
        self._tmp = {}


def _write_small(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def remove_stale_temporaries(directory: Path) -> None:
    """Temporary files of an interrupted earlier export into ``directory`` (never anyone else's files)."""
    for path in directory.iterdir():
        if _OWNED.match(path.name):
            path.unlink(missing_ok=True)


def write_directory(directory: str | os.PathLike[str], entries: Sequence[Entry],
                    values: Iterable[tuple[str, torch.Tensor]], *, max_shard_size: int,
                    configs: dict[str, dict[str, Any]] | None = None, single_file: bool = False,
                    on_written: Callable[[str], None] | None = None) -> HFDirectoryWriter:
    """Write ``values`` (``(key, tensor)`` in the order of ``entries``) as a Hugging Face folder, atomically."""
    writer = HFDirectoryWriter(directory, entries, max_shard_size=max_shard_size, configs=configs,
                               single_file=single_file)
    try:
        for key, value in values:
            writer.write(key, value)
            if on_written is not None:
                on_written(key)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return writer
