"""The quantized comm backends: the conformance kit within the int8 and int4 bounds, the wire formats, exact byte
counts at 2 and 4 ranks, masters that stay exact, and a short training run against the exact backend."""

import tomllib
from pathlib import Path

import pytest
import torch

import zero_comm_quantized.plugin
from zero_comm_quantized import Quantization, QuantizedCommBackend, QuantizedInt4CommBackend, plugin_for
from zero_comm_quantized._codec import _code_bytes, _pack_base15, _unpack_base15, dequantize_rows, quantize_rows, row_bytes
from zero_core import ConfigError, ZeroConfig
from zero_core.config.api import ChunkPolicy
from zero_core.plugin import CollectiveKind, ZeroPlugins
from zero_core.testing import CommBackendConformance, run_distributed

# A value moves by at most max|x| / 254 of its block (half a step of 127 levels); a sum by that of each rank's
# block. 1/250 leaves room for fp32's own rounding of the scale and the sum.
INT8_BOUND = 1 / 250
# int4: half a step of 7 levels, max|x| / 14, times 1 + 2**-7 for the scale rounded up to bf16 (1/13.89); 1/13.8
# leaves the same room for fp32's rounding.
INT4_BOUND = 1 / 13.8


class TestQuantizedBackend(CommBackendConformance):
    backend_class = QuantizedCommBackend
    params_tolerance = INT8_BOUND
    grads_tolerance = INT8_BOUND


class TestQuantizedInt4Backend(CommBackendConformance):
    backend_class = QuantizedInt4CommBackend
    params_tolerance = INT4_BOUND
    grads_tolerance = INT4_BOUND


@pytest.mark.parametrize(("bits", "levels", "m"), [(8, 127, 700), (4, 7, 700), (4, 7, 701)])
def test_codec_bounds_each_block_and_keeps_non_finite_blocks_non_finite(bits, levels, m):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, m, generator=g) * torch.logspace(-3, 3, m)  # blocks of very different magnitudes
    x[1, 256:512] = 0.0
    x[2, 3], x[2, 600] = float("inf"), float("nan")
    packed = torch.empty(3, row_bytes(m, 256, bits), dtype=torch.uint8)
    quantize_rows(x, packed, block=256, bits=bits)
    y = dequantize_rows(packed, m, block=256, bits=bits)
    # the codes (a byte each, or 11 in 43 bits: 63 groups' 5 low bytes, the 7 or 8 left over in 4 bytes, 63 x 3 high
    # bits in 24 bytes), then one scale per block (fp32, or bf16 for int4)
    assert row_bytes(m, 256, bits) == (m + 4 * 3 if bits == 8 else 63 * 5 + 4 + 24 + 2 * 3)
    # one row at a time (a gather's row) packs the same bytes as the rows together
    alone = torch.empty(1, packed.shape[1], dtype=torch.uint8)
    quantize_rows(x[:1], alone, block=256, bits=bits)
    assert torch.equal(alone[0], packed[0]) and torch.equal(dequantize_rows(alone, m, block=256, bits=bits), y[:1])
    # a scale is max|x| / levels, rounded up to bf16 in int4 (at most 2**-7 above): half a step
    slack = 1 + 1e-6 if bits == 8 else (1 + 2**-7) * (1 + 1e-6)
    for row in (0, 1):
        for start in range(0, m, 256):
            block = slice(start, min(start + 256, m))
            bound = x[row, block].abs().max() / (2 * levels)
            assert (y[row, block] - x[row, block]).abs().max() <= bound * slack, (row, start)
            # the block's largest magnitude is the top code: it comes back up to the scale's rounding
            top = x[row, block].abs().argmax()
            torch.testing.assert_close(y[row, block][top], x[row, block][top], rtol=1e-6 if bits == 8 else 2**-7, atol=0)
    assert torch.equal(y[1, 256:512], torch.zeros(256))  # a zero block: scale 0, no NaN
    assert y[2, :256].isnan().all() and y[2, 512:].isnan().all()  # the blocks holding inf and NaN
    assert y[2, 256:512].isfinite().all()  # a finite block of the same row is untouched by them
    assert ((y[2, 256:512] - x[2, 256:512]).abs() <= x[2, 256:512].abs().max() / (2 * levels) * slack).all()
    if bits == 4:  # each of the 15 levels round-trips (-7 to 7 times a scale of 1; a full group and a partial one)
        steps = torch.arange(-7.0, 8.0)
        packed = torch.empty(1, row_bytes(steps.numel(), 256, 4), dtype=torch.uint8)
        quantize_rows(steps.view(1, -1), packed, block=256, bits=4)
        assert torch.equal(dequantize_rows(packed, steps.numel(), block=256, bits=4)[0], steps)


