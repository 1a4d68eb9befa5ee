"""Sharded checkpoints: resume equivalence, resharding across world sizes, strategies, chunk sizes and policies.

The reference is the saving run itself, which trains k steps, saves and trains j more
without stopping (so saving must not disturb training either). Resuming at the same world size and layout must be bitwise identical;
anything else (other world size, strategy, chunk size) changes the order of float
sums, so losses and parameters must agree within 1e-6 relative.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_offload import TIGHT_DEVICE  # the tight gemini budget, per device

from zero_core import ChunkPolicy, LossScale, Precision, ZeroConfig
from zero_core.testing import device_under_test, run_distributed
from zero_core.testing.checkpointing import phase

K, J = 2, 2
RTOL = 1e-6


def _config(strategy="chunk", chunk_size=300, stage=3, **kwargs):
    return ZeroConfig(strategy=strategy, stage=stage, chunk=ChunkPolicy(chunk_size=chunk_size), **kwargs)


def _run(world, case, config, directory, mode, **kwargs):
    return run_distributed(phase, world, case, config, str(directory), mode=mode, k=K, j=J, **kwargs)[0]


def _assert_close(resumed, reference, *, bitwise):
    expected = reference["losses"][K:]
    if bitwise:
        assert resumed["losses"] == expected
        for name, value in reference["params"].items():
            assert torch.equal(resumed["params"][name], value), name
        return
    for got, want in zip(resumed["losses"], expected, strict=True):
        assert abs(got - want) <= RTOL * abs(want), (resumed["losses"], expected)
    for name, value in reference["params"].items():
        scale = value.abs().max().clamp_min(1e-12)
        err = ((resumed["params"][name] - value).abs().max() / scale).item()
        assert err <= RTOL, f"{name}: {err:.3g} relative"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_resume_at_the_same_world_size_is_bitwise(world, tmp_path):
    config = _config()
    reference = _run(world, "gpt", config, tmp_path, "straight")
    _run(world, "gpt", config, tmp_path, "save", extra={"epoch": 3, "lr": [0.1]})
    resumed = _run(world, "gpt", config, tmp_path, "load")
    _assert_close(resumed, reference, bitwise=True)
    assert resumed["extra"] == {"epoch": 3, "lr": [0.1]}
    assert resumed["step"] == K + J  # the engine's step count was restored, then advanced


@pytest.mark.parametrize(("saved", "loaded"), [(4, 2), (2, 4), (1, 4), (2, 1)])
def test_resharding_between_world_sizes(saved, loaded, tmp_path):
    config = _config()
    reference = _run(saved, "gpt", config, tmp_path, "save")
    _assert_close(_run(loaded, "gpt", config, tmp_path, "load"), reference, bitwise=False)


@pytest.mark.parametrize(("saved", "loaded"), [(4, 2), (2, 4)])
def test_resharding_sizes_that_divide_nothing(saved, loaded, tmp_path):
    """odd_sizes has prime-sized layers: no world size divides a parameter, a chunk or the total."""
    config = _config(chunk_size=50)
    reference = _run(saved, "odd_sizes", config, tmp_path, "save")
    _assert_close(_run(loaded, "odd_sizes", config, tmp_path, "load"), reference, bitwise=False)


@pytest.mark.parametrize(("before", "after", "world_after"), [
    (_config("chunk", 300), _config("tensor", None), 2),
    (_config("tensor", None), _config("chunk", 128), 4),
    (_config("chunk", 300, stage=2), _config("chunk", 1000, stage=1), 1),
])
def test_resharding_across_strategies_stages_and_chunk_sizes(before, after, world_after, tmp_path):
    reference = _run(2, "gpt", before, tmp_path, "save")
    _assert_close(_run(world_after, "gpt", after, tmp_path, "load"), reference, bitwise=False)


@pytest.mark.parametrize("case", ["frozen", "unused", "buffers"])
def test_zoo_models_resume_bitwise(case, tmp_path):
    """Frozen parameters and param groups, parameters without gradients, buffers, reused layers."""
    config = _config(chunk_size=64)
    reference = _run(2, case, config, tmp_path, "save")
    _assert_close(_run(2, case, config, tmp_path, "load"), reference, bitwise=True)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adamw_fused"])
def test_optimizers_resume_bitwise(optimizer, tmp_path):
    config = _config()
    reference = _run(2, "gpt", config, tmp_path, "save", optimizer=optimizer)
    _assert_close(_run(2, "gpt", config, tmp_path, "load", optimizer=optimizer), reference, bitwise=True)


def test_optimizer_state_reshards_with_its_parameters(tmp_path):
    """Adam's moments and step counts reach a different world size intact (a fresh optimizer would diverge)."""
    config = _config()
    reference = _run(2, "gpt", config, tmp_path, "save")
    metadata = json.loads((tmp_path / "zero_checkpoint.json").read_text())
    assert metadata["optimizer"]["state_keys"]["wte.weight"] == ["exp_avg", "exp_avg_sq"]
    assert metadata["optimizer"]["scalars"]["wte.weight"]["step"]["value"] == K
    resumed = _run(4, "gpt", config, tmp_path, "load")
    _assert_close(resumed, reference, bitwise=False)


