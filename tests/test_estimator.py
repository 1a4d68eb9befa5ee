"""zero_core.estimate against what the bench's quick run measures, exactly, and its closed formulas.

The measured side is the bench's own worker (benchmarks/zero_bench/worker.py) on the quick
run's model and configurations (every registered strategy at every stage, every comm backend
and placement policy, and an HSDP mesh at 4 ranks), so the figures the bench reports are the
figures checked here.
"""

import sys
from pathlib import Path

import pytest
import torch

from zero_core import ChunkPolicy, ConfigError, Precision, ZeroConfig, estimate
from zero_core.plugin import (
    ChunkPlan,
    ChunkSpec,
    CollectiveKind,
    MeshSpec,
    Reduction,
    ShardPlan,
    ShardStrategy,
    Topology,
    ZeroPlugins,
    hookimpl,
    ring_bytes_sent,
    round_up,
)
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
    config = ZeroConfig(strategy="tensor", stage=stage, comm_backend="torch", chunk=ChunkPolicy(chunk_size=64))
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
    each = estimate(model, world_size=4, config=ZeroConfig(chunk=chunk, comm_backend="torch"))
    one = estimate(model, world_size=4, config=ZeroConfig(chunk=chunk, comm_backend="bucketed", reduce_bucket_mb=25.0))
    off = estimate(model, world_size=4, config=ZeroConfig(chunk=chunk, comm_backend="bucketed", reduce_bucket_mb=0.0))
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


# ---- meshes: (R, S) shards every chunk over S ranks and replicates it over R (see [Note: estimating a mesh])


def test_estimate_equals_the_measurements_on_a_2x2_mesh():
    """HSDP at 4 ranks through the bench's worker: state per rank, and bytes and calls per collective,
    the replicas' all-reduces included, equal what the run counts."""
    configs = [BenchConfig(name=f"{strategy}-s{stage}-hsdp2x2", kind="zero", strategy=strategy, stage=stage, mesh=[2, 2]).as_dict()
               for strategy, stage in (("chunk", 1), ("chunk", 3), ("tensor", 3))]
    records = run_distributed(run_all, 4, configs, steps=2, timeout=300)[0]
    for config, record in zip(configs, records):
        name = config["name"]
        assert record["status"] == "ok", (name, record["error"])
        fresh = estimate(quick_model(), mesh_shape=(2, 2), config=zero_config(config, QUICK))
        assert record["model_state_by_kind"] == list(fresh.per_rank), name
        sent = {k: v["bytes_sent"] for k, v in record["collectives_per_step"].items() if k != "control"}
        calls = {k: v["calls"] for k, v in record["collectives_per_step"].items() if k != "control"}
        assert sent == fresh.bytes_sent and calls == fresh.calls, name
        assert fresh.bytes_sent["all_reduce"] > 0 and calls["all_reduce"] > 0, name
        assert record["bytes_sent_by_group"] == [fresh.bytes_sent_by_group] * 4, name
        assert record["bytes_sent_per_step"] == [fresh.total_bytes_sent] * 4, name
        assert record["model_state_by_tier"] == list(fresh.tiers), name


def test_mesh_formulas():
    psi, r, s = 7_000_000_000, 16, 8
    hsdp = estimate(psi, mesh_shape=(r, s))  # fp32 Adam, stage 3
    assert (hsdp.world_size, hsdp.mesh_shape, len(hsdp.per_rank)) == (r * s, (r, s), r * s)
    assert hsdp.formula["model_state_bytes"] == 16 * psi // s  # a world of S ranks
    assert hsdp.max_model_state_bytes == estimate(psi, world_size=s).max_model_state_bytes
    # the shard group's traffic is an S-rank world's; the replicas all-reduce each fp32 gradient shard
    assert hsdp.formula["bytes_sent_shard"] == 3 * (s - 1) * 4 * psi // s
    assert hsdp.formula["bytes_sent_replicate"] == 2 * (r - 1) * 4 * psi // (r * s)
    assert hsdp.formula["bytes_sent"] == hsdp.formula["bytes_sent_shard"] + hsdp.formula["bytes_sent_replicate"]
    shard_bytes = hsdp.padded_params // s * 4
    assert hsdp.bytes_sent["all_reduce"] == ring_bytes_sent(CollectiveKind.ALL_REDUCE, shard_bytes, r)
    plain = estimate(psi, world_size=s)
    assert {k: hsdp.bytes_sent[k] for k in ("all_gather", "reduce_scatter")} == plain.bytes_sent
    assert hsdp.bytes_sent_by_group == {"shard": plain.total_bytes_sent, "replicate": hsdp.bytes_sent["all_reduce"]}
    bf16 = estimate(psi, mesh_shape=(r, s), config=ZeroConfig(precision=Precision(compute="bf16", reduce="bf16")))
    assert bf16.formula["bytes_sent_replicate"] == 2 * (r - 1) * 2 * psi // (r * s)  # reduced in bf16
    assert bf16.formula["model_state_bytes"] == 16 * psi // s
    # a 1-D mesh, or (1, S), is plain sharding: no all-reduce at all
    for same in (estimate(psi, mesh_shape=(s,)), estimate(psi, mesh_shape=(1, s)), estimate(psi, world_size=s, mesh_shape=(s,))):
        assert same.mesh_shape == (1, s) and same.bytes_sent == plain.bytes_sent and same.formula == plain.formula
        assert same.bytes_sent_by_group == {"shard": plain.total_bytes_sent, "replicate": 0}


