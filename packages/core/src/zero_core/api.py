"""Configuration objects for :func:`zero_core.shard`.

Every configuration is a frozen, keyword-only dataclass validated at construction,
so a bad value fails where it is written, not in the middle of a training step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from zero_core.errors import ConfigError

__all__ = ["ChunkPolicy", "ZeroConfig"]

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
class ChunkPolicy:
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
class ZeroConfig:
    """What :func:`zero_core.shard` builds.

    Attributes:
        strategy: Name of the shard strategy plugin (``"chunk"`` from zero-strategy-chunk).
        comm: Name of the comm backend plugin (``"torch"`` from zero-comm).
        placement: Name of the placement policy plugin (``"device"``, built into zero-core,
            keeps every shard on the compute device).
        chunk: Chunk packing policy, see :class:`ChunkPolicy`.
        device: Compute device; ``None`` picks ``cuda`` when available, else ``cpu``.
        collective_timeout_s: Seconds any single collective may wait before it fails
            with an error that names it. Keep it well above a step's duration.
        sync_module_states: Copy rank 0's parameters and buffers to every rank at setup,
            as DDP does, so ranks that initialised differently still train one model.
        check_ranks_agree: Compare the model's structure across ranks at setup and fail
            with the first difference instead of hanging or training garbage.
        static_graph: Promise that every rank runs the same modules in the same order
            in every forward and backward (no data-dependent branches, every module's
            output reaches the loss on every rank). Skips the scalar agreement round
            before each all-gather; a broken promise hangs or corrupts, so leave it off
            unless the agreement rounds show up in a profile.
    """

    strategy: str = "chunk"
    comm: str = "torch"
    placement: str = "device"
    chunk: ChunkPolicy = field(default_factory=ChunkPolicy)
    device: str | None = None
    collective_timeout_s: float = 300.0
    sync_module_states: bool = True
    check_ranks_agree: bool = True
    static_graph: bool = False

    def __post_init__(self) -> None:
        for name in ("strategy", "comm", "placement"):
            _check_name("ZeroConfig", name, getattr(self, name))
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
        for name in ("sync_module_states", "check_ranks_agree", "static_graph"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ZeroConfig.{name} must be True or False, got {getattr(self, name)!r}.")

    def replace(self, **changes: object) -> ZeroConfig:
        """Return a copy with ``changes`` applied (validated like a new config)."""
        return dataclasses.replace(self, **changes)