def test_fp16_loss_scaler_state_is_restored(tmp_path):
    precision = Precision(compute="fp16", loss_scale=LossScale(init_scale=2.0**20, growth_interval=1, hysteresis=1))
    config = _config(precision=precision)
    reference = _run(2, "gpt", config, tmp_path, "straight")
    saved = run_distributed(phase, 2, "gpt", config, str(tmp_path), mode="save", k=K)[0]  # stops at the save
    resumed = _run(2, "gpt", config, tmp_path, "load")
    metadata = json.loads((tmp_path / "zero_checkpoint.json").read_text())
    assert metadata["loss_scaler"]["scale"] == saved["scale"]
    assert resumed["scale"] == reference["scale"]
    _assert_close(resumed, reference, bitwise=True)


def test_bf16_checkpoints_keep_fp32_masters(tmp_path):
    config = _config(precision=Precision(compute="bf16"))
    reference = _run(2, "gpt", config, tmp_path, "save")
    metadata = json.loads((tmp_path / "zero_checkpoint.json").read_text())
    assert {p["dtype"] for p in metadata["params"].values()} == {"float32"}
    _assert_close(_run(2, "gpt", config, tmp_path, "load"), reference, bitwise=True)


@pytest.mark.parametrize(("before", "after"), [
    ("static-disk", "device"),
    ("device", "gemini-disk"),
    ("gemini-margin", "static-partial"),
])
def test_resume_across_placement_policies(before, after, tmp_path):
    def config(name):
        if name == "device":
            return _config()
        options = {
            "static-disk": {"offload_optim_frac": 1.0, "offload_param_frac": 1.0, "host_budget_mb": 0.04,
                            "disk_dir": str(tmp_path / "tier")},
            "gemini-disk": {"device_budget_mb": TIGHT_DEVICE, "host_budget_mb": 0.04, "disk_dir": str(tmp_path / "tier")},
            "gemini-margin": {"device_budget_mb": 0.2, "margin_ratio": 0.5},
            "static-partial": {"shard_param_frac": 0.5, "offload_optim_frac": 0.5, "offload_param_frac": 0.25},
        }[name]
        return _config(placement=name.split("-")[0], placement_options=options)

    ckpt = tmp_path / "ckpt"
    reference = _run(2, "gpt", config(before), ckpt, "save")
    # On CUDA the steps after the resume run where the other policy puts the optimizer states (the host's
    # Adam against the GPU's), which round differently; on the CPU host and device are one.
    _assert_close(_run(2, "gpt", config(after), ckpt, "load"), reference, bitwise=device_under_test() == "cpu")


def _rng_worker(directory, mode):
    import torch.distributed as dist

    from zero_core import load_checkpoint, save_checkpoint
    from zero_core.testing.checkpointing import build

    rank = dist.get_rank()
    model, opt = build("gpt", _config(), seed=100 + rank if mode == "save" else 7)
    if mode == "save":
        torch.rand(5 + 3 * rank)  # each rank's generator somewhere else
        save_checkpoint(model, opt, directory)
    else:
        load_checkpoint(model, opt, directory)
    state = torch.random.get_rng_state()
    model.close()
    return state


def test_random_state_is_restored_per_rank(tmp_path):
    saved = run_distributed(_rng_worker, 2, str(tmp_path), "save")
    resumed = run_distributed(_rng_worker, 2, str(tmp_path), "load")
    assert not torch.equal(saved[0], saved[1])
    for rank in range(2):  # each rank's generator is where that rank's was when the checkpoint was saved
        assert torch.equal(saved[rank], resumed[rank])


