"""model.stream_full_parameters(): full weights in buckets, with a bounded peak, between steps, at every layout.

See [Note: streaming full weights] in ``zero_core.checkpoint._streaming``. One spawn per world size trains each layout twice,
with a weight sync to a plain copy of the model on rank 0 after step 1 and without, and checks the values,
the buckets, the memory bound and that the next steps did not change.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zero_core import ChunkPolicy, ConfigError, ZeroConfig, shard
from zero_core.testing import rank_device, run_distributed, train_sharded
from zero_core.testing.memory import LiveBytes
from zero_core.testing.zoo import get_case

BUCKET = 3000  # bytes: the gpt case's parameters (up to 2,960 bytes) make several buckets
_SEEN: dict[str, Any] = {}


@torch.no_grad()
def _load(plain: torch.nn.Module, bucket: list[tuple[str, torch.Tensor]]) -> None:
    """What a weight sync into an inference engine does with a bucket: copy each tensor into its parameter."""
    for name, value in bucket:
        plain.get_parameter(name).copy_(value)


def _sync_weights(model: torch.nn.Module, step: int) -> None:
    """After step 1: stream the weights into a plain copy on rank 0, and in bf16 onto every rank's device."""
    if step != 1:
        return
    rank = dist.get_rank()
    expected = model.full_parameters()
    plain = get_case("gpt").build() if rank == 0 else None
    sizes, names, kept_after_handout = [], [], []
    previous: list[weakref.ref] = []
    counter = LiveBytes()
    gc.collect()
    with counter:
        buckets = model.stream_full_parameters(bucket_mb=BUCKET / 2**20, rank=0)
        for bucket in buckets:
            kept_after_handout.append(sum(ref() is not None for ref in previous))
            sizes.append([value.numel() * value.element_size() for _, value in bucket])
            names += [name for name, _ in bucket]
            if plain is not None:
                _load(plain, bucket)
            previous = [weakref.ref(value) for _, value in bucket]
            del bucket
            # the peak is what the generator keeps alive, not garbage the cycle collector has yet to reach, whose
            # timing depends on what this process (a forkserver's child) allocated before: a CI run once counted a
            # 72-byte bias twice
            gc.collect()
    chunk_bytes = max(c.size * c.master_dtype.itemsize for c in model.engine.chunks)
    param_bytes = max(v.numel() * v.element_size() for v in expected.values())
    # one parameter's column of the gathered shards, padding included, converted before it is trimmed
    column_bytes = max(c.world_size * s.piece * c.master_dtype.itemsize for c in model.engine.chunks for s in c.slots)
    _SEEN.update(sizes=sizes, names=names, kept_after_handout=kept_after_handout, peak=counter.peak,
                 chunk_bytes=chunk_bytes, param_bytes=param_bytes, column_bytes=column_bytes, expected_names=list(expected))
    if plain is not None:
        _SEEN["plain_equal"] = all(torch.equal(p, expected[n]) for n, p in plain.named_parameters() if n in expected)
        _SEEN["plain_names"] = {n for n, _ in plain.named_parameters()}
    half = {name: value for bucket in model.stream_full_parameters(bucket_mb=1, dtype=torch.bfloat16, device="device")
            for name, value in bucket}
    _SEEN["half_equal"] = all(torch.equal(half[n].cpu(), v.to(torch.bfloat16)) for n, v in expected.items())
    _SEEN["half_devices"] = {v.device.type for v in half.values()}


LAYOUTS = {
    "chunk-3": ({"stage": 3}, None),
    "chunk-1": ({"stage": 1}, None),
    "tensor-3": ({"stage": 3, "strategy": "tensor"}, None),
    "tensor-2": ({"stage": 2, "strategy": "tensor"}, None),
    "chunk-3-offload": ({"stage": 3, "placement": "static",
                         "placement_options": {"offload_param_frac": 1.0, "offload_optim_frac": 1.0}}, None),
}
MESH_LAYOUTS = {"hsdp-2x2": ({"stage": 3}, (2, 2)),
                "hsdp-2x2-across": ({"stage": 3, "shard_optimizer_across_replicas": True}, (2, 2))}


