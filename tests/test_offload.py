"""zero-offload's policies with the chunk and tensor strategies: parity with no offload, the disk tier's memory,
the divergence fallback, and bad input (the device budget held at every operator: tests/test_gemini_budget.py).

Parity is against one-process training on the whole batch (fp32, 1e-5 relative), the same
reference every strategy is held to; offloading must change where bytes live, never a value.
"""

import os

import pytest
import torch
import torch.distributed as dist

from zero_core import ChunkPolicy, ZeroConfig, shard
from zero_core.testing import assert_parity, device_under_test, rank_device, run_distributed, train_reference, train_sharded
from zero_core.testing.gpt import GPT, GPTConfig
from zero_offload import DeviceBudgetError, DiskTierError, TierBudgetError

# Budgets for the zoo's tiny GPT at 2 ranks (chunks of 300 elements): the warm-up step needs about
# 0.128 MiB of device memory at its peak (reductions in flight and a gather's receive buffer, which the
# copy-out empties, included), so 0.14 leaves room to cache a few shards, which must be evicted again at
# every step; the host budget holds the gradients and the disk reads, not the rest.
# On CUDA the same step needs 0.149 MiB (measured on an H200): the caching allocator rounds every block up to
# 512 bytes, so the budget keeps the CPU's room above the peak instead of its figure.
TIGHT_DEVICE = 0.14 if device_under_test() == "cpu" else 0.175
SMALL_HOST = 0.04
# The disk-tier tests are about the host budget: a device budget their step fits in (the 63M-parameter model's step
# needed 455 MiB on an H200, and 311 MiB on the CPU with the comm backends' buffers counted).
_ROOMY_DEVICE = 400 if device_under_test() == "cpu" else 600
# The tensor strategy's gemini run at 2 ranks. On an H200 it needed 42.1 MB while its reduce-scatter buckets took the
# whole reduce_bucket_mb (39.3 MB); they are now sized to the model. The CUDA figure since is not measured yet.
TENSOR_GEMINI_DEVICE = 0.25 if device_under_test() == "cpu" else 4

CONFIGS = {
    "static-full": ("static", {"offload_optim_frac": 1.0, "offload_param_frac": 1.0}),
    "static-partial": ("static", {"shard_param_frac": 0.5, "offload_optim_frac": 0.5, "offload_param_frac": 0.25}),
    "static-disk": ("static", {"offload_optim_frac": 1.0, "offload_param_frac": 1.0, "host_budget_mb": SMALL_HOST, "disk": True}),
    "gemini-tight": ("gemini", {"device_budget_mb": TIGHT_DEVICE}),
    "gemini-margin": ("gemini", {"device_budget_mb": 0.2, "margin_ratio": 0.5}),
    "gemini-disk": ("gemini", {"device_budget_mb": TIGHT_DEVICE, "host_budget_mb": SMALL_HOST, "disk": True}),
}


def _config(name, tmp_path, strategy="chunk", stage=3):
    placement, options = CONFIGS[name]
    options = dict(options)
    if options.pop("disk", False):
        options["disk_dir"] = str(tmp_path)
    return ZeroConfig(stage=stage, strategy=strategy, chunk=ChunkPolicy(chunk_size=300), placement=placement,
                      placement_options=options)


@pytest.fixture(scope="module")
def reference():
    return train_reference("gpt")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_offloaded_training_equals_plain_training(name, world, reference, tmp_path):
    config = _config(name, tmp_path)
    if world == 1:  # one rank holds twice the shards and computes the whole batch
        options = dict(config.placement_options)
        if name.startswith("gemini"):
            options["device_budget_mb"] = 0.25
        if "host_budget_mb" in options:
            options["host_budget_mb"] = 2 * SMALL_HOST
        config = config.replace(placement_options=options)
    results = run_distributed(train_sharded, world, "gpt", config=config, timeout=300)
    for result in results:
        assert_parity(reference, result, label=f"{name} world {world}")
    report = results[0].placement
    if "disk" in name:  # the disk tier was really used, within the host budget
        assert report["disk_bytes_written"] > 0 and report["disk_bytes_read"] > 0
        assert report["peak"]["host"] <= report["budget"]["host"]
    if name == "gemini-tight" and world == 2:  # shards cached at some points are evicted at others, every step
        assert report["promotions"] > 0 and report["evictions"] >= 3  # 4 steps, the first one a warm-up
    if name == "gemini-margin":
        assert report["pinned"], "the margin space should hold some chunks' optimizer states"


