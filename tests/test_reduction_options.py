"""The reduction options ShardedModelV2 had, for every strategy: a reduce-scatter process group of
the user's, a gradient pre-divide factor, the reduce dtype (fp32 reduce-scatter that really is
fp32), and gradients offloaded to the host (moved, not cloned)."""

import pytest
import torch
import torch.distributed as dist

from zero_core import ChunkPolicy, Precision, ZeroConfig, ZeroSetupError, shard
from zero_core.plugin import ZeroPlugins
from zero_core.testing import assert_parity, run_distributed, train_reference, train_sharded
from zero_core.testing.zoo import get_case

STRATEGIES = ZeroPlugins.load().strategies.names()


def config(strategy, **kwargs):
    return ZeroConfig(strategy=strategy, chunk=ChunkPolicy(chunk_size=300), **kwargs)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_power_of_two_predivide_factor_changes_no_bit(strategy):
    plain = run_distributed(train_sharded, 4, "gpt", config=config(strategy))
    predivided = run_distributed(train_sharded, 4, "gpt", config=config(strategy, precision=Precision(gradient_predivide_factor=4)))
    assert predivided[0].losses == plain[0].losses
    for name, value in plain[0].params.items():
        assert torch.equal(predivided[0].params[name], value), name


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_any_predivide_factor_gives_the_mean(strategy):
    results = run_distributed(train_sharded, 2, "gpt", config=config(strategy, precision=Precision(gradient_predivide_factor=3)))
    assert_parity(train_reference("gpt"), results[0])


@pytest.mark.parametrize("reduce", ["fp32", "bf16"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_reduce_dtype_is_what_travels(strategy, reduce):
    precision = Precision(compute="bf16", reduce=reduce)
    results = run_distributed(train_sharded, 2, "gpt", steps=2, config=config(strategy, precision=precision, comm_backend="torch"))
    padded = sum(c["size"] for c in results[0].chunks)
    width = 4 if reduce == "fp32" else 2
    for step in results[0].step_stats:
        assert step["reduce_scatter"]["bytes_sent"] == padded * width // 2
        assert step["all_gather"]["bytes_sent"] == 2 * padded * 2 // 2  # parameters travel in bf16 either way


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_host_placement_trains_the_same_model(strategy, stage):
    results = run_distributed(train_sharded, 2, "gpt", config=config(strategy, stage=stage, placement="host"))
    assert_parity(train_reference("gpt"), results[0])


def _offloaded_gradients(strategy):
    torch.manual_seed(0)
    case = get_case("gpt")
    model = case.build()
    model, opt = shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config(strategy, placement="host"))
    inputs, targets = case.batch(0, 4)
    model.backward(case.loss(model(inputs), targets))
    engine = model.engine
    grads = [seg.param.grad.to_local() for c in engine.chunks for seg in c.segments]  # this rank's pieces
    storages = {g.untyped_storage().data_ptr() for g in grads}
    opt.step()
    return {
        "devices": {str(g.device) for g in grads},
        "storages": len(storages),
        "chunks": len(engine.chunks),
        "grad_bytes": model.model_state_bytes()["grads"],
        "shard_bytes": sum(c.shard_size * 4 for c in engine.chunks),
        "tiers": {c.tier.value for c in engine.chunks},
        "state_devices": {str(v.device) for s in opt.state.values() for v in s.values() if v.dim() > 0},
    }


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_offloaded_gradients_are_moved_once_per_chunk_not_cloned(strategy):
    for result in run_distributed(_offloaded_gradients, 2, strategy):
        assert result["devices"] == {"cpu"} and result["state_devices"] == {"cpu"} and result["tiers"] == {"host"}
        # one host gradient per chunk, which every segment views: nothing kept twice
        assert result["storages"] == result["chunks"]
        assert result["grad_bytes"] == result["shard_bytes"]


def _with_reduce_group(strategy, kind):
    ranks = list(range(dist.get_world_size()))
    group = {"own": lambda: dist.new_group(ranks), "same": lambda: dist.group.WORLD,
             "partial": lambda: dist.new_group(ranks[:2])}[kind]()
    if kind == "own":
        return train_sharded("gpt", config=config(strategy), reduce_process_group=group)
    try:
        torch.manual_seed(0)
        model = get_case("gpt").build()
        shard(model, torch.optim.AdamW(model.parameters()), config=config(strategy), reduce_process_group=group)
    except ZeroSetupError as err:
        return str(err)
    return "accepted"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_reduce_scatter_group_of_the_users(strategy):
    results = run_distributed(_with_reduce_group, 2, strategy, "own")
    assert_parity(train_reference("gpt"), results[0])
    assert all(step["reduce_scatter"]["calls"] > 0 for step in results[0].step_stats)


def test_a_reduce_scatter_group_that_cannot_work_is_refused():
    same = run_distributed(_with_reduce_group, 2, "chunk", "same", timeout=60)
    assert all("is the data-parallel group itself" in m and "new_group" in m for m in same)
    partial = run_distributed(_with_reduce_group, 4, "chunk", "partial", timeout=60)
    assert all("spans ranks [0, 1] but the data-parallel group spans [0, 1, 2, 3]" in m for m in partial[:2])
    assert all("rank 2 is not a member" in m or "rank 3 is not a member" in m for m in partial[2:])

