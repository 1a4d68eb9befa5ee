"""[Note: who moves a chunk]: the engine moves chunks between states, placement policies between tiers."""

from __future__ import annotations

import pytest
import torch

from zero_core.chunks._ownership import in_policy_call
from zero_core.interfaces.placement import DevicePlacementPolicy
from zero_core.plugin import Chunk, ChunkSpec, MemoryTier, OwnershipError, ParamInfo


class _Rogue(DevicePlacementPolicy):
    """Releases a chunk from inside a hook, which only the engine may do."""

    name = "rogue"

    def before_gather(self, chunks):
        assert in_policy_call()
        for chunk in chunks:
            chunk.release()


def _owned_chunk() -> Chunk:
    param = torch.nn.Parameter(torch.randn(4, 3))
    chunk = Chunk(0, ChunkSpec((ParamInfo("w", param, 0),), 12), rank=0, world_size=1, device=torch.device("cpu"))
    chunk.pack()  # one rank: no collective
    chunk.owned = True
    return chunk


def test_a_tier_changes_only_inside_a_policy_hook():
    chunk = _owned_chunk()
    with pytest.raises(OwnershipError, match="only a placement policy"):
        chunk.tier = MemoryTier.HOST
    with pytest.raises(OwnershipError, match="only a placement policy"):
        chunk.replace_shard(chunk.shard.clone())
    DevicePlacementPolicy().attach([chunk])  # a hook: allowed
    assert chunk.tier is MemoryTier.DEVICE and not in_policy_call()


def test_a_policy_may_not_gather_or_release():
    chunk = _owned_chunk()
    chunk.persistent = False  # a stage-3 chunk, gathered
    with pytest.raises(OwnershipError, match="only the engine gathers and releases"):
        _Rogue().before_gather([chunk])
    chunk.release()  # the engine (outside any hook) may


def test_an_unowned_chunk_is_free_to_drive():
    chunk = _owned_chunk()
    chunk.owned = False
    chunk.tier = MemoryTier.HOST
    assert chunk.tier is MemoryTier.HOST