@pytest.mark.parametrize("optimizer", ["adamw_fused", "adam_foreach", "sgd", "adagrad"])
@pytest.mark.parametrize("name", ["static-disk", "gemini-margin"])
def test_every_optimizer_steps_where_its_states_are(name, optimizer, tmp_path):
    """torch's fused and foreach kernels, momentum and Adagrad's eagerly created state, on host, device and disk."""
    results = run_distributed(train_sharded, 2, "gpt", config=_config(name, tmp_path), optimizer=optimizer, timeout=300)
    assert_parity(train_reference("gpt", optimizer=optimizer), results[0], label=f"{name} {optimizer}")


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", ["static-partial", "gemini-disk"])
def test_lower_stages_offload_too(name, stage, reference, tmp_path):
    config = _config(name, tmp_path, stage=stage)
    if name.startswith("gemini"):  # stages 1 and 2 keep every full buffer on the device
        config = config.replace(placement_options={**config.placement_options, "device_budget_mb": 0.3})
    results = run_distributed(train_sharded, 2, "gpt", config=config, timeout=300)
    assert_parity(reference, results[0], label=f"{name} stage {stage}")


@pytest.mark.parametrize("name", ["static-full", "gemini-tight"])
def test_the_tensor_strategy_uses_the_same_policies(name, reference, tmp_path):
    config = _config(name, tmp_path, strategy="tensor")
    if name.startswith("gemini"):  # the warm-up needs 0.201 MiB here, the reduce-scatter buckets included
        config = config.replace(placement_options={"device_budget_mb": TENSOR_GEMINI_DEVICE})
    results = run_distributed(train_sharded, 2, "gpt", config=config, timeout=300)
    assert_parity(reference, results[0], label=f"tensor {name}")


def test_a_dynamic_graph_falls_back_with_a_log_line():
    """The zoo's 'unused' model routes samples to experts by content: its compute sequence changes between steps."""
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=64), placement="gemini", placement_options={"device_budget_mb": 1})
    results = run_distributed(train_sharded, 2, "unused", config=config, steps=6, timeout=300)
    assert_parity(train_reference("unused", steps=6), results[0])
    assert any(r.placement["diverged"] for r in results)


def _budget_worker(device_budget_mb):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=4096), placement="gemini", placement_options={"device_budget_mb": device_budget_mb})
    try:
        model, opt = shard(model, opt, config=config)
    except DeviceBudgetError as e:
        return str(e), None
    before = model.full_parameters()
    model(torch.randn(512, 64, device=rank_device())).square().mean().backward()
    try:
        opt.step()
    except DeviceBudgetError as e:
        after = model.full_parameters()
        return str(e), all(torch.equal(before[k], after[k]) for k in before)
    return None, None


def test_a_budget_below_one_chunk_fails_at_setup():
    for message, stepped in run_distributed(_budget_worker, 2, 0.01, timeout=120):
        assert stepped is None  # shard() itself refused
        assert "below one gather group's buffers and gradient buffers" in message and "Raise device_budget_mb" in message


def test_a_budget_below_the_measured_peak_fails_before_the_first_step():
    results = run_distributed(_budget_worker, 2, 0.3, timeout=120)
    for message, unchanged in results:
        assert message is not None and "below what the warm-up step needed at its peak" in message
        assert "The smallest budget that trains is device_budget_mb=" in message
        assert unchanged  # nothing was stepped


def test_a_host_budget_too_small_for_the_gradients_names_the_minimum(tmp_path):
    config = _config("static-disk", tmp_path).replace(
        placement_options={"offload_optim_frac": 1.0, "offload_param_frac": 1.0, "host_budget_mb": 0.001, "disk_dir": str(tmp_path)})
    with pytest.raises(TierBudgetError, match="cannot hold the offloaded gradients .* raise host_budget_mb to at least"):
        train_sharded("gpt", config=config)


def _full_disk(path):
    from collections import namedtuple

    return namedtuple("usage", "total used free")(1, 1, 10)


