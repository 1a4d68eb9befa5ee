"""Gradient accumulation with no_sync() and global-norm clipping reproduce one-process training.

The parametrized runs share one spawned world per strategy and world size (tests/_shared_worlds.py).
"""

import math

import pytest
import torch
from _shared_worlds import SharedWorlds

from zero_core import ChunkPolicy, ConfigError, LossScale, Precision, ZeroConfig, ZeroError, clip_grad_norm_, shard
from zero_core.plugin import ZeroPlugins
from zero_core.testing import assert_parity, train_reference
from zero_core.testing.zoo import get_case

STRATEGIES = ZeroPlugins.load().strategies.names()
NORMS = [2.0, 1.0, math.inf]
MIXED = {"bf16": Precision(compute="bf16"), "fp16": Precision(compute="fp16", loss_scale=LossScale(init_scale=2.0**10))}


def accumulation_micro_batches(world):
    return 2 if world == 4 else 4  # 8 samples: 2 per rank at 4 ranks, split into 2 micro-batches


def plan(group):
    strategy, world = group
    runs = {}
    for case in ("gpt", "unused"):
        for stage in (1, 2, 3):
            # the torch backend, so the count below is one reduce-scatter per chunk (bucketing has its own tests)
            config = ZeroConfig(strategy=strategy, stage=stage, comm_backend="torch",
                                chunk=ChunkPolicy(chunk_size=get_case(case).chunk_size))
            runs[("no_sync", case, stage)] = (case, {"micro_batches": accumulation_micro_batches(world), "config": config})
    for stage in (1, 2, 3):
        for norm_type in NORMS:
            config = ZeroConfig(strategy=strategy, stage=stage, chunk=ChunkPolicy(chunk_size=300))
            runs[("clip", stage, norm_type)] = ("gpt", {"clip": 0.05, "norm_type": norm_type, "config": config})
    if world == 2:
        for stage in (1, 2, 3):
            config = ZeroConfig(strategy=strategy, stage=stage, comm_backend="torch", chunk=ChunkPolicy(chunk_size=300))
            runs[("every_micro_batch", stage)] = ("gpt", {"micro_batches": 2, "no_sync": False, "config": config})
        for precision, mixed in MIXED.items():
            for norm_type in (2.0, math.inf):
                config = ZeroConfig(strategy=strategy, precision=mixed, chunk=ChunkPolicy(chunk_size=300))
                runs[("clip_16bit", precision, norm_type)] = ("gpt", {"clip": 0.05, "norm_type": norm_type, "config": config})
    return world, runs


shared = SharedWorlds(plan)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("case", ["gpt", "unused"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_sync_accumulation_equals_one_big_batch(strategy, case, world, stage):
    results = shared((strategy, world), ("no_sync", case, stage))
    assert_parity(train_reference(case), results[0])
    chunks = results[0].chunks
    for step in results[0].step_stats:  # one reduce-scatter per chunk per step, whatever the micro-batches
        if world > 1:
            assert step["reduce_scatter"]["calls"] == sum(c["requires_grad"] for c in chunks)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reducing_every_micro_batch_also_equals_one_big_batch(strategy, stage):
    results = shared((strategy, 2), ("every_micro_batch", stage))
    assert_parity(train_reference("gpt"), results[0])
    chunks = results[0].chunks
    for step in results[0].step_stats:  # gradients handed over by the first reduction accumulate with the second's
        assert step["reduce_scatter"]["calls"] == 2 * len(chunks)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_clipping_uses_the_global_norm(strategy, world, norm_type, stage):
    clip = 0.05  # below the gradient norms of the first steps, so clipping acts
    results = shared((strategy, world), ("clip", stage, norm_type))
    reference = train_reference("gpt", clip=clip, norm_type=norm_type)
    assert any(n > clip for n in reference.norms)
    assert_parity(reference, results[0])
    assert all(r.norms == results[0].norms for r in results)  # identical floats on every rank
    assert all(isinstance(n, float) for n in results[0].norms)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_clipping_in_16bit_sees_unscaled_gradients(strategy, precision, norm_type):
    mixed = MIXED[precision]
    results = shared((strategy, 2), ("clip_16bit", precision, norm_type))
    reference = train_reference("gpt", clip=0.05, norm_type=norm_type, precision=mixed, world=2)
    assert any(n > 0.05 for n in reference.norms)
    assert_parity(reference, results[0], rtol=1e-3)


def small(stage=3):
    torch.manual_seed(0)
    model = get_case("odd_sizes").build()
    config = ZeroConfig(stage=stage, chunk=ChunkPolicy(chunk_size=64))
    return shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stepping_inside_no_sync_is_refused(stage):
    model, opt = small(stage)
    with model.no_sync():
        model(torch.rand(2, 6)).sum().backward()
        with pytest.raises(ZeroError, match="inside model.no_sync"):
            opt.step()
    with pytest.raises(ZeroError, match="never reduced"):
        opt.step()
    model(torch.rand(2, 6)).sum().backward()
    opt.step()  # a backward outside no_sync reduces the accumulated sum


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True])
def test_clipping_needs_a_positive_max_norm(bad):
    model, _ = small()
    with pytest.raises(ConfigError, match="positive max_norm"):
        clip_grad_norm_(model, bad)
