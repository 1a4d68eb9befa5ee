"""Tensor-wise ZeRO-3: every parameter is its own evenly sharded, padded flat buffer.

[Note: tensor-wise layout]
Each parameter is flattened, padded to a multiple of the world size and split evenly,
so rank ``r`` owns elements ``[r * s, (r + 1) * s)`` of every parameter (``s`` is the
padded size over the world size). That is ColossalAI's ``TensorShardStrategy`` layout:
a parameter's gradient is reduce-scattered on its own, and the bucketed comm backend
packs the many small ones into few collectives. Gathering one collective per tensor
would be slow for modules with several small parameters, so the parameters a module
registers itself form one gather group (``BucketTensorShardStrategy``): one all-gather
per module, cut apart into the parameters afterwards. Compared with chunks, every
parameter pays its own padding (at most ``world_size - 1`` elements) and a gather pays
one extra copy; in exchange no parameter shares a buffer with another module's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from zero_core import ZeroConfig
from zero_core.plugin import (
    ChunkPlan,
    ChunkSpec,
    MeshSpec,
    ParamInfo,
    ShardPlan,
    ShardStrategy,
    Topology,
    reshard_for_mesh,
    round_up,
)

if TYPE_CHECKING:
    import pluggy

__all__ = ["TensorStrategy", "module_groups"]


def _owner(info: ParamInfo) -> str:
    """The qualified name of the module that registers the parameter (its first name)."""
    return info.name.rpartition(".")[0]


def module_groups(params: Sequence[ParamInfo]) -> tuple[tuple[int, ...], ...]:
    """Runs of consecutive parameters registered by the same module, with one dtype per run."""
    groups: list[list[int]] = []
    previous: tuple[str, object] | None = None
    for index, info in enumerate(params):
        key = (_owner(info), info.param.dtype)
        if key != previous:
            groups.append([])
            previous = key
        groups[-1].append(index)
    return tuple(tuple(g) for g in groups)


class TensorStrategy(ShardStrategy):
    """One chunk per parameter, one gather group per module. See [Note: tensor-wise layout].

    Selects the ``bucketed`` comm backend unless the config names one, so per-parameter
    reduce-scatters are packed into ``ZeroConfig.reduce_bucket_mb`` buckets.
    """

    name = "tensor"
    comm = "bucketed"

    def plan(
        self,
        params: Sequence[ParamInfo],
        *,
        world_size: int,
        config: ZeroConfig,
        hook: pluggy.HookRelay | None = None,
        topology: Topology | None = None,
    ) -> ShardPlan:
        topology = topology or Topology(MeshSpec.of_shape((world_size,)))
        meshes = [topology.mesh_for(info.name) for info in params]  # a module's parameters share its mesh
        specs = tuple(ChunkSpec((info,), round_up(info.numel, mesh.shard_ranks)) for info, mesh in zip(params, meshes))
        plans = {}
        for mesh in meshes:
            if mesh not in plans:
                plans[mesh] = ChunkPlan(mesh=mesh, reshard_after_forward=reshard_for_mesh(config.reshard_after_forward, mesh))
        return ShardPlan(specs, gather_groups=module_groups(params), chunk_plans=tuple(plans[m] for m in meshes))