def test_mesh_of_one_rank_per_row_is_data_parallelism():
    """(W, 1): nothing to gather or reduce-scatter; the whole gradient is all-reduced over the W ranks."""
    w, psi = 4, 1_000_003
    dp = estimate(psi, mesh_shape=(w, 1))
    assert dp.bytes_sent == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 2 * (w - 1) * 4 * psi // w}
    assert dp.formula["model_state_bytes"] == 16 * psi and dp.max_model_state_bytes == 16 * psi
    model = quick_model()
    e = estimate(model, mesh_shape=(w, 1), config=ZeroConfig(chunk=ChunkPolicy(search_interval=128)))
    one = estimate(model, world_size=1, config=ZeroConfig(chunk=ChunkPolicy(search_interval=128)))
    assert list(e.per_rank) == [one.per_rank[0]] * w
    assert e.calls["all_gather"] == e.calls["reduce_scatter"] == e.bytes_sent["all_gather"] == e.bytes_sent["reduce_scatter"] == 0
    assert e.calls["all_reduce"] >= 1
    # one call per chunk; each fp32 payload is a multiple of 4 bytes, so the per-chunk rings add up exactly
    assert e.bytes_sent["all_reduce"] == ring_bytes_sent(CollectiveKind.ALL_REDUCE, 4 * one.padded_params, w)


def test_mesh_on_a_model_is_the_shard_groups_world_plus_all_reduces():
    model = quick_model()
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=4096), comm_backend="bucketed", reduce_bucket_mb=25.0)
    hsdp = estimate(model, mesh_shape=(2, 2), config=config)
    two = estimate(model, world_size=2, config=config)
    assert list(hsdp.per_rank) == [two.per_rank[0], two.per_rank[1]] * 2  # rank r holds shard r % S
    assert {k: hsdp.bytes_sent[k] for k in two.bytes_sent} == two.bytes_sent
    assert {k: hsdp.calls[k] for k in two.calls} == two.calls and two.calls["reduce_scatter"] == 1  # bucketed
    # never bucketed: one all-reduce per chunk; over 2 replicas it sends each shard once, as the reduce-scatter did
    assert hsdp.calls["all_reduce"] > 1
    assert hsdp.bytes_sent["all_reduce"] == two.bytes_sent["reduce_scatter"]


def test_inter_node_bytes():
    psi = 7_000_000_000
    bf16 = ZeroConfig(precision=Precision(compute="bf16"))
    hsdp = estimate(psi, mesh_shape=(16, 8), config=bf16)
    full = estimate(psi, world_size=128, config=bf16)
    assert hsdp.inter_node_bytes(8) == hsdp.bytes_sent_by_group["replicate"]  # gathers stay in the node
    assert full.inter_node_bytes(8) == round(full.total_bytes_sent / 8)  # 16 of a ring's 128 edges join two nodes
    assert estimate(psi, world_size=8).inter_node_bytes(8) == 0
    assert full.inter_node_bytes(1) == full.total_bytes_sent and full.inter_node_bytes(128) == 0
    # shard groups of two nodes: an eighth of their ring crosses, and all of each replica ring
    wide = estimate(psi, mesh_shape=(8, 16), config=bf16)
    assert wide.inter_node_bytes(8) == round(wide.bytes_sent_by_group["shard"] / 8 + wide.bytes_sent_by_group["replicate"])
    with pytest.raises(ConfigError, match="gpus_per_node >= 1"):
        full.inter_node_bytes(0)


