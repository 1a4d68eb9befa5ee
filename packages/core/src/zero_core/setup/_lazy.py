"""Lazy initialisation: build a model on the meta device, then replay its initialisers shard by shard.

[Note: recorded initialisation]
Under :func:`lazy_init`, factory functions create meta tensors (no memory) and every
operator that touches a meta tensor is recorded, in order, with its arguments: the
``empty`` a parameter starts as, the ``uniform_`` of ``reset_parameters``, the
``normal_`` of the model's own ``_init_weights``, the ``fill_`` of a padding row, the
``copy_`` of a constant. :func:`zero_core.shard` then replays the log on real tensors
with the random generator as it was when the context was entered, so every random
draw happens in the same order as in eager construction and the values are the same,
bit for bit. When the context closes, the generator is advanced past the draws eager
construction would have made (the log's random operators run once on scratch
tensors), so whatever draws next (data, dropout, another lazily built model) sees the
generator where an eager run would.

Replaying does not hold the model: each storage is allocated when the log first
writes it and freed after the last operator that touches it. An operator that
overwrites a whole storage without reading it (``normal_``, ``fill_``, ``zero_``, a
full ``copy_``) starts it afresh, so a weight that ``reset_parameters`` draws and
``_init_weights`` draws again is freed between the two, its first draw still consumed
from the generator. When a parameter's storage reaches its last operator, its final
value is handed to the chunks, which keep only this rank's shard of it. The peak is
this rank's shards plus the few parameters alive at once in the log.

Tensors created with an explicit device (``torch.ones(3, device="cpu")``) are real and
not recorded; their random draws happen at construction, out of the eager order.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from zero_core.base.errors import ZeroSetupError

__all__ = ["LazyRecording", "find_recording", "lazy_init", "release_if_unused"]

_META = torch.device("meta")

# Operators that give every element of their first argument a value that does not depend on its old one.
_OVERWRITES = {
    "uniform_", "normal_", "fill_", "zero_", "random_", "exponential_", "log_normal_", "cauchy_", "geometric_",
    "copy_", "bernoulli_",
}
# Operators that draw from a random generator (names without overload).
_RANDOM = {
    "uniform_", "normal_", "random_", "exponential_", "log_normal_", "cauchy_", "geometric_", "bernoulli_",
    "bernoulli", "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
    "multinomial", "poisson", "native_dropout", "rrelu_with_noise", "rrelu_with_noise_",
}
# Data constructors keep their values: they are made on the CPU and copied into the recorded meta tensor.
_DATA_CONSTRUCTORS = {torch.tensor, torch.as_tensor, torch.asarray}

_RECORDINGS: list[LazyRecording] = []


@dataclass(frozen=True, slots=True)
class _Ref:
    """A meta tensor in the log: which recorded storage, and the view of it."""

    key: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _Device:
    """Stands for the meta device in recorded arguments; the replay device replaces it."""


_DEVICE = _Device()


@dataclass(slots=True)
class _Op:
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outs: tuple[_Ref, ...]
    keys: frozenset[int]  # every storage the operator touches
    fresh: frozenset[int]  # storages whose whole value this operator creates (a new tensor or a full overwrite)
    reads: frozenset[int]


class LazyRecording:
    """The log of one :func:`lazy_init` context: storages, operators and the random state at entry."""

    def __init__(self) -> None:
        self.ops: list[_Op] = []
        self._key_of: dict[int, int] = {}  # storage cdata -> key
        self.storages: list[torch.UntypedStorage] = []  # meta storages, kept alive so their cdata stays unique
        self.rng_state = torch.random.get_rng_state()
        # Most bytes the last replay held at once (storages alive between their first and last operator).
        self.peak_bytes = 0

    def key(self, tensor: torch.Tensor) -> int | None:
        """The recorded storage ``tensor`` views, or ``None`` if it was not made under this recording."""
        return self._key_of.get(tensor.untyped_storage()._cdata)

    def _ref(self, tensor: torch.Tensor) -> _Ref:
        storage = tensor.untyped_storage()
        key = self._key_of.get(storage._cdata)
        if key is None:
            key = self._key_of[storage._cdata] = len(self.storages)
            self.storages.append(storage)
        return _Ref(key, tensor.dtype, tuple(tensor.size()), tuple(tensor.stride()), int(tensor.storage_offset()))

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        known = set(self._key_of)
        in_refs: list[_Ref] = []

        def convert(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                ref = self._ref(value)
                in_refs.append(ref)
                return ref
            if isinstance(value, torch.device) and value.type == "meta":
                return _DEVICE
            return value

        args_, kwargs_ = tree_map(convert, (args, kwargs))
        outs = tuple(self._ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.device.type == "meta")
        reads = {r.key for r in in_refs}
        fresh = {r.key for r in outs if self.storages[r.key]._cdata not in known}
        name = func._schema.name.split("::")[-1]
        if func._schema.is_mutable and name in _OVERWRITES and in_refs and args and isinstance(args[0], torch.Tensor):
            target = in_refs[0]
            whole = args[0].is_contiguous() and args[0].storage_offset() == 0 and \
                args[0].numel() * args[0].element_size() == self.storages[target.key].nbytes()
            others = {r.key for r in in_refs[1:]}
            if whole and target.key not in others:
                fresh.add(target.key)
                reads.discard(target.key)
        self.ops.append(_Op(func, args_, kwargs_, outs, frozenset(reads | {r.key for r in outs}), frozenset(fresh),
                            frozenset(reads)))

    def record_call(self, func: Callable[..., Any], tensor: torch.Tensor, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> None:
        """Record a whole initialiser call that does nothing on meta tensors (see :data:`_SKIP_META`)."""
        ref = self._ref(tensor)
        storage = self.storages[ref.key]
        whole = tensor.is_contiguous() and tensor.storage_offset() == 0 and \
            tensor.numel() * tensor.element_size() == storage.nbytes()
        fresh = frozenset({ref.key}) if whole else frozenset()  # each of them writes every element
        self.ops.append(_Op(func, (ref, *args), dict(kwargs), (ref,), frozenset({ref.key}), fresh,
                            frozenset() if fresh else frozenset({ref.key})))

    # -- replay ---------------------------------------------------------------------------
    def replay(
        self, *, device: torch.device, finals: dict[int, Callable[[torch.UntypedStorage], object]],
        rng_state: torch.Tensor, run_all: bool = True,
    ) -> None:
        """Run the log on ``device``; call ``finals[key](storage)`` when storage ``key`` holds its final value.

        ``run_all=False`` runs only the operators the storages in ``finals`` depend on (their
        values are then the same, but the random generator does not advance as in eager
        construction: for values that are about to be overwritten by a load). The random
        generator is left as it was (see :meth:`advance_generator`).
        """
        ops = self.ops
        needed = self._needed(set(finals)) if not run_all else None
        # Last operator of each epoch of each storage: where it is freed (or handed over, the last time).
        last: dict[tuple[int, int], int] = {}
        epoch_at: list[dict[int, int]] = []
        epoch: dict[int, int] = {}
        for i, op in enumerate(ops):
            if needed is not None and i not in needed:
                epoch_at.append({})
                continue
            here = {}
            for key in op.keys:
                if key in op.fresh and key in epoch:
                    epoch[key] += 1
                here[key] = epoch.setdefault(key, 0)
                last[(key, here[key])] = i
            epoch_at.append(here)
        touched: dict[int, int] = {}
        allocated: set[int] = set()
        for op in ops:
            if not _is_pure_view(op.func):
                for key in op.keys:
                    touched[key] = touched.get(key, 0) + 1
                if isinstance(op.func, torch._ops.OpOverload) and op.func._schema.name.startswith("aten::empty"):
                    allocated.update(op.fresh)
        # only allocated, never written: no initialiser ran on it that lazy_init saw
        never_written = [key for key in finals if key in allocated and touched.get(key, 0) == 1]
        if never_written:
            warnings.warn(
                f"{len(never_written)} lazily built parameter(s) or buffer(s) were allocated but never written while "
                "the model was built, so they hold no meaningful value; an initialiser that returns early for meta "
                "tensors and was imported by name (from torch.nn.init import ...) is not seen by lazy_init: call it "
                "as torch.nn.init.<name>, or load values with shard(..., load_from=...)",
                stacklevel=3,
            )
        ends: dict[int, list[tuple[int, int]]] = {}
        for (key, e), i in last.items():
            ends.setdefault(i, []).append((key, e))
        final_epoch = {key: e for key, e in epoch.items()}

        env: dict[int, torch.UntypedStorage] = {}
        live = [0]

        def keep(key: int, storage: torch.UntypedStorage) -> None:
            env[key] = storage
            live[0] += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, live[0])

        def real(value: Any) -> Any:
            if isinstance(value, _Ref):
                storage = env.get(value.key)
                if storage is None:  # a whole overwrite starts a new epoch: fresh memory, any content
                    storage = torch.empty(self.storages[value.key].nbytes(), dtype=torch.uint8, device=device).untyped_storage()
                    keep(value.key, storage)
                return torch.empty(0, dtype=value.dtype, device=device).set_(storage, value.offset, value.size, value.stride)
            if value is _DEVICE:
                return device
            return value

        # Separate functions, so that no local variable keeps a storage alive past its last operator.
        def run(op: _Op) -> None:
            args, kwargs = tree_map(real, (op.args, op.kwargs))
            outs = [t for t in tree_flatten(op.func(*args, **kwargs))[0] if isinstance(t, torch.Tensor)]
            for ref, tensor in zip(op.outs, outs):
                if ref.key not in env:  # a new tensor (a factory or an out-of-place result)
                    keep(ref.key, tensor.untyped_storage())

        def release(key: int, e: int) -> None:
            storage = env.pop(key, None)
            if storage is None:
                return
            live[0] -= storage.nbytes()
            if e == final_epoch[key] and key in finals:
                finals[key](storage)

        previous = torch.random.get_rng_state()
        torch.random.set_rng_state(rng_state)
        try:
            with torch.no_grad():
                for i, op in enumerate(ops):
                    if needed is not None and i not in needed:
                        continue
                    if not _is_pure_view(op.func):  # views are rebuilt from their refs
                        run(op)
                    for key, e in ends.get(i, ()):
                        release(key, e)
        finally:
            torch.random.set_rng_state(previous)
        untouched = set(finals) - {key for key, _ in last}
        if untouched:
            raise ZeroSetupError(
                f"lazy initialisation has no record of {len(untouched)} parameter or buffer storage(s); "
                "build the model eagerly or entirely inside zero_core.lazy_init()"
            )

    @torch.no_grad()
    def advance_generator(self) -> bool:
        """Draw from the random generator what eager construction would have drawn, into scratch memory.

        Run when the context closes: the values are computed later by :meth:`replay` (from
        the state saved at entry), but the generator must already be where eager construction
        leaves it, so that later draws (data, dropout, the next model built lazily) match eager
        runs. Only random operators run, each on a fresh tensor freed at once. Returns False
        (and warns) if one cannot run this way.
        """
        for op in self.ops:
            name = op.func.__name__ if not isinstance(op.func, torch._ops.OpOverload) else \
                op.func._schema.name.split("::")[-1]
            if name not in _RANDOM and not name.startswith("_no_grad_trunc_normal_") and name not in _SKIP_META:
                continue

            def scratch(value: Any) -> Any:
                if isinstance(value, _Ref):
                    return torch.zeros(value.size, dtype=value.dtype) if value.size else torch.zeros((), dtype=value.dtype)
                return torch.device("cpu") if value is _DEVICE else value

            try:
                args, kwargs = tree_map(scratch, (op.args, op.kwargs))
                op.func(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the values are unaffected; only later draws would differ
                warnings.warn(
                    f"lazy_init could not advance the random generator past {name} ({exc}); the model's values are "
                    "still those of eager construction, but random draws after the model was built differ from an "
                    "eager run", stacklevel=3,
                )
                return False
            del args, kwargs
        return True

    def _needed(self, wanted: set[int]) -> set[int]:
        """Indices of the operators that contribute to the storages in ``wanted`` (walked backwards)."""
        needed_keys = set(wanted)
        keep: set[int] = set()
        for i in range(len(self.ops) - 1, -1, -1):
            op = self.ops[i]
            written = {r.key for r in op.outs}
            if written & needed_keys:
                keep.add(i)
                needed_keys |= op.reads
        return keep


def _is_pure_view(func: Any) -> bool:
    return isinstance(func, torch._ops.OpOverload) and func.is_view and not func._schema.is_mutable


class _Recorder(TorchDispatchMode):
    def __init__(self, recording: LazyRecording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = tree_flatten((args, kwargs, out))[0]
        if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in leaves):
            self.recording.record(func, args, kwargs, out)
        return out


class _Constants(TorchFunctionMode):
    """Makes ``torch.tensor(data)`` a recorded meta tensor that replays with its data."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _DATA_CONSTRUCTORS and kwargs.get("device") in (None, "meta", _META):
            requires_grad = kwargs.pop("requires_grad", False)
            value = func(*args, **{**kwargs, "device": "cpu"})
            if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                return value
            meta = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=_META)
            meta.copy_(value)  # recorded: the replay copies the data in
            return meta.requires_grad_(requires_grad)
        return func(*args, **kwargs)


