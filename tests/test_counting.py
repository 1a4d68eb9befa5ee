"""Exact, deterministic counts: collectives per step, bytes sent, model-state bytes per rank.

Formulas (peers.md section 4, fp32, Adam): ZeRO-3 sends (N-1)/N * Psi * (2*b_p + b_g)
bytes per rank per step (two all-gathers, one reduce-scatter), with Psi counted over the
padded chunks; parameters + gradients + optimizer states are 16*Psi/N per rank, where
padding carries parameter and gradient bytes but no optimizer state.
"""

import pytest

from zero_core import ChunkPolicy, ZeroConfig
from zero_core.testing import run_distributed, train_sharded


def padding_on_rank(chunk, rank, world):
    shard = chunk["size"] // world
    lo, hi = rank * shard, (rank + 1) * shard
    return max(0, hi - max(lo, chunk["used"]))


def test_one_rank_sends_nothing():
    result = run_distributed(train_sharded, 1, "gpt", steps=2)[0]
    assert result.step_stats == [{}, {}]


@pytest.mark.parametrize("world", [2, 4])
def test_zero3_collectives_and_bytes_per_step(world):
    results = run_distributed(train_sharded, world, "gpt", steps=3)
    chunks = results[0].chunks
    n_chunks, padded = len(chunks), sum(c["size"] for c in chunks)
    assert all(c["requires_grad"] for c in chunks)
    for result in results:
        assert len(result.step_stats) == 3
        for step in result.step_stats:
            assert step["all_gather"]["calls"] == 2 * n_chunks  # forward + backward, one per chunk
            assert step["reduce_scatter"]["calls"] == n_chunks
            assert step["all_gather"]["bytes_sent"] == 2 * (world - 1) * padded * 4 // world
            assert step["reduce_scatter"]["bytes_sent"] == (world - 1) * padded * 4 // world
            data = step["all_gather"]["bytes_sent"] + step["reduce_scatter"]["bytes_sent"]
            assert data == (world - 1) * padded * (2 * 4 + 4) // world  # the ZeRO-3 formula plus padding
            # agreement rounds: at most one per gather plus a drain per pass and one gradient-presence
            # exchange (prefetched chunks need none); the same on every rank and every step
            assert step["control"] == results[0].step_stats[0]["control"]
            assert step["control"]["calls"] <= 2 * n_chunks + 3
            assert set(step) == {"all_gather", "reduce_scatter", "control"}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_model_state_bytes_are_16_psi_over_n_plus_padding(world):
    results = run_distributed(train_sharded, world, "gpt", steps=2)
    chunks = results[0].chunks
    psi = sum(c["used"] for c in chunks)
    padding = sum(c["size"] - c["used"] for c in chunks)
    total = 0
    for rank, result in enumerate(results):
        mem = result.model_state_bytes
        shard_elems = sum(c["size"] // world for c in chunks)
        pad = sum(padding_on_rank(c, rank, world) for c in chunks)
        assert mem["params"] == 4 * shard_elems
        assert mem["grads"] == 4 * shard_elems
        assert mem["optimizer_states"] == 8 * (shard_elems - pad)  # exp_avg and exp_avg_sq, no padding
        assert mem["gathered_buffers"] == 0
        total += mem["params"] + mem["grads"] + mem["optimizer_states"]
    assert total == 16 * psi + 8 * padding


def test_frozen_parameters_hold_no_gradient_or_optimizer_state():
    results = run_distributed(train_sharded, 2, "frozen", steps=2)
    chunks = results[0].chunks
    trainable = sum(c["size"] // 2 for c in chunks if c["requires_grad"])
    everything = sum(c["size"] // 2 for c in chunks)
    for result in results:
        assert result.model_state_bytes["params"] == 4 * everything
        assert result.model_state_bytes["grads"] == 4 * trainable
        assert sum(result.step_stats[-1]["reduce_scatter"].values()) > 0
        assert result.step_stats[-1]["reduce_scatter"]["calls"] == sum(c["requires_grad"] for c in chunks)


def test_static_graph_sends_no_control_traffic():
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=300), static_graph=True)
    results = run_distributed(train_sharded, 2, "gpt", config=config, steps=2)
    assert all("control" not in step for step in results[0].step_stats)
