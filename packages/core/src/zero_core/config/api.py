"""Configuration objects for :func:`zero_core.shard`.

Every configuration is a frozen, keyword-only dataclass validated at construction,
so a bad value fails where it is written, not in the middle of a training step.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from zero_core.base.errors import ConfigError
from zero_core.config._config_io import (
    KeywordsChecked,
    Nested,
    dataclass_from_dict,
    dataclass_to_dict,
    keep_old_keywords,
    read_file,
    write_file,
)

__all__ = ["ChunkPolicy", "LossScale", "Precision", "ZeroConfig"]

STAGES = (1, 2, 3)
OPTIMIZER_UPDATES = ("auto", "elementwise", "whole")

def check_reshard_after_forward(value: object, owner: str = "reshard_after_forward") -> None:
    if isinstance(value, bool):
        return
    if not isinstance(value, int) or value < 2:
        raise ConfigError(
            f"{owner} must be True (reshard after forward), False (keep gathered until backward) or a group size "
            f"above 1 (keep a copy sharded over that many ranks for backward), got {value!r}"
        )


_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}


def _as_dtype(owner: str, field_name: str, value: object, *, allow_none: bool = False) -> torch.dtype | None:
    if value is None and allow_none:
        return None
    if isinstance(value, torch.dtype) and value in _DTYPES.values():
        return value
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    hint = ", or None for the parameters' own dtype" if allow_none else ""
    raise ConfigError(
        f"{owner}.{field_name} must be one of 'fp32', 'bf16', 'fp16' (or torch.float32, torch.bfloat16, "
        f"torch.float16){hint}; got {value!r}."
    )


def _positive_number(owner: str, field_name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{owner}.{field_name} must be a positive finite number, got {value!r}.")
    return float(value)

ParamOrder = Literal["registration", "first_use"]


def _check_name(owner: str, field_name: str, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f"{owner}.{field_name} must be a non-empty plugin name, got {value!r}; "
            f"pass the name a plugin registered, for example {field_name}='chunk'."
        )


def _check_positive_int(owner: str, field_name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        hint = " or None" if allow_none else ""
        raise ConfigError(f"{owner}.{field_name} must be a positive int{hint}, got {value!r}.")


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkPolicy(KeywordsChecked):
    """How parameters are packed into chunks (used by chunk-based strategies).

    Attributes:
        chunk_size: Elements per chunk. ``None`` searches for the size that wastes
            the least space (see :doc:`concepts`).
        min_chunk_size: Smallest chunk the search may choose, in elements. When the
            whole model is smaller, it becomes one chunk.
        search_interval: Step of the search in elements; pass the model's hidden size
            so chunk boundaries fall on whole rows.
        search_range: How far above the smallest candidate the search looks, in elements.
        param_order: ``"first_use"`` packs parameters in the order the first forward
            touches them (needs ``example_inputs`` in :func:`zero_core.shard`); otherwise
            ``"registration"`` order is used.
    """

    chunk_size: int | None = None
    min_chunk_size: int = 1 << 20
    search_interval: int = 1024
    search_range: int = 1 << 22
    param_order: ParamOrder = "registration"

    def __post_init__(self) -> None:
        _check_positive_int("ChunkPolicy", "chunk_size", self.chunk_size, allow_none=True)
        _check_positive_int("ChunkPolicy", "min_chunk_size", self.min_chunk_size)
        _check_positive_int("ChunkPolicy", "search_interval", self.search_interval)
        _check_positive_int("ChunkPolicy", "search_range", self.search_range)
        if self.param_order not in ("registration", "first_use"):
            raise ConfigError(
                f"ChunkPolicy.param_order must be 'registration' or 'first_use', got {self.param_order!r}."
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScale(KeywordsChecked):
    """How the loss is scaled for fp16 training (see :meth:`zero_core.ZeroModule.backward`).

    Dynamic scaling multiplies the loss by ``scale`` before backward and divides the
    gradients by it after the reduction. A step whose gradients hold an inf or NaN on any
    rank is skipped on every rank (no parameter or optimizer state changes) and counts
    as an overflow; the ``hysteresis``-th overflow backs the scale off by ``backoff_factor``, and
    so does every further one until the hysteresis is refilled; after ``growth_interval`` clean
    steps the scale grows by ``growth_factor`` (DeepSpeed's dynamic loss scaler, rule for rule).

    Attributes:
        init_scale: The first step's scale.
        growth_factor: Multiplier after ``growth_interval`` steps without overflow (> 1).
        backoff_factor: Multiplier on overflow (between 0 and 1).
        growth_interval: Clean steps before the scale grows.
        hysteresis: Overflows tolerated before backing off (1 backs off on every overflow);
            every skipped step still counts.
        consecutive_hysteresis: ``True`` refills the hysteresis after every clean step (the
            tolerated overflows must come in a row); ``False`` only when the scale grows
            (DeepSpeed's default, which :func:`~zero_core.config_from_deepspeed` keeps).
        min_scale: The scale never drops below this.
        dynamic: ``False`` keeps ``init_scale`` fixed (overflowing steps are still skipped).
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 2
    consecutive_hysteresis: bool = True
    min_scale: float = 1.0
    dynamic: bool = True

    def __post_init__(self) -> None:
        for name in ("init_scale", "min_scale", "growth_factor", "backoff_factor"):
            object.__setattr__(self, name, _positive_number("LossScale", name, getattr(self, name)))
        if not self.growth_factor > 1.0:
            raise ConfigError(f"LossScale.growth_factor must be above 1, got {self.growth_factor!r}.")
        if not self.backoff_factor < 1.0:
            raise ConfigError(f"LossScale.backoff_factor must be below 1, got {self.backoff_factor!r}.")
        _check_positive_int("LossScale", "growth_interval", self.growth_interval)
        _check_positive_int("LossScale", "hysteresis", self.hysteresis)
        for flag in ("dynamic", "consecutive_hysteresis"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"LossScale.{flag} must be True or False, got {getattr(self, flag)!r}.")
        if self.min_scale > self.init_scale:
            raise ConfigError(f"LossScale.min_scale {self.min_scale} is above init_scale {self.init_scale}.")


@dataclass(frozen=True, kw_only=True, slots=True)
class Precision(KeywordsChecked):
    """Which dtypes a step computes and reduces in.

    The optimizer always updates master shards in the parameters' own dtype (fp32 for
    an fp32 model); only the gathered compute copy and the reduction use these dtypes.
    Dtypes are given as ``"fp32"``, ``"bf16"``, ``"fp16"`` or as ``torch`` dtypes.

    Attributes:
        compute: Dtype of the parameters, floating buffers and floating inputs during
            forward and backward; ``None`` computes in the parameters' own dtype.
        reduce: Dtype in which gradients are summed over ranks (fp32 by default: the
            sum of N half-precision gradients loses bits; ``"bf16"`` halves the traffic).
        loss_scale: Required for fp16 compute, whose gradients underflow without it;
            then call ``model.backward(loss)`` instead of ``loss.backward()``.
        gradient_predivide_factor: Gradients are divided by this before the reduction and
            by ``world_size / factor`` after it, so a 16-bit sum over many ranks stays in
            range. The result is the same mean; a power of two changes no bit.
    """

    compute: torch.dtype | str | None = None
    reduce: torch.dtype | str = torch.float32
    loss_scale: LossScale | None = None
    gradient_predivide_factor: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "compute", _as_dtype("Precision", "compute", self.compute, allow_none=True))
        object.__setattr__(self, "reduce", _as_dtype("Precision", "reduce", self.reduce))
        object.__setattr__(self, "gradient_predivide_factor",
                           _positive_number("Precision", "gradient_predivide_factor", self.gradient_predivide_factor))
        if self.loss_scale is not None and not isinstance(self.loss_scale, LossScale):
            raise ConfigError(
                f"Precision.loss_scale must be a LossScale or None, got {type(self.loss_scale).__name__}; "
                "write Precision(compute='fp16', loss_scale=LossScale())."
            )
        if self.compute is torch.float16 and self.loss_scale is None:
            raise ConfigError(
                "fp16 compute needs loss scaling, or small gradients underflow to zero: write "
                "Precision(compute='fp16', loss_scale=LossScale()) and call model.backward(loss); "
                "or use compute='bf16', which needs no scaling."
            )


@keep_old_keywords(comm="comm_backend")
@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig(KeywordsChecked):
    """What :func:`zero_core.shard` builds.

    Attributes:
        stage: What is sharded over the ranks. 1: optimizer states (parameters and
            gradients replicated; each rank updates its shard, then the updated
            parameters are all-gathered). 2: gradients too (reduce-scattered, and only
            this rank's shard is kept). 3 (default): parameters too (gathered just in time
            for forward and backward, freed after). Same communication volume as DDP for
            stages 1 and 2, 1.5x for stage 3.
        precision: Compute and reduction dtypes and loss scaling, see :class:`Precision`.
        strategy: Name of the shard strategy plugin (``"chunk"`` from zero-strategy-chunk).
        comm_backend: Name of the comm backend plugin: ``"torch"`` (zero-comm) runs each collective
            when asked; ``"bucketed"`` (zero-comm) packs small gradient reduce-scatters into
            buckets of ``reduce_bucket_mb``; ``"quantized"`` (zero-comm-quantized) sends parameter all-gathers
            and gradient reduce-scatters as int8 with per-block scales. ``None`` takes the strategy's choice
            (:attr:`zero_core.plugin.ShardStrategy.comm`). Its old name ``comm=`` (keyword,
            config file key and attribute) still works, with a ``DeprecationWarning``.
        reduce_bucket_mb: Size of one reduce-scatter bucket in MiB, for backends that
            bucket (split evenly over the ranks; never more than one backward reduces, for a
            small model); ``<= 0`` reduces every gradient at once.
        placement: Name of the placement policy plugin: ``"device"`` (zero-core) keeps every
            shard on the compute device, ``"host"`` (zero-core) keeps master shards, gradients
            and optimizer states in host memory; ``"static"`` and ``"gemini"`` (zero-offload)
            move them between device, host and disk tiers.
        placement_options: Options of the placement policy, as a mapping of keyword
            arguments or the policy's own config object (for example
            ``zero_offload.GeminiConfig(device_budget_mb=...)``); the policy validates them.
        chunk: Chunk packing policy, see :class:`ChunkPolicy`.
        device: Compute device; ``None`` picks ``cuda`` when available, else ``cpu``.
        collective_timeout_s: Seconds any single collective may wait before it fails
            with an error that names it. Keep it well above a step's duration.
        sync_module_states: Copy rank 0's parameters and buffers to every rank at setup,
            as DDP does, so ranks that initialised differently still train one model.
        check_ranks_agree: Compare the model's structure across ranks at setup and fail
            with the first difference instead of hanging or training garbage.
        reshard_after_forward: At stage 3, what a forward that builds a graph leaves for
            the backward (FSDP2's argument): ``True`` frees the full parameters (the backward
            gathers them again), ``False`` keeps them until the backward has used them (one
            gather per step, more memory), an int ``k`` keeps a copy sharded over groups of
            ``k`` ranks, so the backward's gathers stay inside those groups (ZeRO++'s hpZ;
            ``k`` divides the shard group size). Strategies apply it to the chunks they plan.
        shard_optimizer_across_replicas: On a mesh with replicas (HSDP, ``(R, S)``) at stage 3,
            shard master values, gradients and optimizer states over all ``N = R * S`` ranks
            instead of over the shard group alone (Megatron-FSDP's ``optim`` outer sharding):
            parameters stay gathered inside the shard group as before, each rank keeps its shard
            group's slice of the parameters (``1/S``), while the reduced gradient, the master
            values and the optimizer states are ``1/N`` each. Per step the replicas
            reduce-scatter the shard group's gradient instead of all-reducing it, and
            all-gather the updated slices after the step: the same inter-replica bytes as
            the all-reduce. fp32 Adam then holds ``4 psi / S + 12 psi / N`` bytes per rank
            instead of ``16 psi / S``. Stage 3 with the ``"device"`` placement only; a mesh
            without replicas is unaffected. See :doc:`hsdp-optimizer`.
        static_graph: Promise that every rank runs the same modules in the same order
            in every forward and backward (no data-dependent branches, every module's
            output reaches the loss on every rank). Skips the scalar agreement round
            before each all-gather; a broken promise hangs or corrupts, so leave it off
            unless the agreement rounds show up in a profile. Without the promise, a pass whose
            sequence of all-gathers repeated is replayed with one round instead of one per
            all-gather (see :doc:`concepts`), falling back to agreeing when the model branches.
        optimizer_updates: What the optimizer's update of a parameter reads, which decides how it is
            stepped. ``"elementwise"``: an element's update reads only that element's gradient and
            state (SGD, Adam, Lion, an 8-bit Adam, ...), so each rank steps its own pieces.
            ``"whole"``: the update reads the whole tensor (Muon's orthogonalisation, Adafactor's
            factored moments, LAMB's trust ratio, Shampoo), so each parameter is stepped whole on one
            owner rank, which holds its optimizer state, and the new values are scattered back
            (three all-to-alls of the shard per step). ``"auto"`` (default) picks ``"elementwise"``
            for torch's element-wise optimizers (SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, ASGD,
            NAdam, RAdam, RMSprop, Rprop and their subclasses) and ``"whole"`` for classes named
            Muon, Adafactor, LAMB, LARS, Shampoo or SOAP, and refuses any other optimizer at
            ``shard()`` until declared; LBFGS, which reads every parameter at once, is refused. See
            :doc:`concepts`.
        release_host_memory: Let host buffers the engine frees go back to the system: on glibc,
            ``shard()`` fixes malloc's mmap threshold at 4 MiB (process-wide), so buffers of a
            chunk's size are mapped on their own instead of fragmenting malloc's heap. ``False``
            leaves malloc as it is.
    """

    stage: int = 3
    precision: Precision = field(default_factory=Precision)
    strategy: str = "chunk"
    comm_backend: str | None = None
    reduce_bucket_mb: float = 25.0
    placement: str = "device"
    placement_options: Any = field(default_factory=dict)
    chunk: ChunkPolicy = field(default_factory=ChunkPolicy)
    device: str | None = None
    collective_timeout_s: float = 300.0
    sync_module_states: bool = True
    check_ranks_agree: bool = True
    static_graph: bool = False
    reshard_after_forward: bool | int = True
    shard_optimizer_across_replicas: bool = False
    optimizer_updates: str = "auto"
    release_host_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.stage, int) or isinstance(self.stage, bool) or self.stage not in STAGES:
            raise ConfigError(
                f"ZeroConfig.stage must be 1, 2 or 3, got {self.stage!r}: 1 shards optimizer states, "
                "2 also gradients, 3 also parameters."
            )
        if not isinstance(self.precision, Precision):
            raise ConfigError(
                f"ZeroConfig.precision must be a Precision, got {type(self.precision).__name__}; "
                "write ZeroConfig(precision=Precision(compute='bf16'))."
            )
        for name in ("strategy", "placement"):
            _check_name("ZeroConfig", name, getattr(self, name))
        if self.comm_backend is not None:
            _check_name("ZeroConfig", "comm_backend", self.comm_backend)
        options = self.placement_options
        if not (isinstance(options, Mapping) or dataclasses.is_dataclass(options)) or isinstance(options, type):
            raise ConfigError(
                f"ZeroConfig.placement_options must be a mapping of keyword arguments or the policy's config object, "
                f"got {type(options).__name__}; write placement_options={{'device_budget_mb': 512}}."
            )
        bucket = self.reduce_bucket_mb
        if isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or not math.isfinite(bucket):
            raise ConfigError(
                f"ZeroConfig.reduce_bucket_mb must be a finite number of MiB (<= 0 disables bucketing), got {bucket!r}."
            )
        if not isinstance(self.chunk, ChunkPolicy):
            raise ConfigError(
                f"ZeroConfig.chunk must be a ChunkPolicy, got {type(self.chunk).__name__}; "
                "write ZeroConfig(chunk=ChunkPolicy(chunk_size=...))."
            )
        if self.device is not None and (not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda")):
            raise ConfigError(f"ZeroConfig.device must be None, 'cpu', 'cuda' or 'cuda:N', got {self.device!r}.")
        timeout = self.collective_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"ZeroConfig.collective_timeout_s must be a positive number of seconds, got {timeout!r}.")
        check_reshard_after_forward(self.reshard_after_forward, "ZeroConfig.reshard_after_forward")
        if self.optimizer_updates not in OPTIMIZER_UPDATES:
            raise ConfigError(
                f"ZeroConfig.optimizer_updates must be one of {list(OPTIMIZER_UPDATES)}, got {self.optimizer_updates!r}: "
                "'auto' classifies torch's optimizers, 'elementwise' or 'whole' declares what another one reads."
            )
        for name in ("sync_module_states", "check_ranks_agree", "static_graph", "release_host_memory",
                     "shard_optimizer_across_replicas"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ZeroConfig.{name} must be True or False, got {getattr(self, name)!r}.")
        if self.shard_optimizer_across_replicas and (self.stage != 3 or self.placement != "device"):
            raise ConfigError(
                "ZeroConfig.shard_optimizer_across_replicas needs stage=3 and placement='device', got "
                f"stage={self.stage}, placement={self.placement!r}: at stages 1 and 2 every rank keeps whole "
                "parameters, so sharding over every rank is a 1-D mesh (no mesh, or mesh=init_device_mesh(device, "
                "(world_size,))); an offloading placement keeps or moves shards off the device. Switch the option off, "
                "or use stage=3 with placement='device'.")

    def replace(self, **changes: Any) -> ZeroConfig:
        """Return a copy with ``changes`` applied (validated like a new config)."""
        return dataclasses.replace(self, **changes)

    @property
    def comm(self) -> str | None:
        """Deprecated: the old name of :attr:`comm_backend` (``comm`` elsewhere is a backend object, not a name)."""
        warnings.warn("ZeroConfig.comm is deprecated: it was renamed comm_backend; read config.comm_backend instead. "
                      "The old name will be removed in a later release.", DeprecationWarning, stacklevel=2)
        return self.comm_backend

    def to_dict(self) -> dict[str, Any]:
        """This config as plain data (nested dicts of str, int, float and bool), for JSON, TOML or YAML.

        ``precision``, ``precision.loss_scale`` and ``chunk`` become nested dicts and dtypes
        the strings ``"fp32"``, ``"bf16"``, ``"fp16"``. Fields whose value is ``None`` are left
        out (TOML has no null; each of them defaults to ``None``), every other field is
        written, defaults included. A policy config object in ``placement_options`` becomes
        the dict of its fields that differ from their defaults. ``ZeroConfig.from_dict(c.to_dict())
        == c`` holds, except that such an object reads back as that dict, which the policy
        accepts as the same options.

        Raises:
            ConfigError: ``placement_options`` holds a value a config file cannot (not a
                string, number, boolean, list or dict); the message names its key.
        """
        return dataclass_to_dict(self, _NESTED)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ZeroConfig:
        """Build a config from nested mappings, as :meth:`to_dict` writes them.

        Missing keys take their defaults. Values are checked as by the constructor.

        Raises:
            ConfigError: An unknown key (the message suggests the closest valid one and lists
                the valid keys at its level), a section that is not a mapping, or a value the
                dataclasses refuse; each message starts with the key's full path, such as
                ``precision.compute``.
        """
        return dataclass_from_dict(cls, data, _NESTED)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ZeroConfig:
        """Read a config file: JSON (``.json``), TOML (``.toml``) or YAML (``.yaml``/``.yml``, needs PyYAML).

        The file holds what :meth:`to_dict` returns; the "Config files" page of the
        documentation has examples.

        Raises:
            ConfigError: The suffix is not one of those, the file does not parse, PyYAML is
                missing for a YAML file, or a key or value is invalid (as in :meth:`from_dict`);
                the message starts with the file's path.
        """
        return read_file(path, cls.from_dict)

    def to_file(self, path: str | os.PathLike[str]) -> None:
        """Write this config to ``path`` as JSON, TOML or YAML, chosen by the suffix as in :meth:`from_file`.

        Raises:
            ConfigError: As :meth:`to_dict`; also for an unknown suffix, a ``None`` inside
                ``placement_options`` in a TOML file (TOML has no null), or YAML without PyYAML.
        """
        write_file(self.to_dict(), path)


# The fields that hold another config dataclass, per class: nested tables in a config file.
_NESTED: Nested = {ZeroConfig: {"precision": Precision, "chunk": ChunkPolicy}, Precision: {"loss_scale": LossScale}}
