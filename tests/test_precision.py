"""Loss scaling for fp16: overflow skips the step on every rank, the scale backs off, state travels."""

import pytest
import torch
import torch.distributed as dist

from zero_core import ChunkPolicy, LossScale, Precision, ZeroConfig, ZeroError, shard
from zero_core.plugin import ZeroPlugins
from zero_core.testing import run_distributed
from zero_core.testing.zoo import get_case

STRATEGIES = ZeroPlugins.load().strategies.names()


def _fp16_model(stage, loss_scale, world=1, strategy="chunk"):
    torch.manual_seed(0)
    model = get_case("twice").build()
    config = ZeroConfig(strategy=strategy, stage=stage, precision=Precision(compute="fp16", loss_scale=loss_scale),
                        chunk=ChunkPolicy(chunk_size=64))
    return shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)


def _overflow_on_rank_1(stage, hysteresis, strategy="chunk"):
    """Rank 1 alone overflows in step 0; step 1 is clean on both ranks."""
    rank = dist.get_rank()
    model, opt = _fp16_model(stage, LossScale(init_scale=2.0**10, hysteresis=hysteresis), strategy=strategy)
    x = torch.rand(4, 6, generator=torch.Generator().manual_seed(rank))
    y = torch.tensor([0, 1, 2, 0])
    before = model.full_parameters()
    losses = torch.nn.functional.cross_entropy(model(x), y)
    model.backward(losses * (1e4 if rank == 1 else 1.0))  # x 2**10 overflows fp16 on rank 1 only
    opt.step()
    after_overflow = model.full_parameters()
    record = {
        "unchanged": all(torch.equal(before[n], after_overflow[n]) for n in before),
        "optimizer_state": sum(len(s) for s in opt.state.values()),
        "scale_after_overflow": model.loss_scaler.scale,
        "skipped": model.loss_scaler.last_step_skipped,
    }
    opt.zero_grad()
    model.backward(torch.nn.functional.cross_entropy(model(x), y))
    opt.step()
    after_clean = model.full_parameters()
    record["changed_after_clean_step"] = any(not torch.equal(after_overflow[n], after_clean[n]) for n in before)
    record["overflows"] = model.loss_scaler.overflows
    model.close()
    return record


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_overflow_on_one_rank_skips_the_step_on_every_rank(strategy, stage):
    for record in run_distributed(_overflow_on_rank_1, 2, stage, 1, strategy):
        assert record["skipped"]
        assert record["unchanged"]  # no parameter touched
        assert record["optimizer_state"] == 0  # no moment, no step counter
        assert record["scale_after_overflow"] == 2.0**9  # backed off once
        assert record["changed_after_clean_step"]
        assert record["overflows"] == 1


def test_hysteresis_delays_the_backoff():
    for record in run_distributed(_overflow_on_rank_1, 2, 3, 2):
        assert record["skipped"] and record["unchanged"]
        assert record["scale_after_overflow"] == 2.0**10  # the first overflow only uses up hysteresis


def test_scale_grows_after_clean_steps_and_travels_in_the_optimizer_state():
    model, opt = _fp16_model(3, LossScale(init_scale=8.0, growth_interval=2))
    x, y = torch.rand(4, 6), torch.tensor([0, 1, 2, 0])
    for _ in range(4):
        opt.zero_grad()
        model.backward(torch.nn.functional.cross_entropy(model(x), y))
        opt.step()
    assert model.loss_scaler.scale == 32.0
    saved = opt.state_dict()
    assert saved["zero_loss_scaler"] == {"scale": 32.0, "clean_steps": 0, "hysteresis_left": 2, "overflows": 0}
    fresh, fresh_opt = _fp16_model(3, LossScale(init_scale=8.0, growth_interval=2))
    fresh_opt.load_state_dict(saved)
    assert fresh.loss_scaler.scale == 32.0
    assert len(fresh_opt.state) == len(opt.state)


def test_fp16_refuses_an_unscaled_backward():
    model, opt = _fp16_model(2, LossScale())
    model(torch.rand(2, 6)).sum().backward()
    with pytest.raises(ZeroError, match=r"call model.backward\(loss\)"):
        opt.step()


def test_bf16_needs_no_special_backward():
    torch.manual_seed(0)
    net = get_case("twice").build()
    model, opt = shard(net, torch.optim.SGD(net.parameters(), lr=0.1),
                       config=ZeroConfig(precision=Precision(compute="bf16"), chunk=ChunkPolicy(chunk_size=64)))
    before = model.full_parameters()
    out = model(torch.rand(2, 6))  # fp32 inputs are cast to the compute dtype
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    opt.step()
    after = model.full_parameters()
    assert all(after[n].dtype == torch.float32 for n in after)  # the masters stay fp32
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert model.loss_scaler is None
