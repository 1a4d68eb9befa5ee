"""Options of the tiered placement policies: frozen keyword-only dataclasses, validated at construction.

Pass one as ``ZeroConfig(placement="gemini", placement_options=GeminiConfig(...))``, or the
same fields as a mapping: ``placement_options={"device_budget_mb": 512}``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from zero_core import ConfigError

__all__ = ["GeminiConfig", "StaticConfig", "TierConfig"]

C = TypeVar("C", bound="TierConfig")


def _mb(owner: str, name: str, value: object, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{owner}.{name} must be a positive number of MiB{' or None' if allow_none else ''}, got {value!r}.")


def _fraction(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{owner}.{name} must be a fraction in [0, 1], got {value!r}.")


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    """Budgets of the three memory tiers.

    Attributes:
        device_budget_mb: MiB the policy may fill on the compute device (model data plus
            the non-model data it measured). On CUDA, what was already allocated when the
            warm-up step began (other tensors, the CUDA libraries' workspaces) and what the
            allocator caches without handing out are not part of it. ``None``: on CUDA,
            what the allocator reports free at setup minus ``device_margin``; on a CPU-only
            machine it must be set for ``gemini`` (the CPU is both device and host there,
            accounted apart).
        device_margin: Share of the device's total memory left out of the default budget,
            for fragmentation, other processes and the collectives' transient copies.
        host_budget_mb: MiB of host memory for shards, gradients and optimizer states.
            ``None``: ``host_budget_fraction`` of the machine's RAM.
        host_budget_fraction: Share of RAM used when ``host_budget_mb`` is ``None``.
        disk_dir: Directory for the disk tier (a private sub-directory is made per rank and
            removed at exit); ``None`` disables the tier.
        disk_budget_mb: MiB the disk tier may hold; ``None``: the free space of
            ``disk_dir``'s file system at setup.
    """

    device_budget_mb: float | None = None
    device_margin: float = 0.1
    host_budget_mb: float | None = None
    host_budget_fraction: float = 0.8
    disk_dir: str | None = None
    disk_budget_mb: float | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("device_budget_mb", "host_budget_mb", "disk_budget_mb"):
            _mb(owner, name, getattr(self, name))
        for name in ("device_margin", "host_budget_fraction"):
            _fraction(owner, name, getattr(self, name))
        if self.disk_dir is not None and (not isinstance(self.disk_dir, str) or not self.disk_dir):
            raise ConfigError(f"{owner}.disk_dir must be a directory path or None, got {self.disk_dir!r}.")

    @classmethod
    def from_options(cls: type[C], options: object) -> C:
        """Build from ``ZeroConfig.placement_options``: an instance of this class or a mapping of its fields."""
        if isinstance(options, cls):
            return options
        if isinstance(options, Mapping):
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(options) - names)
            if unknown:
                raise ConfigError(
                    f"unknown placement option(s) {unknown} for {cls.__name__}; valid options: {sorted(names)}."
                )
            return cls(**dict(options))
        raise ConfigError(
            f"placement_options must be a {cls.__name__} or a mapping of its fields, got {type(options).__name__}."
        )


@dataclass(frozen=True, kw_only=True)
class StaticConfig(TierConfig):
    """The ``static`` policy: fixed fractions, as Gemini's static placement exposes them.

    Attributes:
        shard_param_frac: Share of the parameters (by bytes, in plan order) sharded between
            uses at stage 3; the rest stay gathered, like stage 2 (``0.0``: no parameter is
            re-gathered, ``1.0``: plain stage 3).
        offload_optim_frac: Share of the chunks whose optimizer states, gradients and
            master shard step in host memory (spilling to the disk tier past the host budget).
        offload_param_frac: Share of the chunks whose master shard also stays in host memory
            between uses (gathers copy it up). At most ``offload_optim_frac``: a chunk
            whose shard lives on the host steps there, with its optimizer states.
    """

    shard_param_frac: float = 1.0
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("shard_param_frac", "offload_optim_frac", "offload_param_frac"):
            _fraction("StaticConfig", name, getattr(self, name))
        if self.offload_param_frac > self.offload_optim_frac:
            raise ConfigError(
                f"StaticConfig.offload_param_frac ({self.offload_param_frac}) is above offload_optim_frac "
                f"({self.offload_optim_frac}): a chunk whose parameters live on the host steps there, so its "
                "optimizer states must be offloaded too. Raise offload_optim_frac or lower offload_param_frac."
            )


@dataclass(frozen=True, kw_only=True)
class GeminiConfig(TierConfig):
    """The ``gemini`` policy: placement driven by the memory tracer's warm-up step.

    Attributes:
        margin_ratio: Share of the device's margin space (budget minus the warm-up step's
            measured peak) given to optimizer states: the chunks that fit step on the
            device, with their shards and gradients; the others step on the host, and
            past the host budget their states go to disk (Gemini's ``gpu_margin_mem_ratio``).
            Default 1.0: a model that fits the budget trains as without offload after the
            warm-up (no host step, nothing across the link); 0.0 (ColossalAI's default) steps
            every chunk on the host and leaves the room to the cache.
        prefetch: Let the engine all-gather the next group ahead of use when the budget
            has room for one more group at the step's peak (decided once, on every rank alike).
        trace_every_step: Keep the memory tracer on after the warm-up and record the device
            tier's total at every allocation (``policy.audit``). Slow; for tests and debugging.
        watch: Measure every step's non-model peaks at its compute points, as the warm-up did,
            and re-plan when one goes past the trace (see [Note: a step past its trace]).
            ``None``: on with CUDA, where the allocator's figures cost little; off on the CPU,
            where counting storages at every operator slows a step about tenfold.
            ``trace_every_step`` watches too.
        offload_activations: Class names of the model's modules (for example ``("Block",)``)
            whose saved activations wait in pinned host memory between their forward and
            backward (every module of those classes; see [Note: activation offload]);
            ``"auto"``: Gemini chooses among the blocks of the model's ``nn.ModuleList`` s from
            its warm-up trace, only when the step would not fit the device budget otherwise
            (see [Note: gemini's decisions]). ``()``: none (the default: offloading costs link
            time, and a step that fits needs none).
        overlap_step: Step each chunk whose master shard, gradient and optimizer states are on
            the host as soon as its gradient is down, on a worker thread, while the backward goes
            on; ``optimizer.step()`` then waits for them, keeps those whose gradients are unchanged
            and undoes the others from a copy (see [Note: overlapped host steps]). Off by default:
            the copies cost 16 bytes per parameter of host memory for AdamW while the step is open
            (charged to the host budget), and a run that clips or scales gradients between backward
            and step undoes them (the first time turns it off). Not with a loss scaler.
    """

    margin_ratio: float = 1.0
    prefetch: bool = True
    trace_every_step: bool = False
    watch: bool | None = None
    offload_activations: tuple[str, ...] | str = ()
    overlap_step: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _fraction("GeminiConfig", "margin_ratio", self.margin_ratio)
        for name in ("prefetch", "trace_every_step", "overlap_step"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"GeminiConfig.{name} must be True or False, got {getattr(self, name)!r}.")
        if self.watch is not None and not isinstance(self.watch, bool):
            raise ConfigError(f"GeminiConfig.watch must be True, False or None, got {self.watch!r}.")
        names = self.offload_activations
        if names == "auto":
            names = ()  # checked below as an empty tuple; the field keeps "auto"
        elif isinstance(names, list):  # from a mapping of options (JSON, YAML): a list is as good as a tuple
            names = tuple(names)
            object.__setattr__(self, "offload_activations", names)
        if not isinstance(names, tuple) or not all(isinstance(n, str) and n.isidentifier() for n in names):
            raise ConfigError(
                "GeminiConfig.offload_activations must be a tuple of module class names, for example ('Block',), "
                f"or 'auto', got {names!r}."
            )


def mib(value: float | None) -> int | None:
    """MiB to bytes (``None`` stays ``None``)."""
    return None if value is None else int(value * 2**20)
