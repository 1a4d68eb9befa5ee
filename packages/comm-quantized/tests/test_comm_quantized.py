"""The quantized comm backends: the conformance kit within the int8 bound, the wire format, exact byte counts,
masters that stay exact, and a short training run against the exact backend."""

import tomllib
from pathlib import Path

import pytest
import torch

import zero_comm_quantized.plugin
from zero_comm_quantized import Quantization, QuantizedCommBackend, plugin_for
from zero_comm_quantized._codec import dequantize_rows, quantize_rows, row_bytes
from zero_core import ConfigError, ZeroConfig
from zero_core.config.api import ChunkPolicy
from zero_core.plugin import ZeroPlugins
from zero_core.testing import CommBackendConformance, run_distributed

# A value moves by at most max|x| / 254 of its block (half a step of 127 levels); a sum by that of each rank's
# block. 1/250 leaves room for fp32's own rounding of the scale and the sum.
INT8_BOUND = 1 / 250


class TestQuantizedBackend(CommBackendConformance):
    backend_class = QuantizedCommBackend
    params_tolerance = INT8_BOUND
    grads_tolerance = INT8_BOUND


def test_codec_bounds_each_block_and_keeps_non_finite_blocks_non_finite():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 700, generator=g) * torch.logspace(-3, 3, 700)  # blocks of very different magnitudes
    x[1, 256:512] = 0.0
    x[2, 3], x[2, 600] = float("inf"), float("nan")
    packed = torch.empty(3, row_bytes(700, 256), dtype=torch.uint8)
    quantize_rows(x, packed, block=256)
    y = dequantize_rows(packed, 700, block=256)
    assert row_bytes(700, 256) == 700 + 4 * 3
    for row in (0, 1):
        for start in range(0, 700, 256):
            block = slice(start, min(start + 256, 700))
            bound = x[row, block].abs().max() / 254
            assert (y[row, block] - x[row, block]).abs().max() <= bound * (1 + 1e-6), (row, start)
            # the block's largest magnitude is a code of +-127: it comes back up to fp32 rounding
            top = x[row, block].abs().argmax()
            torch.testing.assert_close(y[row, block][top], x[row, block][top], rtol=1e-6, atol=0)
    assert torch.equal(y[1, 256:512], torch.zeros(256))  # a zero block: scale 0, no NaN
    assert y[2, :256].isnan().all() and y[2, 512:].isnan().all()  # the blocks holding inf and NaN
    assert y[2, 256:512].isfinite().all()  # a finite block of the same row is untouched by them
    assert ((y[2, 256:512] - x[2, 256:512]).abs() <= x[2, 256:512].abs().max() / 254 * (1 + 1e-6)).all()


def test_settings_are_validated_and_variants_register_by_name():
    with pytest.raises(ConfigError, match="block_size"):
        Quantization(block_size=0)
    with pytest.raises(ConfigError, match="quantizes nothing"):
        Quantization(params=False, grads=False)
    with pytest.raises(ConfigError, match="True or False"):
        Quantization(grads=1)  # type: ignore[arg-type]
    q128 = QuantizedCommBackend.variant("q128", Quantization(block_size=128))
    assert q128.quantization.block_size == 128 and QuantizedCommBackend.quantization.block_size == 256
    registry = ZeroPlugins.load([zero_comm_quantized.plugin, plugin_for(q128)]).comm_backends
    assert {"quantized", "quantized-params", "quantized-grads", "q128"} <= set(registry.names())
    assert registry.get("quantized") is QuantizedCommBackend and registry.get("q128") is q128
    # installed, the same plugin module registers through the entry-point group the built-ins use
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["zero"] == {"zero-comm-quantized": "zero_comm_quantized.plugin"}
    assert project["name"] == "zero-comm-quantized"


def _bytes_worker():
    """Exact byte counts of one quantized gather and reduce-scatter, beside the exact backend's."""
    import torch.distributed as dist

    n = dist.get_world_size()
    out = {}
    for name, cls in (("exact", QuantizedCommBackend.__mro__[1]), ("quantized", QuantizedCommBackend)):
        comm = cls(dist.group.WORLD)
        for dtype in (torch.float32, torch.bfloat16):
            comm.stats.end_step()
            comm.all_gather_params(torch.empty(1000 * n, dtype=dtype), torch.ones(1000, dtype=dtype))
            comm.reduce_scatter_grads(torch.empty(1000, dtype=dtype), torch.ones(1000 * n, dtype=dtype))
            out[name, dtype] = comm.stats.summary(comm.stats.end_step())
    return out


