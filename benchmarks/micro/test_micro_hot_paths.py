"""Micro-benchmarks of zero's hot paths on 2 gloo ranks: collectives, chunk gather and release, reduce-scatter
bucketing, shard packing and placement moves (how the ranks are set up: conftest.py).

Each benchmark times one round of a workload with ``benchmark.pedantic`` (conftest's
``ROUNDS`` rounds after ``WARMUP`` warm-up rounds) and records, in ``extra_info``, the
collective calls and the bytes this rank sent per round (``CommStats``' ring convention:
``(N - 1) / N`` of the full payload for a reduce-scatter or an all-gather).

* ``reduce-scatter ...``: one backend's reduce-scatter of a list of tensors, issued
  asynchronously, flushed and waited on (the engine's backward pattern); the torch
  backend sends one collective per tensor, the bucketed one packs them into buckets.
* ``demo gradients ...``: the demo GPT's gradients (``examples/train_gpt.py``'s default
  model, 23.2M parameters): every parameter padded to the world size, in reverse
  registration order, which is one backward's reduction under the tensor strategy; the
  chunk strategy's chunks for reference.
* ``demo gather ...``: gathering the demo GPT's parameters from stage-3 shards and
  releasing them again: chunks of the demo's searched size (``pack_chunks`` with
  ``ChunkPolicy(search_interval=d_model)``: 4,269,056 elements, the embedding in a chunk
  of its own), tensor-wise with one all-gather per module, and tensor-wise with one
  all-gather per parameter.

Run with ``nox -s microbench`` or ``pytest benchmarks/micro -p no:cacheprovider``.
"""

from __future__ import annotations

from typing import Any

import pytest

BACKENDS: dict[str, dict[str, Any]] = {
    "unbucketed": {"backend": "torch"},
    "bucketed-25MiB": {"backend": "bucketed", "bucket_mb": 25.0},
    "bucketed-1MiB": {"backend": "bucketed", "bucket_mb": 1.0},
}


@pytest.mark.parametrize("variant", list(BACKENDS))
def test_reduce_scatter_small(benchmark: Any, mirror: Any, variant: str) -> None:
    """200 reduce-scatters of 4096 fp32 elements (16 KiB) each: per-call cost dominates."""
    benchmark.group = "reduce-scatter 200 x 4096 fp32"
    counts = mirror.bench(benchmark, "reduce_scatter", workload="small", **BACKENDS[variant])
    # 1 MiB buckets hold 64 of these inputs, 25 MiB buckets all of them
    assert counts["calls"] == {"unbucketed": 200, "bucketed-25MiB": 1, "bucketed-1MiB": 4}[variant]


@pytest.mark.parametrize("variant", list(BACKENDS))
def test_reduce_scatter_mixed(benchmark: Any, mirror: Any, variant: str) -> None:
    """96 reduce-scatters of 128 to 393,216 fp32 elements (30 MiB in all); the largest exceed a 1 MiB bucket."""
    benchmark.group = "reduce-scatter 96 mixed-size fp32"
    counts = mirror.bench(benchmark, "reduce_scatter", workload="mixed", **BACKENDS[variant])
    if variant == "unbucketed":
        assert counts["calls"] == 96


@pytest.mark.parametrize("variant", ["unbucketed", "bucketed-25MiB", "chunk-plan"])
def test_demo_gradients(benchmark: Any, mirror: Any, variant: str) -> None:
    """One backward's gradient reduction on the demo GPT: per-parameter (tensor strategy) or per-chunk."""
    benchmark.group = "demo gradients: reduce-scatter per step"
    if variant == "chunk-plan":
        counts = mirror.bench(benchmark, "reduce_scatter", workload="demo-chunk", backend="torch")
    else:
        counts = mirror.bench(benchmark, "reduce_scatter", workload="demo-tensor", **BACKENDS[variant])
    if variant == "unbucketed":
        assert counts["calls"] == 76  # one per unique parameter of the demo GPT


@pytest.mark.parametrize("plan", ["chunk", "tensor-groups", "tensor-each"])
def test_demo_gather(benchmark: Any, mirror: Any, plan: str) -> None:
    """Gather every parameter of the demo GPT from stage-3 shards, then release every chunk."""
    benchmark.group = "demo gather: all-gather + release per round"
    counts = mirror.bench(benchmark, "gather", plan=plan)
    assert counts["calls"] == benchmark.extra_info["groups"]


def test_shard_packing(benchmark: Any, mirror: Any) -> None:
    """Pack the demo GPT into its stage-3 chunks (setup's per-chunk work); no collective."""
    benchmark.group = "shard packing: demo GPT into chunks"
    counts = mirror.bench(benchmark, "pack")
    assert counts["calls"] == 0


@pytest.mark.parametrize("route", ["device-host", "host-disk"])
def test_placement_moves(benchmark: Any, mirror: Any, route: str) -> None:
    """Every chunk's master shard and Adam states to another tier and back (the offload policies' moves)."""
    benchmark.group = "placement moves: demo shards + Adam states"
    counts = mirror.bench(benchmark, "placement", route=route)
    assert counts["calls"] == 0
