"""zero_core.estimate against what the bench's quick run measures, exactly, and its closed formulas.

The measured side is the bench's own worker (benchmarks/zero_bench/worker.py) on the quick
run's model and configurations (every registered strategy at every stage, every comm backend
and placement policy), so the figures the bench reports are the figures checked here.
"""

import sys
from pathlib import Path

import pytest
import torch

from zero_core import ChunkPolicy, ConfigError, Precision, ZeroConfig, ZeroPlugins, estimate
from zero_core.testing import run_distributed, train_sharded
from zero_core.testing.gpt import GPT, GPTConfig
from zero_core.testing.parity import make_optimizer
from zero_core.testing.zoo import get_case

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from zero_bench.configs import MODELS, BenchConfig, discover  # noqa: E402
from zero_bench.worker import run_config, zero_config  # noqa: E402

QUICK = MODELS["tiny"].options()


def quick_configs(precision="fp32"):
    return [c.as_dict() for c in discover(plugins=ZeroPlugins.load(), strategies=None, stages=[1, 2, 3], policies=None, comms=None,
                                          references=[], precision=precision, state_mib=5.0, size=MODELS["tiny"],
                                          placement_options={})]


def run_all(configs, steps):
    return [run_config(config, QUICK, steps=steps, warmup=1) for config in configs]


def quick_model(device="meta"):
    cfg = GPTConfig(vocab_size=QUICK["vocab"], seq_len=QUICK["seq_len"], d_model=QUICK["d_model"], n_layer=QUICK["layers"],
                    n_head=QUICK["heads"])
    with torch.device(device):
        return GPT(cfg)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_estimate_equals_the_quick_runs_measurements(precision):
    configs = quick_configs(precision)
    records = run_distributed(run_all, 2, configs, steps=2, timeout=300)[0]
    assert len(records) == len(configs) >= 9  # 2 strategies x 3 stages, a comm backend, 2+ placement policies
    for config, record in zip(configs, records):
        name = config["name"]
        assert record["status"] == "ok", (name, record["error"])
        predicted = record["estimate"]
        # recomputed here from a meta-device model: the estimate needs no real weights and no process group
        fresh = estimate(quick_model(), world_size=2, config=zero_config(config, QUICK))
        assert list(fresh.per_rank) == predicted["model_state_by_kind"], name
        assert record["model_state_by_kind"] == predicted["model_state_by_kind"], name
        assert record["model_state_bytes"] == [fresh.model_state_bytes(r) for r in range(2)], name
        sent = {k: v["bytes_sent"] for k, v in record["collectives_per_step"].items() if k != "control"}
        calls = {k: v["calls"] for k, v in record["collectives_per_step"].items() if k != "control"}
        assert sent == fresh.bytes_sent, name
        assert calls == fresh.calls, name
        assert record["bytes_sent_per_step"] == [fresh.total_bytes_sent] * 2, name
        if fresh.tiers is not None:
            assert record["model_state_by_tier"] == list(fresh.tiers), name
        else:  # the policy decides at run time (gemini measures first; a plugin may not say): only the total is predicted
            assert config["placement"] not in ("device", "host", "static"), name
            assert [sum(t.values()) for t in record["model_state_by_tier"]] == record["model_state_bytes"], name


def test_estimate_follows_kept_chunks_the_policy_moves():
    """Beyond the quick run: kept-gathered stage-3 chunks (static's shard_param_frac), some of them stepped on
    the host (their master shard then is a copy of its own beside the full buffer), and stage 1 on the host tier."""
    configs = [
        BenchConfig(name="kept", kind="zero", strategy="chunk", stage=3, placement="static",
                    placement_options={"shard_param_frac": 0.5}),
        BenchConfig(name="kept-offloaded", kind="zero", strategy="tensor", stage=3, placement="static",
                    placement_options={"shard_param_frac": 0.3, "offload_optim_frac": 0.5}),
        BenchConfig(name="host-stage-1", kind="zero", strategy="chunk", stage=1, placement="host"),
    ]
    configs = [c.as_dict() for c in configs]
    for config, record in zip(configs, run_distributed(run_all, 2, configs, steps=2, timeout=300)[0]):
        assert record["status"] == "ok", (config["name"], record["error"])
        fresh = estimate(quick_model(), world_size=2, config=zero_config(config, QUICK))
        assert record["model_state_by_kind"] == list(fresh.per_rank), config["name"]
        assert record["model_state_by_tier"] == list(fresh.tiers), config["name"]
        assert {k: v["calls"] for k, v in record["collectives_per_step"].items() if k != "control"} == fresh.calls
        assert record["bytes_sent_per_step"] == [fresh.total_bytes_sent] * 2, config["name"]


