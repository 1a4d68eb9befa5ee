"""Parameters cut along a later dimension (see [Note: shard dimension] in zero_core.chunks._slots), without processes.

A fused expert weight with fewer experts than ranks is cut along its second dimension; these
tests pin the choice and check that every view and copy of the layout agrees with
``torch.chunk`` along that dimension, which is what the DTensor ``Shard(dim)`` of the sharded
parameter says each rank holds.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_core.chunks._chunk_layout import ChunkLayout
from zero_core.chunks._slots import ChunkSpec, ParamInfo, layout_slots, padded_shard_size, shard_cut, shard_dim

# the last two are cut in two dimensions over 4 ranks (a 2 x 2 grid; see [Note: two-dimension cut])
SHAPES = [(3, 8, 4), (5,), (4, 6), (), (1, 7, 4), (1, 8), (6, 10), (6, 3, 10)]


@pytest.mark.parametrize(("shape", "world", "dim"), [
    ((8, 28672, 4096), 64, 1),    # Mixtral's fused gate_up_proj: 8 experts over 64 ranks
    ((8, 4096, 14336), 64, 1),    # and its down_proj
    ((1, 197, 1024), 64, 2),      # a ViT's position embedding: 197 is prime
    ((50257, 768), 64, 0),        # GPT-2's embedding pads 47 rows of 50304: 0.09%, under the tolerance
    ((3, 5), 2, 0),               # nothing divides evenly: stays on dim 0, padded
    ((4096,), 1024, 0),           # one dimension: nothing else to cut
    ((3, 8, 4), 1, 0),            # one rank never pads
])
def test_the_cut_dimension_is_dim_0_unless_that_pads_more_than_one_percent(shape, world, dim):
    assert shard_dim(shape, world) == dim


@pytest.mark.parametrize(("shape", "world", "cut"), [
    ((3584, 3584), 1024, (0, 1, 2)),    # Qwen2-7B's attention: 3584 = 7 x 512, a 512 x 2 grid, 7 x 1792 a rank
    ((18944, 3584), 1024, (0, 1, 2)),   # its MLP: 18944 = 37 x 512
    ((4544, 4544), 1024, (0, 1, 16)),   # Falcon-7B: 4544 = 71 x 64, a 64 x 16 grid
    ((6, 3, 10), 4, (0, 2, 2)),         # the second cut skips a dimension it does not divide
    ((3, 5), 2, (0, 0, 1)),             # no grid divides exactly: dim 0, padded
    ((512,), 1024, (0, 0, 1)),          # one dimension: padded
])
def test_a_matrix_no_dimension_of_which_the_ranks_divide_is_cut_in_two(shape, world, cut):
    assert shard_cut(shape, world) == cut
    (slot,), size = layout_slots([("w", nn.Parameter(torch.empty(shape, device="meta")))], world)
    if cut[2] > 1:  # exact: nothing padded, every rank the same share
        assert slot.piece * world == slot.numel and size == slot.piece and slot.strided
        assert slot.local_shape(world - 1).numel() == slot.piece


def _values():
    torch.manual_seed(0)
    return [torch.randn(shape) for shape in SHAPES]


def _spec(values, world):
    infos = tuple(ParamInfo(f"p{i}", nn.Parameter(v.clone()), 0) for i, v in enumerate(values))
    size = world * padded_shard_size([v.shape for v in values], world, 0) + 2 * world  # a tail of padding too
    return ChunkSpec(infos, size)


def _full(layout, values):
    full = torch.zeros(layout.size)
    for slot, value in zip(layout.slots, values):
        # a zero-dimensional parameter is replicated: every rank's piece holds it (Chunk.pack copies it so)
        width = layout.world_size if slot.replicated else slot.numel
        full[slot.offset : slot.offset + width] = value.reshape(-1)
    return full


@pytest.mark.parametrize(("world", "outer"), [(2, 1), (4, 1), (4, 2)])
def test_copy_in_and_copy_out_move_each_ranks_torch_chunk_piece(world, outer):
    values = _values()
    spec = _spec(values, world)
    layouts = [ChunkLayout(spec, rank=r, world_size=world, outer=outer) for r in range(world)]
    assert [s.dim for s in layouts[0].slots] == [1, 0, 0, 0, 2, 1, 0, 0]
    assert [s.split for s in layouts[0].slots] == [1] * 6 + ([2, 2] if world == 4 else [1, 1])
    assert layouts[0].strided and not layouts[0].direct
    full = _full(layouts[0], values)
    rank_major = torch.empty(layouts[0].size)
    layouts[0].copy_in(full, rank_major)
    shards = rank_major.view(world, layouts[0].shard_size)
    for rank, layout in enumerate(layouts):
        for i, (slot, value) in enumerate(zip(layout.slots, values)):
            piece = layout.shard_pieces(shards[rank])[i]
            want = slot.local_of(value, rank) if not slot.replicated else value
            assert torch.equal(layout.local(i, piece), want), (slot.name, rank)
            # the ranges runs() names are the same elements, in the piece's order
            flat = value.reshape(-1)
            got = torch.cat([flat[lo:hi] for lo, hi, _ in slot.runs(rank)] or [flat[:0]])
            assert torch.equal(got, want.reshape(-1)), (slot.name, rank)
        # this rank's pieces of the full buffer hold the same values
        own = torch.cat([p.reshape(-1) for p in layout.own_pieces(full)])
        assert torch.equal(own, shards[rank][: own.numel()])
    back = torch.zeros(layouts[0].size)
    layouts[0].copy_out(shards, back)
    assert torch.equal(back, full)
    # the order the shard group's all-gather leaves them in, with the shards cut over the replicas too
    gathered = torch.empty(layouts[0].size)
    layouts[0].copy_in(full, gathered, gather_order=True)
    block = gathered.view(world // outer, outer * layouts[0].shard_size)
    back.zero_()
    layouts[0].copy_out(layouts[0].from_gather_order(block), back)
    assert torch.equal(back, full)


def test_a_ranks_shard_written_into_a_full_buffer_lands_in_its_pieces():
    values, world = _values(), 4
    layout = ChunkLayout(_spec(values, world), rank=2, world_size=world)
    full = _full(layout, values)
    rank_major = torch.empty(layout.size)
    layout.copy_in(full, rank_major)
    shard = rank_major.view(world, layout.shard_size)[2].clone()
    other = torch.zeros(layout.size)
    layout.scatter_own(shard, other)
    expected = torch.zeros(layout.size)
    expected_major = torch.zeros(world, layout.shard_size)
    expected_major[2] = shard
    layout.copy_out(expected_major, expected)
    assert torch.equal(other, expected)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_whole_and_pieces_of_are_inverse(world):
    for i, value in enumerate(_values()):
        (slot,), _ = layout_slots([(f"p{i}", nn.Parameter(value))], world)
        columns = slot.pieces_of(value, world)
        assert columns.shape == (world, slot.piece)
        assert torch.equal(slot.whole(columns), value.reshape(slot.shape))
