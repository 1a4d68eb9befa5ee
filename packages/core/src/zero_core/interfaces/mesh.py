"""The meshes a shard plan places chunks on.

[Note: meshes]
A *mesh* lays the data-parallel ranks out as ``(replicate, shard)``: a chunk on it is
sharded over the ranks of one row (its *shard group*) and replicated over the rows (its
*replicate group*). A 1-D mesh ``(S,)`` is plain sharding; ``(R, S)`` is hybrid sharding
(HSDP): gathers stay inside a row (inside a node, when a row is a node), gradients are
reduce-scattered inside the row, then the shard-sized results are all-reduced across the
rows. ``(1, W)`` is full sharding; ``(W, 1)`` is plain data parallelism. Every mesh spans
every data-parallel rank: each rank computes every module, so each rank must hold a
shard of every chunk.

A :class:`MeshSpec` is the mesh's shape and rank layout, nothing more: the estimator plans
with specs that have no process groups, and a strategy may derive new layouts (for
example :meth:`MeshSpec.hybrid`) that core then builds groups for. Which module's
parameters go on which mesh is the user's :class:`Topology`; which chunk goes where is the
strategy's plan (:class:`zero_core.plugin.ChunkPlan`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zero_core.base.errors import ConfigError

__all__ = ["MeshSpec", "Topology"]


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """A layout of the data-parallel ranks as ``(shard,)`` or ``(replicate, shard)``.

    Attributes:
        shape: ``(S,)`` or ``(R, S)``.
        ranks: The global ranks in row-major order (``R * S`` of them).
        device_mesh: The user's ``DeviceMesh`` this spec was made from, if any (then the
            sharded parameters' DTensors live on it).
    """

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    device_mesh: Any = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if len(shape) not in (1, 2) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape):
            raise ConfigError(f"a mesh must have shape (shard,) or (replicate, shard) of positive ints, got {self.shape!r}")
        if len(self.ranks) != math.prod(shape) or len(set(self.ranks)) != len(self.ranks):
            raise ConfigError(f"a mesh of shape {shape} needs {math.prod(shape)} distinct ranks, got {list(self.ranks)}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))

    @classmethod
    def of_shape(cls, shape: Sequence[int] | int) -> MeshSpec:
        """Ranks ``0 .. N-1`` in row-major order (what the estimator plans with)."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return cls(shape, tuple(range(math.prod(shape))))

    @classmethod
    def of_device_mesh(cls, mesh: Any) -> MeshSpec:
        """The spec of a ``torch.distributed.device_mesh.DeviceMesh`` (1-D, or 2-D as (replicate, shard))."""
        if mesh.ndim not in (1, 2):
            raise ConfigError(
                f"zero shards over a 1-D mesh (shard) or a 2-D mesh (replicate, shard); got a {mesh.ndim}-D mesh "
                f"{tuple(mesh.shape)}. Slice it first, e.g. mesh['dp_replicate', 'dp_shard']"
            )
        return cls(tuple(int(n) for n in mesh.shape), tuple(int(r) for r in mesh.mesh.flatten().tolist()), mesh)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Ranks in the mesh."""
        return len(self.ranks)

    @property
    def shard_ranks(self) -> int:
        """Ranks one chunk is sharded over (``S``). A count of ranks: ``Chunk.shard_size`` counts elements."""
        return self.shape[-1]

    @property
    def replicate_ranks(self) -> int:
        """Copies of each shard (``R``; 1 for a 1-D mesh)."""
        return self.shape[0] if self.ndim == 2 else 1

    @property
    def shard_size(self) -> int:
        """Deprecated name of :attr:`shard_ranks` (a chunk's ``shard_size`` counts elements, this counts ranks)."""
        warnings.warn("MeshSpec.shard_size is deprecated: use MeshSpec.shard_ranks (a count of ranks)", DeprecationWarning,
                      stacklevel=2)
        return self.shard_ranks

    @property
    def replicate_size(self) -> int:
        """Deprecated name of :attr:`replicate_ranks`."""
        warnings.warn("MeshSpec.replicate_size is deprecated: use MeshSpec.replicate_ranks", DeprecationWarning,
                      stacklevel=2)
        return self.replicate_ranks

    def coordinates(self, rank: int) -> tuple[int, int]:
        """``(replicate index, shard index)`` of global ``rank``."""
        try:
            at = self.ranks.index(rank)
        except ValueError:
            raise ConfigError(f"rank {rank} is not in the mesh {self}; every mesh must span every data-parallel rank") from None
        return divmod(at, self.shard_ranks)

    def shard_groups(self) -> list[list[int]]:
        """The rows: each one chunk's shard group."""
        s = self.shard_ranks
        return [list(self.ranks[i : i + s]) for i in range(0, self.size, s)]

    def replicate_groups(self) -> list[list[int]]:
        """The columns: the ranks that hold the same shard."""
        s = self.shard_ranks
        return [list(self.ranks[j :: s]) for j in range(s)]

    def subgroups(self, size: int) -> list[list[int]]:
        """Each shard group cut into consecutive groups of ``size`` ranks (``reshard_after_forward=size``)."""
        if self.shard_ranks % size:
            raise ConfigError(f"a shard group of {self.shard_ranks} ranks cannot be cut into groups of {size}")
        return [row[i : i + size] for row in self.shard_groups() for i in range(0, len(row), size)]

    def hybrid(self, shard_ranks: int) -> MeshSpec:
        """The same ranks as ``(size / shard_ranks, shard_ranks)``: shard within consecutive groups, replicate across."""
        if isinstance(shard_ranks, bool) or not isinstance(shard_ranks, int) or shard_ranks < 1 or self.size % shard_ranks:
            raise ConfigError(f"cannot shard {self.size} ranks in groups of {shard_ranks!r}: it must divide {self.size}")
        return MeshSpec((self.size // shard_ranks, shard_ranks), self.ranks)

    def __str__(self) -> str:
        dims = "x".join(map(str, self.shape))
        return f"mesh {dims}" + ("" if list(self.ranks) == list(range(self.size)) else f" over ranks {list(self.ranks)}")


@dataclass(frozen=True, slots=True)
class Topology:
    """The meshes the user gave: one for the model, and optionally one per module.

    Attributes:
        default: The model's mesh.
        modules: ``(module name, mesh)`` pairs: parameters registered under the module
            (its own and its submodules') go on that mesh; the longest matching name wins.
    """

    default: MeshSpec
    modules: tuple[tuple[str, MeshSpec], ...] = ()

    def __post_init__(self) -> None:
        for name, spec in self.modules:
            if sorted(spec.ranks) != sorted(self.default.ranks):
                raise ConfigError(
                    f"the mesh of module {name!r} spans ranks {sorted(spec.ranks)} but the model's spans "
                    f"{sorted(self.default.ranks)}; every rank computes every module, so each mesh must span "
                    "every data-parallel rank (lay them out differently, e.g. as (replicate, shard))"
                )

    @classmethod
    def of(cls, default: MeshSpec, modules: Mapping[str, MeshSpec] | None = None) -> Topology:
        return cls(default, tuple(sorted((modules or {}).items())))

    @property
    def world_size(self) -> int:
        return self.default.size

    @property
    def meshes(self) -> tuple[MeshSpec, ...]:
        """Every distinct mesh, the default first."""
        out = [self.default]
        for _, spec in self.modules:
            if spec not in out:
                out.append(spec)
        return tuple(out)

    def mesh_for(self, param_name: str) -> MeshSpec:
        """The mesh of the module that registers ``param_name`` (longest module-name prefix), else the default."""
        best, best_len = self.default, -1
        for name, spec in self.modules:
            if (name == "" or param_name.startswith(name + ".")) and len(name) > best_len:
                best, best_len = spec, len(name)
        return best
