"""The spine: sharded training reproduces single-process training on the whole zoo.

Every installed strategy x stage (1, 2, 3) x world size (1, 2, 4) x precision, on every
zoo model. fp32: per-step losses and final parameters equal a one-process run over the
same global batch within 1e-5, relative to each tensor's largest magnitude (see
zero_core.testing.assert_parity for why per tensor). bf16 and fp16: equal a one-process
run with the same casting rules within 1e-3 (see [Note: the 16-bit reference] in
zero_core.testing.parity for what it reproduces and why that tolerance); fp16 also
reproduces the loss scale of every step (a small initial scale that grows every
second step, so growth is exercised).

One spawned world per strategy and world size trains every stage and precision in turn (each
its own engine, so nothing carries from one to the next), and one world at 2 ranks every optimizer
case: the worlds' start-up, not the training, was most of this file's time.
"""

import pytest
from _shared_worlds import SharedWorlds

from zero_core import ChunkPolicy, LossScale, Precision, ZeroConfig
from zero_core.plugin import ZeroPlugins
from zero_core.testing import (
    ZOO,
    assert_parity,
    device_under_test,
    run_distributed,
    train_reference,
    train_sharded,
    train_zoo_sharded,
)

STRATEGIES = ZeroPlugins.load().strategies.names()  # every installed strategy runs the whole matrix
STAGES = [1, 2, 3]
WORLD_SIZES = [1, 2, 4]
PRECISIONS = {
    "fp32": Precision(),
    "bf16": Precision(compute="bf16"),
    "fp16": Precision(compute="fp16", loss_scale=LossScale(init_scale=2.0**10, growth_interval=2)),
}
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3, "fp16": 1e-3}
_reference_cache: dict = {}


def reference(case, precision="fp32", world=1, **kwargs):
    world = 1 if precision == "fp32" else world  # fp32: the whole batch at once; 16-bit: simulated ranks
    key = (case, precision, world, tuple(sorted(kwargs.items())))
    if key not in _reference_cache:
        _reference_cache[key] = train_reference(case, precision=PRECISIONS[precision], world=world, **kwargs)
    return _reference_cache[key]


def train_zoo_each(configs):
    """On every rank: :func:`train_zoo_sharded` under each config in turn, in one process group."""
    return [train_zoo_sharded(list(ZOO), config=config) for config in configs]


def zoo_plan(group):
    strategy, world = group
    return world, {(stage, precision): ZeroConfig(strategy=strategy, stage=stage, precision=PRECISIONS[precision])
                   for stage in STAGES for precision in PRECISIONS}


zoo_results = SharedWorlds(zoo_plan, train=train_zoo_each)


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_zoo_parity(strategy, stage, world, precision):
    results = zoo_results((strategy, world), (stage, precision))
    for case in ZOO:
        for rank, result in enumerate(results):  # every rank holds the same model afterwards
            assert_parity(reference(case, precision, world), result[case], rtol=TOLERANCE[precision],
                          label=f"{case} on rank {rank}:")


@pytest.mark.parametrize("world", [2, 4])
def test_searched_chunk_size_and_first_use_order(world):
    config = ZeroConfig(chunk=ChunkPolicy(min_chunk_size=100, search_interval=18, search_range=400, param_order="first_use"))
    results = run_distributed(train_sharded, world, "gpt", config=config)
    assert_parity(reference("gpt"), results[0])


# torch's fused SGD fails, in one process too, when a parameter first gets a gradient after the first step
# (its momentum list mixes tensors and None), so the fused variants train "twice", whose parameters all get one.
OPTIMIZER_CASES = [("sgd", "unused"), ("adam", "unused"), ("adagrad", "unused"), ("adam_foreach", "unused"),
                   ("sgd_fused", "twice"), ("adamw_fused", "twice"), ("adagrad_fused", "twice")]


def optimizer_plan(group):
    cases = [(o, c) for o, c in OPTIMIZER_CASES if not (o == "adagrad_fused" and device_under_test() == "cuda")]
    return 2, {(o, c, s): (c, {"optimizer": o, "config": ZeroConfig(stage=s, chunk=ChunkPolicy(chunk_size=64))})
               for o, c in cases for s in STAGES}


optimizer_results = SharedWorlds(optimizer_plan)  # one world of 2 ranks trains every optimizer at every stage


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(("optimizer", "case"), OPTIMIZER_CASES)
def test_plain_torch_optimizers_on_the_shards(optimizer, case, stage):
    if optimizer == "adagrad_fused" and device_under_test() == "cuda":
        pytest.skip("torch's fused Adagrad is CPU-only: torch.optim.Adagrad(fused=True) refuses CUDA parameters in one process too")
    results = optimizer_results("all", (optimizer, case, stage))
    assert_parity(reference(case, optimizer=optimizer), results[0])


def test_static_graph_promise_on_a_static_model():
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=300), static_graph=True)
    results = run_distributed(train_sharded, 2, "gpt_checkpointed", config=config)
    assert_parity(reference("gpt_checkpointed"), results[0])
    assert all("control" not in step for step in results[0].step_stats)


@pytest.mark.parametrize("reduce", ["bf16", "fp16"])
def test_16bit_reduction_matches_a_reference_that_reduces_in_16bit(reduce):
    compute = Precision(compute="bf16", reduce=reduce)
    results = run_distributed(train_sharded, 2, "gpt", config=ZeroConfig(precision=compute,
                                                                          chunk=ChunkPolicy(chunk_size=300)))
    assert_parity(train_reference("gpt", precision=compute, world=2), results[0], rtol=1e-3)
