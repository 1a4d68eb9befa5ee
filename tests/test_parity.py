"""The spine: sharded training reproduces single-process training on the whole zoo.

Every zoo model, world sizes 1, 2 and 4, fp32: per-step losses and final parameters
equal a one-process run over the same global batch within 1e-5, relative to each
tensor's largest magnitude (see zero_core.testing.assert_parity for why per tensor).
"""

import pytest

from zero_core import ChunkPolicy, ZeroConfig
from zero_core.testing import ZOO, assert_parity, run_distributed, train_reference, train_sharded

WORLD_SIZES = [1, 2, 4]
_reference_cache: dict = {}


def reference(case, **kwargs):
    key = (case, tuple(sorted(kwargs.items())))
    if key not in _reference_cache:
        _reference_cache[key] = train_reference(case, **kwargs)
    return _reference_cache[key]


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", list(ZOO))
def test_zoo_parity(case, world):
    results = run_distributed(train_sharded, world, case)
    for result in results:  # every rank holds the same model afterwards
        assert_parity(reference(case), result)


@pytest.mark.parametrize("world", [2, 4])
def test_searched_chunk_size_and_first_use_order(world):
    config = ZeroConfig(chunk=ChunkPolicy(min_chunk_size=100, search_interval=18, search_range=400, param_order="first_use"))
    results = run_distributed(train_sharded, world, "gpt", config=config)
    assert_parity(reference("gpt"), results[0])


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_other_optimizers(optimizer):
    results = run_distributed(train_sharded, 2, "unused", optimizer=optimizer)
    assert_parity(reference("unused", optimizer=optimizer), results[0])


def test_static_graph_promise_on_a_static_model():
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=300), static_graph=True)
    results = run_distributed(train_sharded, 2, "gpt_checkpointed", config=config)
    assert_parity(reference("gpt_checkpointed"), results[0])
    assert all("control" not in step for step in results[0].step_stats)