class _Recording(ShardStrategy):
    """One chunk per parameter; records what it was asked, returns the chunk plans it is told to."""

    name = "recording"
    seen: list = []
    chunk_plan = None

    def plan(self, params, *, world_size, config, hook=None, topology=None):
        type(self).seen.append((world_size, topology))
        specs = tuple(ChunkSpec((p,), round_up(p.numel, world_size)) for p in params)
        plans = None if self.chunk_plan is None else (self.chunk_plan(topology),) * len(specs)
        return ShardPlan(specs, chunk_plans=plans)


class _Legacy(ShardStrategy):
    """A strategy written before meshes: its plan() takes no topology."""

    name = "legacy"

    def plan(self, params, *, world_size, config, hook=None):
        return ShardPlan(tuple(ChunkSpec((p,), round_up(p.numel, world_size)) for p in params))


class _Plugin:
    @hookimpl
    def zero_register_shard_strategies(self, registry):
        registry.add("recording", _Recording)
        registry.add("legacy", _Legacy)


def test_the_strategy_plans_for_the_shard_group_on_the_mesh():
    plugins = ZeroPlugins.load([_Plugin()])
    config = ZeroConfig(strategy="recording")
    _Recording.seen, _Recording.chunk_plan = [], None
    e = estimate(quick_model(), mesh_shape=(2, 4), config=config, plugins=plugins)
    assert _Recording.seen == [(4, Topology.of(MeshSpec.of_shape((2, 4))))]
    assert e.calls["all_reduce"] == len(list(quick_model().parameters()))
    # chunk plans on the default mesh with its reduction are what the estimator models; others are refused
    _Recording.chunk_plan = staticmethod(lambda topology: ChunkPlan(mesh=topology.default))
    assert estimate(quick_model(), mesh_shape=(2, 4), config=config, plugins=plugins).bytes_sent == e.bytes_sent
    _Recording.chunk_plan = staticmethod(lambda topology: ChunkPlan(mesh=topology.default, reduction=Reduction.ALL_REDUCE))
    with pytest.raises(ConfigError, match="chunks on the one mesh"):
        estimate(quick_model(), mesh_shape=(2, 4), config=config, plugins=plugins)
    _Recording.chunk_plan = None
    # as shard() does, a strategy whose plan() takes no topology plans a 1-D mesh only
    legacy = ZeroConfig(strategy="legacy")
    assert estimate(quick_model(), mesh_shape=(4,), config=legacy, plugins=plugins).bytes_sent == \
        estimate(quick_model(), mesh_shape=(4,), config=config, plugins=plugins).bytes_sent
    with pytest.raises(ConfigError, match="takes no topology"):
        estimate(quick_model(), mesh_shape=(2, 4), config=legacy, plugins=plugins)


def test_reshard_after_forward_other_than_true_is_refused_at_stage_3():
    for value in (False, 2):
        with pytest.raises(ConfigError, match="reshard_after_forward=True only"):
            estimate(quick_model(), mesh_shape=(2, 4), config=ZeroConfig(reshard_after_forward=value))
        with pytest.raises(ConfigError, match="reshard_after_forward=True only"):
            estimate(10**6, world_size=4, config=ZeroConfig(reshard_after_forward=value))
    # no release, nothing to reshard: stage 2 and a shard group of one rank
    estimate(10**6, world_size=4, config=ZeroConfig(stage=2, reshard_after_forward=False))
    estimate(10**6, mesh_shape=(4, 1), config=ZeroConfig(reshard_after_forward=False))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({}, "world_size=N .* or mesh_shape"),
    ({"mesh_shape": (2, 0)}, "positive ints"),
    ({"mesh_shape": (2, 2, 2)}, "positive ints"),
    ({"mesh_shape": ()}, "positive ints"),
    ({"mesh_shape": "22"}, "positive ints"),
    ({"mesh_shape": 4}, "positive ints"),
    ({"mesh_shape": (2.0, 2)}, "positive ints"),
    ({"mesh_shape": (True, 2)}, "positive ints"),
    ({"mesh_shape": (2, 2), "world_size": 8}, "spans 4 ranks"),
    ({"mesh_shape": (2, 2), "world_size": 0}, "world_size >= 1"),
])
def test_bad_mesh_is_named(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        estimate(10**6, **kwargs)
