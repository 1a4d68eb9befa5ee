"""The runtime units: a gather group's own reduce bookkeeping (ReduceState), the reducer's order across groups, mesh sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_core.base._state import ReduceState
from zero_core.chunks._group import GatherGroup
from zero_core.chunks.chunk import BufferPool, Chunk, ChunkSpec, ParamInfo
from zero_core.plugin import MeshSpec
from zero_core.runtime._reducer import GradientReducer


class _OneRank:
    """What the reducer asks of a comm backend at world size 1, where no collective runs."""

    world_size = 1

    def flush(self) -> None:
        pass


def _chunks(n: int, pool: BufferPool) -> list[Chunk]:
    params = [nn.Parameter(torch.randn(3)) for _ in range(n)]
    return [Chunk(i, ChunkSpec((ParamInfo(f"p{i}", p, 0),), 3), rank=0, world_size=1, device=torch.device("cpu"), pool=pool)
            for i, p in enumerate(params)]


def test_a_group_waits_for_every_expected_gradient_then_is_ready_then_reduced() -> None:
    pool = BufferPool()
    a, b = _chunks(2, pool)
    group = GatherGroup(0, [a, b], pool)
    assert group.reduce_state is ReduceState.IDLE
    ids = {id(a.slots[0].param), id(b.slots[0].param)}
    group.expect(ids)
    group.begin_backward(kept_graph=False)
    assert group.reduce_state is ReduceState.WAITING
    group.arrived(id(a.slots[0].param))
    assert group.reduce_state is ReduceState.WAITING
    group.arrived(id(b.slots[0].param))
    assert group.reduce_state is ReduceState.READY
    group.mark_reduced()
    group.end_backward()
    assert group.reduce_state is ReduceState.IDLE
    # a second backward with no forward since runs through the kept graph: it waits for the same gradients
    group.begin_backward(kept_graph=True)
    assert group.reduce_state is ReduceState.WAITING
    group.end_backward()
    group.forget_graphs()  # a step: no graph from before it can be backwarded
    group.begin_backward(kept_graph=True)
    assert group.reduce_state is ReduceState.READY  # nothing can arrive, so nothing is waited for


def test_the_reducer_reduces_a_group_once_all_of_its_gradients_arrived_in_reverse_plan_order() -> None:
    pool = BufferPool()
    chunks = _chunks(3, pool)
    for c in chunks:
        c.pack()  # one rank: no collective
    groups = [GatherGroup(0, chunks[:2], pool), GatherGroup(1, chunks[2:], pool)]
    reducer = GradientReducer(groups, reduce_comm=_OneRank(), mesh_comms=(), agree=False)  # type: ignore[arg-type]
    try:
        assert [c.index for c in reducer.order] == [2, 1, 0]
        reducer.expect({id(c.slots[0].param) for c in chunks})
        reducer.begin(forwards=1)
        launched: list[int] = []
        for c in (chunks[0], chunks[2], chunks[1]):  # gradients arrive in this order
            c.slots[0].param.grad = torch.ones(3)
            reducer.accumulated(c.slots[0].param)
            launched += [x.index for x in reducer.launch_ready(1.0)]
            if c is chunks[0]:
                assert launched == []  # group 1 (chunk 2) comes first in the order and is not ready
                assert not reducer.is_reduced(chunks[0])
            if c is chunks[2]:
                assert launched == [2]  # group 0 still waits for chunk 1
        assert launched == [2, 1, 0]  # group 0's chunks together, in reverse
        assert all(reducer.is_reduced(c) for c in chunks)
        reducer.complete()
        reducer.hand_over()
        reducer.end()
        assert all(g.reduce_state is ReduceState.IDLE for g in groups)
        assert all(torch.equal(c.segments[0].param.grad, torch.ones(3)) for c in chunks)
    finally:
        reducer.close()


def test_a_mesh_counts_ranks_under_names_that_say_so() -> None:
    mesh = MeshSpec.of_shape((2, 4))
    assert (mesh.shard_ranks, mesh.replicate_ranks) == (4, 2)
    assert mesh.hybrid(2).shape == (4, 2)
    with pytest.warns(DeprecationWarning, match="shard_ranks"):
        assert mesh.shard_size == 4  # the old name, which clashed with Chunk.shard_size (elements), still answers
    with pytest.warns(DeprecationWarning, match="replicate_ranks"):
        assert mesh.replicate_size == 2



def _move_a_parameter_and_back(strategy: str) -> bool:
    import weakref

    from zero_core import ZeroConfig, shard
    from zero_core.chunks._chunk_layout import repoint
    from zero_core.testing import rank_device

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    zmodel, opt = shard(model, torch.optim.Adam(model.parameters()), config=ZeroConfig(strategy=strategy, stage=3))
    params = list(zmodel.parameters())
    assert all(weakref.getweakrefcount(p) == 0 for p in params)
    first = params[0]
    local = first.to_local()
    repoint(first, local.to("meta"))  # the CPU's stand-in for another device: the path the host tier takes on CUDA
    assert first is params[0] and first.to_local().device.type == "meta"
    repoint(first, local)
    assert first.to_local().data_ptr() == local.data_ptr()
    zmodel(torch.ones(3, 4, device=rank_device())).sum().backward()
    opt.step()  # the optimizer still steps the same objects
    zmodel.close()
    return True


@pytest.mark.parametrize("strategy", ["chunk", "tensor"])
def test_a_sharded_parameter_moves_to_another_device_as_the_same_object(strategy) -> None:
    """A host tier on CUDA moves a DTensor parameter's shard to the host: a new wrapper is swapped into the same
    object, which torch.utils.swap_tensors refuses while anything holds a weak reference to the parameter."""
    from zero_core.testing import run_distributed

    assert run_distributed(_move_a_parameter_and_back, 2, strategy, timeout=60) == [True, True]


def _split_with_sizes_copy_as_cuda(input, split_sizes, dim=-1, *, out):
    """torch 2.11's CUDA fast path (aten/src/ATen/native/cuda/TensorShape.cu): taken for any dense input, which it
    reads in memory order as if it were contiguous."""
    from zero_core.chunks._chunk_layout import dense

    if dense(input):
        order = sorted(range(input.dim()), key=lambda d: -input.stride(d))  # the dimensions in memory order
        input = input.permute(order).contiguous().view(input.shape)
    for piece, target in zip(input.split(list(split_sizes), dim=dim), out, strict=True):
        target.copy_(piece)


def test_a_gather_order_view_is_copied_out_in_rank_order_by_cuda_fast_path_rules(monkeypatch) -> None:
    """The all-gather of group shards leaves ``(S, R, shard)``; :meth:`ChunkLayout.from_gather_order` views it in rank
    order, a dense but permuted tensor. On an H200 CUDA's split_with_sizes_copy read it as contiguous and scrambled
    the replicas' rows; copy_out hands it a contiguous copy. Checked here against that kernel's rule, on the CPU."""
    from zero_core.chunks._chunk_layout import ChunkLayout, dense

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n)) for n in (36, 18, 18, 7)]
    spec = ChunkSpec(tuple(ParamInfo(f"p{i}", p, 0) for i, p in enumerate(params)), 96)
    world, outer = 4, 2
    layouts = [ChunkLayout(spec, rank=r, world_size=world, outer=outer) for r in range(world)]
    layout = layouts[0]
    assert not layout.direct  # several columns: the split_with_sizes_copy path
    full = torch.zeros(layout.size)
    for slot, region in zip(layout.slots, layout.regions(full), strict=False):  # each parameter's pieces, padded
        flat = slot.param.detach().reshape(-1)
        for r in range(world):
            lo, hi = slot.own_range(r)
            region[r, : hi - lo] = flat[lo:hi]
    gathered = torch.empty(layout.size)  # what the shard group's all-gather leaves: each rank's group shard, in order
    layout.copy_in(full, gathered, gather_order=True)
    monkeypatch.setattr(torch, "split_with_sizes_copy", _split_with_sizes_copy_as_cuda)
    rows = layout.from_gather_order(gathered.view(world // outer, outer * layout.shard_size))
    assert dense(rows) and not rows.is_contiguous()  # what the fast path mishandles
    out = torch.full_like(full, float("nan"))
    layout.copy_out(rows, out)
    assert torch.equal(out, full)