def _layouts(names: list[str]) -> dict[str, Any]:
    out = {}
    for name in names:
        options, mesh = {**LAYOUTS, **MESH_LAYOUTS}[name]
        config = ZeroConfig(chunk=ChunkPolicy(chunk_size=get_case("gpt").chunk_size), **options)
        runs = {}
        for stream in (False, True):
            _SEEN.clear()
            result = train_sharded("gpt", config=config, steps=4, mesh_shape=mesh,
                                   after_step=_sync_weights if stream else None)
            runs[stream] = (result.losses, result.params, dict(_SEEN))
        out[name] = runs
    return out


@pytest.mark.parametrize(("world", "names"), [(2, list(LAYOUTS)), (4, list(MESH_LAYOUTS))])
def test_streamed_weights_are_whole_bounded_and_leave_training_alone(world, names):
    results = run_distributed(_layouts, world, names, timeout=300)
    for name in names:
        counts = set()
        for rank, per_rank in enumerate(results):
            (losses, params, _), (streamed_losses, streamed_params, seen) = per_rank[name][False], per_rank[name][True]
            label = f"{name} rank {rank}"
            # the sync between steps 1 and 2 changed nothing in training
            assert streamed_losses == losses, label
            assert all(torch.equal(streamed_params[k], v) for k, v in params.items()), label
            sizes = seen["sizes"]
            counts.add(len(sizes))
            if rank == 0:
                assert seen["plain_equal"], label
                assert sorted(seen["names"]) == sorted(seen["expected_names"]), label  # each parameter once
                assert seen["plain_names"] >= set(seen["names"]), label
                for bucket in sizes:  # a bucket holds at most BUCKET bytes, unless one parameter alone is larger
                    assert sum(bucket) <= BUCKET or len(bucket) == 1, (label, bucket)
                assert len(sizes) > 2, label
            else:
                assert all(bucket == [] for bucket in sizes), label  # rank=0: the others iterate, empty-handed
            assert seen["kept_after_handout"] == [0] * len(sizes), label  # the generator keeps nothing it handed out
            # the bound: the caller's bucket and the one being built, one chunk's gathered shards, one parameter's
            # column converted (see [Note: streaming full weights])
            bound = 2 * max(BUCKET, seen["param_bytes"]) + seen["chunk_bytes"] + seen["column_bytes"]
            assert 0 < seen["peak"] <= bound, (label, seen["peak"], bound)
            assert seen["half_equal"] and seen["half_devices"] == {rank_device().type}, label
        assert len(counts) == 1, (name, counts)  # every rank iterated as many buckets


def test_bad_arguments_are_refused_at_the_call():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    zmodel, _ = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=ZeroConfig(stage=3))
    for kwargs, match in [({"bucket_mb": 0}, "bucket_mb"), ({"bucket_mb": float("nan")}, "bucket_mb"),
                          ({"dtype": torch.int8}, "dtype"), ({"rank": 3}, r"rank.*\[0, 1\)"),
                          ({"device": "gpu0"}, "device")]:
        with pytest.raises(ConfigError, match=match):
            zmodel.stream_full_parameters(**kwargs)
    whole = {name: value for bucket in zmodel.stream_full_parameters() for name, value in bucket}
    assert whole.keys() == zmodel.full_parameters().keys()
    zmodel.close()


def test_the_weight_sync_benchmark_runs_and_every_method_copies_exactly():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "benchmarks"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "zero_bench.weight_sync", "--model", "tiny", "--world", "2",
                           "--bucket-mb", "0.25", "--repeats", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # 1: a method's copy differed from the shards
    for method in ("gathered_parameters", "full_parameters", "stream_full_parameters"):
        assert f"| `{method}` |" in proc.stdout and "| True |" in proc.stdout, proc.stdout