def _full_disk_worker(disk_dir):
    import shutil as real_shutil

    import zero_offload._base as base

    config = _config("static-disk", None).replace(placement_options={
        "offload_optim_frac": 1.0, "offload_param_frac": 1.0, "host_budget_mb": SMALL_HOST, "disk_dir": disk_dir})
    from zero_core.testing.parity import make_optimizer
    from zero_core.testing.zoo import get_case

    case = get_case("gpt")
    torch.manual_seed(0)
    model = case.build()
    model, opt = shard(model, make_optimizer(case, model), config=config)
    rank = dist.get_rank()
    for step in range(3):
        inputs, targets = (t.to(rank_device()) for t in case.batch(step, 8))
        opt.zero_grad()
        case.loss(model(inputs[rank * 4:(rank + 1) * 4]), targets[rank * 4:(rank + 1) * 4]).backward()
        if step == 2:  # the disk fills up before the third step
            before = model.full_parameters()
            base.shutil = type("S", (), {"disk_usage": staticmethod(_full_disk)})
            try:
                opt.step()
            except DiskTierError as e:
                base.shutil = real_shutil
                after = model.full_parameters()
                return str(e), all(torch.equal(before[k], after[k]) for k in before)
        opt.step()
    return None, None


def test_a_full_disk_mid_run_fails_before_the_step_with_the_state_intact(tmp_path):
    results = run_distributed(_full_disk_worker, 2, str(tmp_path), timeout=300)
    for message, unchanged in results:
        assert message is not None and "disk tier" in message and "full" in message, message
        assert unchanged


def _rss_worker(disk_dir, host_budget_mb):
    import ctypes

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    # Measure live memory, not glibc's retention: buffers above 64 KiB are mapped and unmapped
    # on free (M_MMAP_THRESHOLD), as a long-running trainer would configure its allocator.
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)
    torch.manual_seed(0)
    baseline = status("VmRSS:")
    model = GPT(GPTConfig(vocab_size=8192, seq_len=64, d_model=768, n_layer=8, n_head=12))
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # release_host_memory=False: this test sets malloc itself (a lower threshold than shard()'s)
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=1 << 20), placement="gemini", release_host_memory=False,
                        placement_options={"device_budget_mb": _ROOMY_DEVICE, "host_budget_mb": host_budget_mb, "disk_dir": disk_dir})
    model, opt = shard(model, opt, config=config)
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, 8192, (4, 65), generator=g).to(rank_device())
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    report = model.engine.placement.report()
    model.engine.close()
    return {"peak_rss": status("VmHWM:") - baseline, "model_states": 16 * n_params // world,
            "activations": report["non_model_peak"], "report": report, "losses": losses}


def test_the_disk_tier_trains_a_model_whose_states_exceed_the_host_budget(tmp_path):
    """63M parameters, AdamW, 2 ranks: 504 MB of model states per rank against a 256 MiB host budget."""
    results = run_distributed(_rss_worker, 2, str(tmp_path), 256, timeout=600)
    for result in results:
        report = result["report"]
        assert report["budget"]["host"] < result["model_states"]
        assert report["peak"]["host"] <= report["budget"]["host"]
        assert report["used"]["disk"] > 0 and report["disk_bytes_written"] > result["model_states"] // 2
        assert all(torch.isfinite(torch.tensor(result["losses"])))
        # measured: the process grew (model built whole included) by less than its model states plus the activations
        assert result["peak_rss"] < result["model_states"] + result["activations"], result
    assert not os.listdir(tmp_path)  # each rank's private directory was removed


def _eval_between_steps_worker():
    from zero_core.testing.parity import make_optimizer
    from zero_core.testing.zoo import get_case

    case = get_case("gpt")
    torch.manual_seed(0)
    model = case.build()
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=300), placement="gemini", placement_options={"device_budget_mb": TIGHT_DEVICE})
    model, opt = shard(model, make_optimizer(case, model), config=config)
    rank = dist.get_rank()
    evaluated = []
    for step in range(4):
        inputs, targets = (t.to(rank_device()) for t in case.batch(step, 8))
        opt.zero_grad()
        case.loss(model(inputs[rank * 4:(rank + 1) * 4]), targets[rank * 4:(rank + 1) * 4]).backward()
        opt.step()
        with torch.no_grad():  # evaluation between steps is not part of the traced step
            evaluated.append(case.loss(model(inputs), targets).item())
    report = model.engine.placement.report()
    model.close()
    return report, evaluated


