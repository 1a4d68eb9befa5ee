"""zero's sharded checkpoints and PyTorch's ``torch.distributed.checkpoint`` (DCP), both ways.

[Note: DCP both ways]
*Reading a zero checkpoint with DCP.* :class:`ZeroStorageReader` is a DCP ``StorageReader`` over a
directory written by ``save_checkpoint``: ``dcp.load(state, storage_reader=ZeroStorageReader(path))``
loads it into an FSDP2 model, a plain model (``no_dist=True``) or a zero model, at any world size.
zero's files stay what they are (no second copy, no conversion); the reader presents them as the
state dict ``get_state_dict`` gives, nested the way the DCP tutorials save it::

    {"model": {<key>: tensor}, "optim": {"state": {<name>: {<key>: tensor}}, "param_groups": [{...}]}}

Each tensor is presented as one chunk (its whole global shape): zero's pieces are element ranges of the
flattened parameter, which need not be boxes, so a read asks for a box, the reader fetches the rows
that cover it (from whichever rank files hold them, as ``load_checkpoint`` does) and narrows them.
Scalar states (Adam's ``step``) come from the metadata as 0-d tensors, the hyperparameters and each
group's ``params`` (the parameter names) as DCP's byte items. Every rank file is checked against its
size and sha256 before its first read, as ``load_checkpoint`` does. The ``planner_data`` makes
``_load_state_dict_from_keys`` (and ``dcp.load`` into an empty dict with ``_EmptyStateDictLoadPlanner``)
rebuild that nesting.

*Reading a DCP checkpoint with load_checkpoint.* A directory with DCP's ``.metadata`` and no
``zero_checkpoint.json`` is read by DCP itself: ``load_checkpoint`` takes the model's and optimizers'
state dicts with ``get_state_dict`` (DTensors of this rank's shards), checks every key and shape
against the DCP metadata on every rank, then ``dcp.load`` reads the boxes each rank's shards need
(DCP reshards) and ``set_state_dict`` writes them into the masters and optimizer states. The model's
keys may be at the top level (torchtitan) or under ``model``; the optimizer's under ``optim`` or
``optimizer``, with param groups listed (``get_state_dict``'s default) or keyed by parameter name
(``flatten_optimizer_state_dict=True``, torchtitan). DCP keeps no checksums, random states, loss
scaler or engine step: those stay as they were.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from zero_core.base.errors import CheckpointError
from zero_core.checkpoint._checkpoint import METADATA, _dtype, _Reader, _verify, read_metadata

__all__ = ["DCP_METADATA", "ZeroStorageReader", "is_dcp_checkpoint", "read_dcp"]

DCP_METADATA = ".metadata"
_SHOWN = 5


class _CheckedReader(_Reader):
    """A :class:`_Reader` that checks each rank file's size and sha256 before its first read."""

    def _file(self, rank: int) -> Any:
        if rank not in self._files:
            _verify(self.directory, self.metadata["files"][rank])
        return super()._file(rank)