@pytest.mark.parametrize("stage", [1, 3])
def test_estimate_counts_frozen_parameters(stage):
    """Frozen chunks hold no gradient or optimizer state, and a kept frozen chunk is never refreshed."""
    config = ZeroConfig(strategy="tensor", stage=stage, comm="torch", chunk=ChunkPolicy(chunk_size=64))
    results = run_distributed(train_sharded, 2, "frozen", steps=2, config=config)
    case = get_case("frozen")
    torch.manual_seed(0)
    model = case.build()
    e = estimate(model, world_size=2, config=config, optimizer=make_optimizer(case, model))
    for rank, result in enumerate(results):
        assert {k: result.model_state_bytes[k] for k in ("params", "grads", "optimizer_states")} == e.per_rank[rank]
        step = result.step_stats[-1]
        assert {k: step[k]["calls"] for k in ("all_gather", "reduce_scatter")} == e.calls
        assert {k: step[k]["bytes_sent"] for k in ("all_gather", "reduce_scatter")} == e.bytes_sent


def test_formulas_of_zero():
    psi, n = 7_000_000_000, 64
    fp32 = {stage: estimate(psi, world_size=n, config=ZeroConfig(stage=stage)) for stage in (1, 2, 3)}
    assert fp32[3].formula["model_state_bytes"] == 16 * psi // n
    assert fp32[2].formula["model_state_bytes"] == 4 * psi + 12 * psi // n
    assert fp32[1].formula["model_state_bytes"] == 8 * psi + 8 * psi // n
    ring = (n - 1) * 4 * psi // n
    assert fp32[3].formula["bytes_sent"] == 3 * ring  # two all-gathers of parameters, one reduce-scatter of gradients
    assert fp32[1].formula["bytes_sent"] == fp32[2].formula["bytes_sent"] == 2 * ring  # DDP's all-reduce volume
    bf16 = estimate(psi, world_size=n, config=ZeroConfig(stage=3, precision=Precision(compute="bf16")))
    assert bf16.formula["bytes_sent"] == (n - 1) * (2 * 2 + 4) * psi // n  # 16-bit gathers, fp32 reduction
    assert bf16.formula["model_state_bytes"] == 16 * psi // n
    # from a count, padding is the count rounded up to the world size, all of it on the last rank
    assert fp32[3].padded_params == psi + (-psi) % n
    assert fp32[3].calls is None


def test_one_rank_sends_nothing_and_holds_everything():
    e = estimate(quick_model(), world_size=1, config=ZeroConfig(chunk=ChunkPolicy(search_interval=128)))
    assert e.total_bytes_sent == 0 and e.calls == {"all_gather": 0, "reduce_scatter": 0}
    assert e.model_state_bytes(0) == 16 * e.params + 8 * (e.padded_params - e.params)


def test_bucketed_reduce_scatter_calls_follow_the_bucket_rule():
    model = quick_model()
    chunk = ChunkPolicy(chunk_size=4096)
    each = estimate(model, world_size=4, config=ZeroConfig(chunk=chunk, comm="torch"))
    one = estimate(model, world_size=4, config=ZeroConfig(chunk=chunk, comm="bucketed", reduce_bucket_mb=25.0))
    off = estimate(model, world_size=4, config=ZeroConfig(chunk=chunk, comm="bucketed", reduce_bucket_mb=0.0))
    assert one.calls["reduce_scatter"] == 1 and off.calls["reduce_scatter"] == each.calls["reduce_scatter"] > 1
    assert one.bytes_sent == each.bytes_sent


@pytest.mark.parametrize(("model", "kwargs", "match"), [
    (0, {"world_size": 2}, "positive parameter count"),
    (10, {"world_size": 0}, "world_size >= 1"),
    (10, {"world_size": 2, "optimizer_bytes_per_element": -1}, "non-negative"),
    ("7B", {"world_size": 2}, "nn.Module or a parameter count"),
    (torch.nn.ReLU(), {"world_size": 2}, "no parameters"),
])
def test_bad_input_is_named(model, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        estimate(model, **kwargs)