def test_saving_again_replaces_the_checkpoint_and_removes_the_old_files(tmp_path):
    config = _config()
    _run(2, "gpt", config, tmp_path, "save")
    first = json.loads((tmp_path / "zero_checkpoint.json").read_text())["save_id"]
    _run(2, "gpt", config, tmp_path, "save")
    second = json.loads((tmp_path / "zero_checkpoint.json").read_text())["save_id"]
    assert first != second
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([f"{second}.rank00000-of-00002.safetensors", f"{second}.rank00001-of-00002.safetensors",
                            "zero_checkpoint.json"])


def _weights_only(directory, save):
    from zero_core import CheckpointError, load_checkpoint, save_checkpoint
    from zero_core.testing.checkpointing import build, train_steps
    from zero_core.testing.zoo import get_case

    case = get_case("gpt")
    model, opt = build(case, _config())
    if save:
        train_steps(model, opt, case, 0, 2)
        save_checkpoint(model, None, directory)
        result = model.full_parameters()
    else:
        try:
            load_checkpoint(model, opt, directory)
            result = None
        except CheckpointError as exc:
            result = str(exc)
        load_checkpoint(model, None, directory)
        result = (result, model.full_parameters(), len(opt.state))
    model.close()
    return result


def test_parameters_only_checkpoint(tmp_path):
    saved = run_distributed(_weights_only, 2, str(tmp_path), True)[0]
    assert json.loads((tmp_path / "zero_checkpoint.json").read_text())["optimizer"] is None
    message, params, states = run_distributed(_weights_only, 2, str(tmp_path), False)[0]
    assert "saved without optimizer states" in message and "optimizer=None" in message
    assert states == 0  # the optimizer was left as it was
    for name, value in saved.items():
        assert torch.equal(params[name], value), name


def _tied_into_untied(directory):
    from zero_core import load_checkpoint
    from zero_core.testing.checkpointing import build
    from zero_core.testing.zoo import ZooCase, get_case

    tied = get_case("gpt")

    def untied():
        model = tied.build()
        model.head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
        return model

    model, opt = build(ZooCase("gpt-untied", untied, tied.batch, tied.loss, chunk_size=300), _config(), seed=9)
    load_checkpoint(model, opt, directory)
    params = model.full_parameters()
    model.close()
    return params


def test_a_tied_checkpoint_loads_into_an_untied_model(tmp_path):
    # tied: stored once, under wte.weight
    saved = run_distributed(phase, 2, "gpt", _config(), str(tmp_path), mode="save", k=K)[0]
    params = run_distributed(_tied_into_untied, 2, str(tmp_path))[0]
    assert torch.equal(params["head.weight"], params["wte.weight"])
    assert torch.equal(params["wte.weight"], saved["params"]["wte.weight"])


def _disk_tier_after_save(directory, tier_dir):
    from zero_core import save_checkpoint
    from zero_core.testing.checkpointing import build, train_steps
    from zero_core.testing.zoo import get_case
    from zero_offload._tiers import Part

    config = _config(placement="static", placement_options={
        "offload_optim_frac": 1.0, "offload_param_frac": 1.0, "host_budget_mb": 0.07, "disk_dir": tier_dir})
    model, opt = build("gpt", config)
    train_steps(model, opt, get_case("gpt"), 0, 1)
    tiers = model.engine.placement.tiers
    before = (dict(tiers.used), set(tiers.staged))
    save_checkpoint(model, opt, directory)
    after = (dict(tiers.used), set(tiers.staged))
    on_disk = sum(1 for c in model.engine.chunks if tiers.tier(c, Part.PARAMS).value == "disk")
    model.close()
    return before, after, on_disk


def test_saving_reads_disk_resident_shards_one_chunk_at_a_time_and_drops_them(tmp_path):
    """At one rank every chunk is kept gathered; their disk-resident shards must not stay in host memory."""
    before, after, on_disk = run_distributed(_disk_tier_after_save, 1, str(tmp_path / "ckpt"), str(tmp_path / "tier"))[0]
    assert on_disk > 0
    assert after == before  # nothing left staged, host accounting unchanged