class ZeroStorageReader(StorageReader):
    """A ``torch.distributed.checkpoint`` storage reader of a zero sharded checkpoint directory.

    ``dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=ZeroStorageReader(path))`` loads the
    directory ``zero_core.save_checkpoint`` wrote into state dicts from ``get_state_dict`` (FSDP2 or zero
    models, any world size) or plain ones (``no_dist=True``). See [Note: DCP both ways].

    Args:
        path: The checkpoint directory (or ``None``, and ``checkpoint_id=`` given to ``dcp.load``).
        model_key: The top-level key the model's state dict is under; ``""`` puts its keys at the top level.
        optimizer_key: The top-level key of the optimizer's state dict; ``None`` leaves the optimizer out.
        verify: Check each rank file's size and sha256 before reading from it.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, model_key: str = "model",
                 optimizer_key: str | None = "optim", verify: bool = True) -> None:
        super().__init__()
        if not isinstance(model_key, str) or (optimizer_key is not None and not optimizer_key):
            raise CheckpointError(f"ZeroStorageReader needs model_key as a string ('' for the top level) and "
                                  f"optimizer_key as a non-empty string or None, got {model_key!r} and {optimizer_key!r}")
        if not isinstance(verify, bool):
            raise CheckpointError(f"ZeroStorageReader(verify=...) must be True or False, got {verify!r}")
        if optimizer_key is not None and optimizer_key == model_key:
            raise CheckpointError(f"ZeroStorageReader's model_key and optimizer_key are both {model_key!r}; give them "
                                  "different names")
        self.path = None if path is None else Path(path)
        self.model_key, self.optimizer_key, self.verify = model_key, optimizer_key, verify
        self._metadata: Metadata | None = None
        self._zero: dict[str, Any] = {}
        self._sources: dict[str, tuple[Any, ...]] = {}

    # -- StorageReader --------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
            self._metadata = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return (Path(checkpoint_id) / METADATA).is_file()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            if self.path is None:
                raise CheckpointError("ZeroStorageReader has no directory: give ZeroStorageReader(path) or "
                                      "dcp.load(..., checkpoint_id=path)")
            self._zero = read_metadata(self.path)
            self._metadata = self._present(self._zero)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.read_metadata()
        assert self.path is not None
        reader = (_CheckedReader if self.verify else _Reader)(self.path, self._zero)
        try:
            for item in plan.items:
                source = self._sources[item.storage_index.fqn]
                if item.type == LoadItemType.BYTE_IO:
                    stream = io.BytesIO()
                    torch.save(source[1], stream)
                    stream.seek(0)
                    planner.load_bytes(item, stream)
                    continue
                value = self._box(reader, source, list(item.storage_offsets), list(item.lengths))
                target = planner.resolve_tensor(item).detach()
                if target.shape != value.shape:
                    raise CheckpointError(f"{item.storage_index.fqn!r}: DCP asked for a {tuple(target.shape)} box, the "
                                          f"checkpoint gave {tuple(value.shape)}")
                target.copy_(value)
                planner.commit_tensor(item, target)
        finally:
            reader.close()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    # -- what the directory holds, as DCP sees it ---------------------------------------------
    def _present(self, zero: dict[str, Any]) -> Metadata:
        """The DCP metadata of zero's metadata ``zero``; fills ``self._sources`` (flat key -> where its values are)."""
        entries: dict[str, Any] = {}
        planner_data: dict[str, tuple[Any, ...]] = {}
        sources: dict[str, tuple[Any, ...]] = {}
        headers = self._headers(zero)

        def tensor(path: tuple[Any, ...], shape: tuple[int, ...], dtype: torch.dtype, source: tuple[Any, ...]) -> None:
            key = ".".join(str(p) for p in path)
            entries[key] = TensorStorageMetadata(
                TensorProperties(dtype=dtype), torch.Size(shape),
                [ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=torch.Size(shape))])
            planner_data[key], sources[key] = path, source

        def value(path: tuple[Any, ...], obj: Any) -> None:
            key = ".".join(str(p) for p in path)
            entries[key] = BytesStorageMetadata()
            planner_data[key], sources[key] = path, ("bytes", obj)

        model = (self.model_key,) if self.model_key else ()
        params = zero["params"]
        for name, info in params.items():
            for key in (name, *zero.get("tied", {}).get(name, [])):
                dtype = headers.get(f"p/{name}", (_dtype(info["dtype"]),))[0]
                tensor((*model, key), tuple(info["shape"]), dtype, ("flat", f"p/{name}", name, dtype))
        for name, info in zero["buffers"].items():
            tensor((*model, name), tuple(info["shape"]), _dtype(info["dtype"]), ("entry", 0, f"b/{name}"))
        optimizer = zero.get("optimizer")
        if optimizer is not None and self.optimizer_key is not None:
            at = (self.optimizer_key, "state")
            for name, keys in optimizer["state_keys"].items():
                for key in keys:
                    found = headers.get(f"o/{name}/{key}")
                    dtype = found[0] if found is not None else _dtype(params[name]["dtype"])
                    tensor((*at, name, key), tuple(params[name]["shape"]), dtype, ("flat", f"o/{name}/{key}", name, dtype))
            for name, held in optimizer.get("whole", {}).items():
                for key in held["keys"]:
                    dtype, shape = headers[f"w/{name}/{key}"]
                    tensor((*at, name, key), shape, dtype, ("entry", held["rank"], f"w/{name}/{key}"))
            for name, scalars in optimizer["scalars"].items():
                for key, saved in scalars.items():
                    if "tensor" in saved:
                        tensor((*at, name, key), (), _dtype(saved["tensor"]), ("scalar", saved["value"]))
                    else:
                        value((*at, name, key), saved["value"])
            for i, group in enumerate(optimizer["param_groups"]):
                for key, hyper in group.items():  # JSON kept Adam's betas as a list; torch's optimizers make a tuple
                    value((self.optimizer_key, "param_groups", i, key), tuple(hyper) if key == "betas" else hyper)
                # the names get_state_dict lists: every parameter of the group under its first name
                value((self.optimizer_key, "param_groups", i, "params"),
                      [name for name, info in params.items() if info.get("group") == i])
        self._sources = sources
        return Metadata(state_dict_metadata=entries, planner_data=planner_data)

    def _headers(self, zero: dict[str, Any]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The dtype and shape of every entry of the rank files (their headers only), and each parameter's pieces
        checked to cover it: a reader must never hand out elements no file holds."""
        assert self.path is not None
        out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        reader = _Reader(self.path, zero)
        try:
            for rank, entry in enumerate(zero["files"]):
                if not (self.path / entry["name"]).is_file():
                    raise CheckpointError(f"shard file {self.path / entry['name']} named by the metadata is missing")
                for key, (dtype, shape, _, _) in reader._file(rank).entries.items():
                    out.setdefault(key, (dtype, shape))
            for name, info in zero["params"].items():
                covered = sum(hi - lo for _, lo, hi, _ in reader.runs(name))
                if covered != math.prod(info["shape"]):
                    raise CheckpointError(f"the metadata at {self.path} covers {covered} of the "
                                          f"{math.prod(info['shape'])} elements of {name!r}: the checkpoint is damaged")
        finally:
            reader.close()
        return out

    @staticmethod
    def _box(reader: _Reader, source: tuple[Any, ...], offsets: list[int], lengths: list[int]) -> torch.Tensor:
        """The box ``offsets``/``lengths`` of the tensor at ``source``."""
        kind = source[0]
        if kind == "scalar":
            return torch.tensor(source[1])
        if kind == "entry":
            whole = reader.tensor(source[1], source[2])
        else:  # "flat": the rows that cover the box, from the saved element ranges, then narrowed
            _, entry, name, dtype = source
            shape = tuple(reader.metadata["params"][name]["shape"])
            if not shape:
                return reader.read(entry, name, 0, 1, dtype).view(())
            row = math.prod(shape[1:])
            first, rows = offsets[0], lengths[0]
            whole = reader.read(entry, name, first * row, (first + rows) * row, dtype).view(rows, *shape[1:])
            offsets = [0, *offsets[1:]]
        for dim, (at, length) in enumerate(zip(offsets, lengths)):
            whole = whole.narrow(dim, at, length)
        return whole


# -- load_checkpoint of a DCP directory -------------------------------------------------------
def is_dcp_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a DCP checkpoint (``.metadata``) and no zero one."""
    path = Path(directory)
    return path.is_dir() and (path / DCP_METADATA).is_file() and not (path / METADATA).is_file()


def _prefix(keys: set[str], candidates: tuple[str, ...], wanted: list[str]) -> str | None:
    """The first candidate prefix under which most of ``wanted`` are among ``keys``."""
    best, found = None, 0
    for prefix in candidates:
        hits = sum(prefix + k in keys for k in wanted)
        if hits > found:
            best, found = prefix, hits
    return best


def _shown(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _check(directory: Path, saved: dict[str, Any], wanted: dict[str, tuple[int, ...] | None], strict: bool) -> None:
    """Every key of ``wanted`` is in the DCP metadata ``saved`` (``strict``), and every tensor of it has its shape."""
    missing = [k for k in wanted if k not in saved]
    if missing and strict:
        raise CheckpointError(f"the DCP checkpoint at {directory} does not match this model: it lacks {_shown(missing)} "
                              "(pass strict=False to load_checkpoint to skip them)")
    wrong = [f"{k}: {tuple(saved[k].size)} saved, {shape} here" for k, shape in wanted.items()
             if shape is not None and isinstance(saved.get(k), TensorStorageMetadata) and tuple(saved[k].size) != shape]
    if wrong:
        raise CheckpointError(f"the DCP checkpoint at {directory} has other shapes than this model: {_shown(wrong)}")


def read_dcp(model: Any, engine: Any, optimizers: tuple[Any, ...] | None, directory: str | os.PathLike[str], *,
             strict: bool = True) -> None:
    """Load a DCP checkpoint (``get_state_dict`` + ``dcp.save``, by FSDP2, torchtitan or zero) into the zero model
    ``model`` and its ``optimizers`` (``None``: the parameters only), at any world size. Collective.

    Every rank first checks keys and shapes against the DCP metadata; any problem raises
    :class:`CheckpointError` on every rank before a value changes. See [Note: DCP both ways].
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from zero_core.comm._agreement import raise_if_any_failed

    comm = engine.comm
    directory = Path(directory)
    what = f"loading the DCP checkpoint at {directory} failed; nothing was changed"
    error = None
    layout: tuple[str, str | None, bool] = ("", None, False)
    saved: dict[str, Any] = {}
    try:
        saved = dict(dcp.FileSystemReader(directory).read_metadata().state_dict_metadata)
        keys = set(saved)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        model_prefix = _prefix(keys, ("model.", ""), list(shapes))
        if model_prefix is None:
            raise CheckpointError(f"the DCP checkpoint at {directory} holds none of this model's keys (for example "
                                  f"{_shown(list(shapes))}; it holds {_shown(sorted(keys))}): save it with "
                                  "dcp.save({'model': model_state_dict, 'optim': optim_state_dict}) or with the model's "
                                  "keys at the top level")
        _check(directory, saved, {model_prefix + k: v for k, v in shapes.items()}, strict)
        optim_prefix, flat_groups = None, False
        if optimizers is not None:
            optim_prefix = next((p for p in ("optim.", "optimizer.", "optimizers.", "")
                                 if any(k.startswith(p + "param_groups.") for k in keys)), None)
            if optim_prefix is None:
                raise CheckpointError(f"the DCP checkpoint at {directory} holds no optimizer state (no "
                                      "'optim.param_groups...' keys); pass optimizer=None to load_checkpoint to load "
                                      "the parameters only")
            flat_groups = not any(k.startswith(f"{optim_prefix}param_groups.0.") for k in keys)
        layout = (model_prefix, optim_prefix, flat_groups)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - a damaged .metadata must fail every rank alike
        error = f"{directory}/{DCP_METADATA} cannot be read ({type(exc).__name__}: {exc})"
    raise_if_any_failed(comm, error, what)

    model_prefix, optim_prefix, flat_groups = layout
    options = StateDictOptions(strict=strict, flatten_optimizer_state_dict=flat_groups)
    # get_state_dict steps an optimizer without states once, at lr 0, to make them (the values stay, bit for bit);
    # the engine's step count is not the checkpoint's to change, DCP has none
    step_count = engine.step_count
    try:
        _load_dcp(model, optimizers, comm, directory, strict, saved, (model_prefix, optim_prefix), options, what)
    finally:
        engine.step_count = step_count


def _load_dcp(model: Any, optimizers: tuple[Any, ...] | None, comm: Any, directory: Path, strict: bool,
              saved: dict[str, Any], prefixes: tuple[str, str | None], options: Any, what: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    from zero_core.comm._agreement import raise_if_any_failed

    model_prefix, optim_prefix = prefixes
    target = optimizers[0] if optimizers is not None and len(optimizers) == 1 else optimizers
    fresh = [o for o in optimizers or () if not o.state]  # get_state_dict makes their states; a refusal drops them
    if target is not None:
        model_sd, optim_sd = get_state_dict(model, target, options=options)
    else:
        model_sd, optim_sd = get_model_state_dict(model, options=options), None
    state: dict[str, Any] = {}

    def place(prefix: str, part: dict[str, Any]) -> None:
        if prefix:
            state[prefix[:-1]] = part
        else:
            state.update(part)

    place(model_prefix, model_sd)
    if optim_sd is not None and optim_prefix is not None:
        place(optim_prefix, optim_sd)
    error = None
    try:  # the optimizer's keys (the model's were checked before get_state_dict made any optimizer states)
        flat, _ = flatten_state_dict(state)
        _check(directory, saved, {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in flat.items()},
               strict)
    except CheckpointError as exc:
        error = str(exc)
    try:
        raise_if_any_failed(comm, error, what)
    except CheckpointError:
        for optimizer in fresh:
            optimizer.state.clear()
        raise

    group = getattr(comm, "group", None)
    planner = dcp.DefaultLoadPlanner(allow_partial_load=not strict)
    try:
        dcp.load(state, checkpoint_id=directory, planner=planner,
                 process_group=group if isinstance(group, dist.ProcessGroup) else None)
    except (Exception, CheckpointException) as exc:  # DCP raises the failing ranks' errors on every rank (a BaseException)
        raise CheckpointError(f"loading the DCP checkpoint at {directory} failed partway ({type(exc).__name__}: "
                              f"{exc}); the model is partly loaded, load it again") from exc
    model_sd = state[model_prefix[:-1]] if model_prefix else {k: state[k] for k in model_sd}
    if target is not None:
        assert optim_sd is not None
        optim_sd = state[optim_prefix[:-1]] if optim_prefix else {k: state[k] for k in optim_sd}
        set_state_dict(model, target, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    else:
        set_model_state_dict(model, model_sd, options=options)