_INIT_MODULE = torch.nn.init
# torch.nn.init functions that return at once for a meta tensor: recorded as whole calls and replayed as such.
# (trunc_normal_ is reached through its module-level helper.)
_SKIP_META = ("orthogonal_", "sparse_", "dirac_", "_no_grad_trunc_normal_")


@contextlib.contextmanager
def _record_skipping_initialisers(recording: LazyRecording) -> Iterator[None]:
    originals = {name: getattr(_INIT_MODULE, name) for name in _SKIP_META}

    def recorded(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not (isinstance(tensor, torch.Tensor) and tensor.is_meta):
                return original(tensor, *args, **kwargs)
            original(tensor, *args, **kwargs)  # its argument checks still run now
            recording.record_call(original, tensor, args, kwargs)
            return tensor
        return call

    for name, original in originals.items():
        setattr(_INIT_MODULE, name, recorded(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(_INIT_MODULE, name, original)


@contextlib.contextmanager
def lazy_init() -> Iterator[LazyRecording]:
    """Build models inside this context without allocating their parameters.

    Parameters and buffers are meta tensors; :func:`zero_core.shard` materialises each
    rank's shards directly by replaying the modules' own initialisers, so the values
    equal eager construction under the same seed (see [Note: recorded initialisation]),
    or loads them from a state dict (``shard(..., load_from=...)``). Peak memory while
    sharding is this rank's shards (its share of the model, at stage 3) plus the largest
    parameter while it is initialised.

    Example::

        torch.manual_seed(0)
        with zero_core.lazy_init():
            model = GPT(cfg)
        optimizer = torch.optim.AdamW(model.parameters())
        model, optimizer = zero_core.shard(model, optimizer)
    """
    recording = LazyRecording()
    _RECORDINGS.append(recording)
    with torch.device(_META), _Constants(), _Recorder(recording), _record_skipping_initialisers(recording):
        yield recording
    recording.advance_generator()


def find_recording(tensors: list[torch.Tensor]) -> LazyRecording:
    """The recording that made these meta tensors; a clear error for meta tensors made elsewhere."""
    for recording in reversed(_RECORDINGS):
        if all(recording.key(t) is not None for t in tensors):
            return recording
    raise ZeroSetupError(
        "the model has parameters on the meta device that were not built under zero_core.lazy_init() (or were "
        "changed after it, e.g. by model.to(dtype) outside the context); build the model inside "
        "`with zero_core.lazy_init():`, or materialise it before zero_core.shard"
    )


def release_if_unused(recording: LazyRecording) -> None:
    """Drop the recording once no tensor outside it views its storages (every model built under it was sharded).

    Its log holds meta storages and the data of ``torch.tensor(...)`` constants; a model built
    in the same context and not sharded yet still needs it.
    """
    if any(torch._C._storage_Use_Count(s._cdata) > 1 for s in recording.storages):
        return
    recording.ops.clear()
    recording.storages.clear()
    recording._key_of.clear()
    if recording in _RECORDINGS:
        _RECORDINGS.remove(recording)