def _int4_reference(x, block=256):
    """int4's values written out plainly: per block ``scale = max|x| / 7`` raised to the next bf16 (unless a bf16
    already), ``round(x / scale)`` clipped to 7 levels a side, times the scale; 0 for a zero block, NaN for a
    non-finite one."""
    rows, m = x.shape
    blocks = -(-m // block)
    values = torch.nn.functional.pad(x.float(), (0, blocks * block - m)).view(rows, blocks, block)
    exact = values.abs().amax(dim=-1, keepdim=True) / 7
    nearest = exact.to(torch.bfloat16)
    above = (nearest.view(torch.int16) + 1).view(torch.bfloat16)  # the next bf16 up, for a positive finite one
    scale = torch.where((nearest.float() < exact) & exact.isfinite(), above, nearest).float()
    codes = torch.round(values / torch.where(scale > 0, scale, 1.0)).clamp(-7, 7).nan_to_num(0.0)
    return (codes * scale).view(rows, blocks * block)[:, :m]


def test_int4_packs_11_codes_in_43_bits_losslessly():
    """[Note: the int4 wire format]: the bytes of a row laid out by hand, every byte count at odd sizes (and a quarter
    of bf16's from 780 values on), and the values of rows with zero, infinite and NaN blocks exactly those of
    plain ``round(x / scale) * scale`` (the codes and scales are unchanged; only their bytes are packed)."""
    # two rows of 12 values with a top value of 7 (scale 1): one full group of 11 codes, one code left over
    rows = torch.tensor([[7.0, -7, 0, 1, 2, 3, 4, 5, 6, -1, -2, 3], [7.0] * 12])
    packed = torch.empty(2, row_bytes(12, 256, 4), dtype=torch.uint8)
    quantize_rows(rows, packed, block=256, bits=4)
    for row, got in zip(rows.tolist(), packed.tolist(), strict=True):
        v = sum((int(c) + 7) * 15**j for j, c in enumerate(row[:11]))  # below 15**11 < 2**43
        # 5 low bytes, the leftover code's digit in 1 byte, the group's 3 high bits in 1 byte, the bf16 scale 1.0
        assert got == [*(v & (2**40 - 1)).to_bytes(5, "little"), int(row[11]) + 7, v >> 40, 0x80, 0x3F], row
    assert (15**11 - 1) >> 40 == 7  # the second row's group: every high bit in use
    assert torch.equal(dequantize_rows(packed, 12, block=256, bits=4), rows)
    # groups on the edges of unpacking's quotients: one digit 14 or 1 among 0s (v a multiple of 15**j), all 14s
    edges = torch.cat([torch.eye(11) * 14, torch.eye(11), torch.full((1, 11), 14.0)]).repeat(1, 3)[:, :25] - 7
    packed = torch.empty(edges.shape[0], _code_bytes(25, 4), dtype=torch.uint8)
    _pack_base15(edges, packed)
    assert torch.equal(_unpack_base15(packed, 25), edges)
    # byte counts: 5 bytes per 11 values, ceil(r / 2) for the r left over, 3 bytes per 8 groups' high bits, 2 per 256
    expected = {1: 1 + 2, 10: 5 + 2, 11: 5 + 1 + 2, 12: 5 + 1 + 1 + 2, 255: 23 * 5 + 1 + 9 + 2, 256: 23 * 5 + 2 + 9 + 2,
                257: 23 * 5 + 2 + 9 + 4, 1000: 90 * 5 + 5 + 34 + 8, 4099: 372 * 5 + 4 + 140 + 34}
    assert {m: row_bytes(m, 256, 4) for m in expected} == expected
    assert max(m for m in range(1, 3000) if 2 * row_bytes(m, 256, 4) > m) == 779  # a quarter of bf16 from m = 780
    assert row_bytes(2816, 256, 4) / (2 * 2816) == 699 / 2816  # 0.248224x of bf16 where whole groups and blocks meet
    g = torch.Generator().manual_seed(0)
    for m in expected:
        x = torch.randn(3, m, generator=g) * torch.logspace(-4, 4, m)
        x[1, :256] = 0.0  # a zero block
        x[2, m // 2] = float("inf") if m % 2 else float("nan")
        packed = torch.empty(3, row_bytes(m, 256, 4), dtype=torch.uint8)
        quantize_rows(x, packed, block=256, bits=4)
        y, reference = dequantize_rows(packed, m, block=256, bits=4), _int4_reference(x)
        assert torch.equal(y.isnan(), reference.isnan()) and reference[2].isnan().any(), m
        assert torch.equal(y.nan_to_num(0.0), reference.nan_to_num(0.0)), m
        assert torch.equal(y[1, :256], torch.zeros(min(m, 256))), m


def test_settings_are_validated_and_variants_register_by_name():
    with pytest.raises(ConfigError, match="block_size"):
        Quantization(block_size=0)
    with pytest.raises(ConfigError, match="quantizes nothing"):
        Quantization(params=False, grads=False)
    with pytest.raises(ConfigError, match="True or False"):
        Quantization(grads=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"grads_bits must be 8 \(int8, the default\) or 4"):
        Quantization(grads_bits=2)
    with pytest.raises(ConfigError, match="params_bits"):
        Quantization(params_bits=True)  # type: ignore[arg-type]
    q128 = QuantizedCommBackend.variant("q128", Quantization(block_size=128))
    assert q128.quantization.block_size == 128 and QuantizedCommBackend.quantization.block_size == 256
    zeropp = QuantizedCommBackend.variant("zeropp", Quantization(grads_bits=4))  # int8 weights, int4 gradients
    registry = ZeroPlugins.load([zero_comm_quantized.plugin, plugin_for(q128, zeropp)]).comm_backends
    int4 = {"quantized-int4", "quantized-int4-params", "quantized-int4-grads"}
    assert {"quantized", "quantized-params", "quantized-grads", "q128", "zeropp", *int4} <= set(registry.names())
    assert registry.get("quantized") is QuantizedCommBackend and registry.get("q128") is q128
    assert registry.get("quantized-int4") is QuantizedInt4CommBackend
    bits = {name: (registry.get(name).quantization.params, registry.get(name).quantization.params_bits,
                   registry.get(name).quantization.grads, registry.get(name).quantization.grads_bits)
            for name in ("quantized", "zeropp", *int4)}
    assert bits == {"quantized": (True, 8, True, 8), "zeropp": (True, 8, True, 4), "quantized-int4": (True, 4, True, 4),
                    "quantized-int4-params": (True, 4, False, 8), "quantized-int4-grads": (False, 8, True, 4)}
    # installed, the same plugin module registers through the entry-point group the built-ins use
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["zero"] == {"zero-comm-quantized": "zero_comm_quantized.plugin"}
    assert project["name"] == "zero-comm-quantized"


def _bytes_worker(sizes=(1000,)):
    """Exact byte counts of one quantized gather and reduce-scatter per shard size in ``sizes``, beside the exact
    backend's, and the int4 values (which must be the exact ones within the int4 bound)."""
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    backends = (("exact", QuantizedCommBackend.__mro__[1]), ("quantized", QuantizedCommBackend),
                ("quantized-int4", QuantizedInt4CommBackend))
    for name, cls in backends:
        comm = cls(dist.group.WORLD)
        for m in sizes:
            for dtype in (torch.float32, torch.bfloat16):
                comm.stats.end_step()
                shard = torch.linspace(-1, 1, m, dtype=dtype) * (rank + 1)
                gathered, reduced = torch.empty(m * n, dtype=dtype), torch.empty(m, dtype=dtype)
                comm.all_gather_params(gathered, shard)
                comm.reduce_scatter_grads(reduced, torch.cat([shard] * n))
                key = (name, dtype) if sizes == (1000,) else (name, m, dtype)
                out[key] = comm.stats.summary(comm.stats.end_step())
                out[key, "values"] = (gathered.float(), reduced.float())
    return out


def _train_worker():
    """The zoo GPT on 2 ranks: the exact backend and the quantized one (losses, bytes per step), and with lr=0 at
    stages 3 and 1 (the masters, gathered exactly afterwards, must be the initial values bit for bit); then
    :func:`_bytes_worker`'s counts."""
    from zero_core.testing.parity import train_sharded

    plugins = [zero_comm_quantized.plugin]
    chunk = ChunkPolicy(chunk_size=300)
    runs = {name: train_sharded("gpt", config=ZeroConfig(chunk=chunk, comm_backend=name), steps=8, plugins=plugins)
            for name in ("torch", "quantized", "quantized-int4")}
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


@pytest.fixture(scope="module")
def four_rank_bytes():
    return run_distributed(_bytes_worker, 4, (1024, 1001), timeout=300)


@pytest.mark.parametrize("world", [2, 4])
def test_int4_bytes_are_packed_codes_plus_bf16_scales(world, two_rank_runs, four_rank_bytes):
    """Every rank's bytes for one gather and one reduce-scatter, at 2 and 4 ranks: (world - 1) rows of 11 codes in
    43 bits and 2 bytes of bf16 scale per 256 values. At 1,024 values a rank a row is 509 bytes: 0.24853515625x of
    bf16's 2,048 (a quarter or less) and 0.124267578125x of fp32's 4,096, where int8's 1,040 is 0.25390625x of fp32's."""
    if world == 2:  # the 2-rank run's rank 0 at 1,000 values a rank
        counted, sizes = {0: two_rank_runs[1]}, {1000: 90 * 5 + 5 + 34 + 2 * 4}
        keys = {1000: lambda name, dtype: (name, dtype)}
    else:
        counted, sizes = dict(enumerate(four_rank_bytes)), {1024: 93 * 5 + 1 + 35 + 2 * 4, 1001: 91 * 5 + 35 + 2 * 4}
        keys = {m: (lambda name, dtype, m=m: (name, m, dtype)) for m in sizes}
    assert 93 * 5 + 1 + 35 + 2 * 4 == 509 and 509 / 2048 == 0.24853515625 and 509 / 4096 == 0.124267578125
    assert all(2 * row <= m for m, row in sizes.items())  # a quarter of bf16's bytes or less
    assert (1024 + 4 * 4) / 4096 == 0.25390625  # int8 with fp32 scales, beside it
    for rank, out in counted.items():
        for m, row in sizes.items():
            key = keys[m]
            for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
                exact_bytes = (world - 1) * m * size
                assert out[key("exact", dtype)]["all_gather"] == {"calls": 1, "bytes_sent": exact_bytes}
                assert out[key("exact", dtype)]["reduce_scatter"] == {"calls": 1, "bytes_sent": exact_bytes}
                for kind in ("all_gather", "reduce_scatter"):
                    assert out[key("quantized-int4", dtype)][kind] == {"calls": 1, "bytes_sent": (world - 1) * row}, \
                        (rank, m, dtype, kind)
                    assert out[key("quantized", dtype)][kind] == {"calls": 1, "bytes_sent": (world - 1) * (m + 4 * -(-m // 256))}
                    assert QuantizedInt4CommBackend.estimate_bytes_sent(
                        CollectiveKind.ALL_GATHER if kind == "all_gather" else CollectiveKind.REDUCE_SCATTER, m,
                        element_size=size, world_size=world, config=ZeroConfig()) == (world - 1) * row
                # and the values are the exact ones within the int4 bound (rank r's shard peaks at r + 1), plus
                # one rounding to bf16 of the result where that is the dtype
                (gathered, reduced), (exact_gathered, exact_reduced) = (out[key("quantized-int4", dtype), "values"],
                                                                        out[key("exact", dtype), "values"])
                tol = INT4_BOUND + (2**-8 if dtype == torch.bfloat16 else 0.0)
                assert 0 < (gathered - exact_gathered).abs().max() <= tol * world
                assert (reduced - exact_reduced).abs().max() <= tol * sum(range(1, world + 1))


def test_training_bytes_and_losses_against_the_exact_backend(two_rank_runs):
    """Every step's parameter gathers and gradient reduce-scatters send exactly the codes (int8, or int4 11 in 43
    bits) plus one scale (fp32, or bf16) per 256 values of each shard; the losses of 8 steps stay within 1% of the
    exact backend's (measured: 0.14% int8, 0.37% int4), yet differ (the quantized path ran); ``zero estimate`` predicts the
    bytes."""
    (runs, _), _ = two_rank_runs
    exact = runs["torch"]
    for name, bits in (("quantized", 8), ("quantized-int4", 4)):
        quantized = runs[name]
        shards = [c["size"] // 2 for c in quantized.chunks]  # every zoo GPT chunk has gradients
        assert all(c["requires_grad"] for c in quantized.chunks)
        rows = sum(row_bytes(s, 256, bits) for s in shards)
        for step_exact, step_quantized in zip(exact.step_stats, quantized.step_stats, strict=True):
            gathers = step_exact["all_gather"]["calls"]
            assert step_quantized["all_gather"]["calls"] == gathers and gathers % len(shards) == 0
            per_chunk = gathers // len(shards)  # stage 3 gathers every chunk the same number of times a step
            assert step_exact["all_gather"]["bytes_sent"] == per_chunk * sum(4 * s for s in shards)
            assert step_quantized["all_gather"]["bytes_sent"] == per_chunk * rows
            assert step_quantized["reduce_scatter"] == {"calls": len(shards), "bytes_sent": rows}
        for a, b in zip(exact.losses, quantized.losses, strict=True):
            assert abs(a - b) <= 0.01 * a, (name, exact.losses, quantized.losses)
        assert exact.losses != quantized.losses
        # zero_core.estimate predicts those bytes from the backend's estimate_bytes_sent
        predicted = _estimate(ZeroConfig(chunk=ChunkPolicy(chunk_size=300), comm_backend=name))
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


def test_a_parameter_count_is_estimated_with_the_backend_s_bytes():
    """`zero estimate --params N --comm NAME` (a count, not a model): the backend decides the bytes sent, as with a
    model; fp32 values cost 1.015625 bytes in int8 and 699/1408 = 0.49645 in int4 (within 1e-7: a rank's shard of
    117,440,512 values is no multiple of 2,816, where groups of 11 and blocks of 256 meet), scales included (4 bytes each)."""
    from zero_core import ZeroConfig, estimate

    exact, int8, int4 = (estimate(7 * 2**30, world_size=64, config=ZeroConfig(comm_backend=name)).bytes_sent
                         for name in (None, "quantized", "quantized-int4"))
    for kind in ("all_gather", "reduce_scatter"):
        assert int8[kind] / exact[kind] == pytest.approx(1.015625 / 4, rel=1e-9), (kind, int8, exact)
        assert int4[kind] / exact[kind] == row_bytes(7 * 2**30 // 64, 256, 4) / (7 * 2**30 // 64 * 4), (kind, int4, exact)
        assert int4[kind] / exact[kind] == pytest.approx(699 / 1408 / 4, rel=1e-7), (kind, int4, exact)