def test_evaluation_between_steps_is_not_a_divergence():
    for report, evaluated in run_distributed(_eval_between_steps_worker, 2, timeout=300):
        assert not report["diverged"]
        assert report["evictions"] > 0  # still caching and evicting by the trace
        assert all(torch.isfinite(torch.tensor(evaluated)))


@pytest.mark.parametrize("world, stage, options", [
    (1, 3, {"offload_optim_frac": 1.0, "offload_param_frac": 1.0, "host_budget_mb": 0.09}),
    (2, 2, {"offload_optim_frac": 1.0, "offload_param_frac": 1.0, "host_budget_mb": SMALL_HOST}),
    (2, 3, {"shard_param_frac": 0.5, "offload_optim_frac": 1.0, "offload_param_frac": 1.0, "host_budget_mb": 0.035}),
])
def test_kept_full_buffers_with_shards_on_disk(world, stage, options, reference, tmp_path):
    """Chunks that stay gathered (one rank, stages 1-2, shard_param_frac < 1) step their disk shards one at a time,
    refresh the kept buffer from each, and write it back at once: the host budget holds through every step."""
    config = ZeroConfig(stage=stage, chunk=ChunkPolicy(chunk_size=300), placement="static",
                        placement_options={**options, "disk_dir": str(tmp_path)})
    results = run_distributed(train_sharded, world, "gpt", config=config, timeout=300)
    for result in results:
        assert_parity(reference, result, label=f"world {world} stage {stage}")
        report = result.placement
        assert report["peak"]["host"] <= report["budget"]["host"], report
        assert report["used"]["disk"] > 0


def _comm_buffers_worker():
    from zero_core.interfaces._inspection import device_bytes
    from zero_core.testing.parity import make_optimizer
    from zero_core.testing.zoo import get_case

    case = get_case("gpt")
    torch.manual_seed(0)
    model = case.build()
    config = ZeroConfig(strategy="tensor", placement="gemini", placement_options={"device_budget_mb": 1000})
    model, opt = shard(model, make_optimizer(case, model), config=config)
    engine, rank = model.engine, dist.get_rank()
    bucketer = engine.reduce_comm.bucketer
    held = {"limit": sum(c.gather_numel for c in engine.chunks), "capacity": bucketer.capacity(torch.float32, 2)}

    def sample(grad):  # the embedding's output gradient: late in the backward, the later blocks' inputs bucketed
        held.update(buckets=[b.nbytes for b in bucketer.buckets], engine=device_bytes(engine.chunks),
                    comms=engine.comm.buffer_bytes + engine.reduce_comm.buffer_bytes,
                    counted=engine.placement.context.device_bytes())

    embedding = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    embedding.register_forward_hook(lambda module, args, out: out.register_hook(sample) and None)
    inputs, targets = (t.to(rank_device()) for t in case.batch(0, 8))
    case.loss(model(inputs[rank * 4:(rank + 1) * 4]), targets[rank * 4:(rank + 1) * 4]).backward()
    opt.step()
    held["after_step"] = engine.reduce_comm.buffer_bytes
    model.close()
    return held


def test_the_comm_backends_buffers_are_engine_memory_and_buckets_fit_the_model():
    """The bucketed backend's buckets were ``reduce_bucket_mb`` (25 MiB) for any model, and gemini did not count
    them: on an H200 the tensor strategy's plan for a 6.6K-parameter model needed 42 MB. Now a bucket holds at most
    what one backward reduces, and every comm backend's buffers count as the engine's device memory."""
    for held in run_distributed(_comm_buffers_worker, 2, timeout=120):
        assert held["capacity"] == held["limit"]  # one backward's worth per rank, not 25 MiB
        assert held["buckets"] and all(b == 0 or b == 3 * held["limit"] * 4 for b in held["buckets"])  # (2 + 1) rows
        assert held["comms"] >= sum(held["buckets"]) > 0
        assert held["counted"] == held["engine"] + held["comms"]
        assert held["after_step"] == 0  # freed with the engine's idle buffers after the step