def _train_worker():
    """The zoo GPT on 2 ranks: the exact backend and the quantized one (losses, bytes per step), and with lr=0 at
    stages 3 and 1 (the masters, gathered exactly afterwards, must be the initial values bit for bit); then
    :func:`_bytes_worker`'s counts."""
    from zero_core.testing.parity import train_sharded

    plugins = [zero_comm_quantized.plugin]
    chunk = ChunkPolicy(chunk_size=300)
    runs = {name: train_sharded("gpt", config=ZeroConfig(chunk=chunk, comm_backend=name), steps=8, plugins=plugins)
            for name in ("torch", "quantized")}
    frozen = {stage: train_sharded("gpt", config=ZeroConfig(stage=stage, chunk=chunk, comm_backend="quantized"),
                                   steps=2, lr=0.0, plugins=plugins) for stage in (3, 1)}
    frozen["initial"] = train_sharded("gpt", config=ZeroConfig(chunk=chunk), steps=1, lr=0.0)
    return (runs, frozen), _bytes_worker()


@pytest.fixture(scope="module")
def two_rank_runs():
    return run_distributed(_train_worker, 2, timeout=300)[0]


def test_bytes_are_int8_codes_plus_fp32_scales(two_rank_runs):
    """One gather of 1,000 values a rank and one reduce-scatter to 1,000, at 2 ranks: each rank sends its row of
    1,000 codes and 4 scales (block 256), 1,016 bytes, against 4,000 (fp32) or 2,000 (bf16) exact."""
    _, counted = two_rank_runs
    quantized_row = 1000 + 4 * 4
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        assert counted["exact", dtype]["all_gather"] == {"calls": 1, "bytes_sent": 1000 * size}
        assert counted["exact", dtype]["reduce_scatter"] == {"calls": 1, "bytes_sent": 1000 * size}
        assert counted["quantized", dtype]["all_gather"] == {"calls": 1, "bytes_sent": quantized_row}
        assert counted["quantized", dtype]["reduce_scatter"] == {"calls": 1, "bytes_sent": quantized_row}
    # a quarter of fp32 plus the scales; half of bf16 plus the scales
    assert quantized_row / (1000 * 4) == 0.254 and quantized_row / (1000 * 2) == 0.508


def test_training_bytes_and_losses_against_the_exact_backend(two_rank_runs):
    """Every step's parameter gathers and gradient reduce-scatters send exactly int8 codes plus one fp32 scale per
    256 values of each shard; the losses of 8 steps stay within 1% of the exact backend's, yet differ (the
    quantized path ran)."""
    (runs, _), _ = two_rank_runs
    exact, quantized = runs["torch"], runs["quantized"]
    shards = [c["size"] // 2 for c in quantized.chunks]  # every zoo GPT chunk has gradients
    assert all(c["requires_grad"] for c in quantized.chunks)
    for step_exact, step_quantized in zip(exact.step_stats, quantized.step_stats, strict=True):
        gathers = step_exact["all_gather"]["calls"]
        assert step_quantized["all_gather"]["calls"] == gathers and gathers % len(shards) == 0
        per_chunk = gathers // len(shards)  # stage 3 gathers every chunk the same number of times a step
        assert step_exact["all_gather"]["bytes_sent"] == per_chunk * sum(4 * s for s in shards)
        assert step_quantized["all_gather"]["bytes_sent"] == per_chunk * sum(row_bytes(s, 256) for s in shards)
        assert step_quantized["reduce_scatter"] == {"calls": len(shards),
                                                    "bytes_sent": sum(row_bytes(s, 256) for s in shards)}
    for a, b in zip(exact.losses, quantized.losses, strict=True):
        assert abs(a - b) <= 0.01 * a, (exact.losses, quantized.losses)
    assert exact.losses != quantized.losses
    # zero_core.estimate predicts those bytes from the backend's estimate_bytes_sent
    predicted = _estimate(ZeroConfig(chunk=ChunkPolicy(chunk_size=300), comm_backend="quantized"))
    assert predicted.bytes_sent == {kind: quantized.step_stats[-1][kind]["bytes_sent"] for kind in predicted.bytes_sent}


def _estimate(config):
    from zero_core import estimate
    from zero_core.testing.parity import make_optimizer
    from zero_core.testing.zoo import get_case

    case = get_case("gpt")
    model = case.build()
    return estimate(model, world_size=2, config=config, optimizer=make_optimizer(case, model),
                    plugins=ZeroPlugins.load([zero_comm_quantized.plugin]))


def test_masters_stay_exact(two_rank_runs):
    """With lr=0 the optimizer leaves the masters as they were, so whatever the quantized collectives sent, the
    parameters read back (by exact gathers of the masters) are the initial ones bit for bit: at stage 3 and at
    stage 1, whose after-step gather runs in place over the master's own row."""
    (_, frozen), _ = two_rank_runs
    initial = frozen.pop("initial").params
    for stage, result in frozen.items():
        assert result.params.keys() == initial.keys()
        for name, value in initial.items():
            assert torch.equal(result.params[name], value), (stage, name)
        # the masters kept apart at stage 1 (see CommBackend.params_exact), as zero_core.estimate predicts
        predicted = _estimate(ZeroConfig(stage=stage, chunk=ChunkPolicy(chunk_size=300), comm_backend="quantized"))
        held = {kind: result.model_state_bytes[kind] for kind in predicted.per_rank[0]}
        assert held == predicted.per_rank[0], (stage, held, predicted.per_rank[0])
