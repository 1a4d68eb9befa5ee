"""zero-offload's parts on their own: options, the disk store, moves between tiers, the tracer."""

import errno
import os
import pickle

import pytest
import torch

from zero_core import ChunkPolicy, ConfigError, PluginNotFoundError, ZeroConfig, shard
from zero_core.plugin import MemoryTier, ZeroPlugins, policy_call
from zero_core.testing import PlacementPolicyConformance
from zero_offload import DeviceBudgetError, DiskStore, DiskTierError, GeminiConfig, GeminiPolicy, MemoryTracer, Part, StaticConfig, StaticPolicy

DEVICE, HOST, DISK = MemoryTier.DEVICE, MemoryTier.HOST, MemoryTier.DISK


# -- options ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["shard_param_frac", "offload_optim_frac", "offload_param_frac"])
@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), "half"])
def test_fractions_outside_0_1_are_refused(name, value):
    with pytest.raises(ConfigError, match=rf"StaticConfig\.{name} must be a fraction in \[0, 1\]"):
        StaticConfig(**{name: value}) if name != "offload_param_frac" else StaticConfig(offload_optim_frac=1.0, **{name: value})


def test_param_offload_needs_optimizer_offload():
    with pytest.raises(ConfigError, match="optimizer states must be offloaded too"):
        StaticConfig(offload_param_frac=0.5, offload_optim_frac=0.25)


def test_budgets_must_be_positive():
    with pytest.raises(ConfigError, match="device_budget_mb must be a positive number of MiB"):
        GeminiConfig(device_budget_mb=0)
    with pytest.raises(ConfigError, match="margin_ratio must be a fraction"):
        GeminiConfig(margin_ratio=2)


def test_watch_is_true_false_or_none():
    with pytest.raises(ConfigError, match=r"GeminiConfig\.watch must be True, False or None, got 'yes'"):
        GeminiConfig(watch="yes")
    assert GeminiConfig().watch is None  # on with CUDA, off on the CPU


def test_a_device_budget_error_keeps_its_figures_across_processes():
    """Raised on a rank, re-raised by the launcher: the bytes it names travel with the message."""
    error = pickle.loads(pickle.dumps(DeviceBudgetError("the device budget (...) is below ...", needed=197504, measured=True)))
    assert (str(error), error.needed, error.measured) == ("the device budget (...) is below ...", 197504, True)
    assert isinstance(error, ConfigError)


def test_unknown_options_are_listed():
    with pytest.raises(ConfigError, match=r"unknown placement option\(s\) \['device_budget'\].*device_budget_mb"):
        GeminiConfig.from_options({"device_budget": 5})


def test_an_unknown_policy_lists_the_available_ones():
    registry = ZeroPlugins.load().placement_policies
    with pytest.raises(PluginNotFoundError, match=r"no placement policy named 'gemni' is registered \(available: .*gemini.*static"):
        registry.get("gemni")


def test_policies_without_options_refuse_some():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="placement policy 'device' takes no options"):
        shard(model, torch.optim.SGD(model.parameters(), lr=0.1),
              config=ZeroConfig(placement="device", placement_options={"device_budget_mb": 1}))


def test_gemini_on_cpu_needs_a_device_budget():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="needs a device budget on a machine without CUDA"):
        shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=ZeroConfig(placement="gemini", device="cpu"))


# -- the disk store ----------------------------------------------------------------------
def test_disk_store_round_trips_every_dtype(tmp_path):
    store = DiskStore(str(tmp_path), rank=0)
    tensors = [torch.randn(1000), torch.randn(7).to(torch.bfloat16), torch.arange(5), torch.empty(0)]
    store.write("a", tensors)
    out = [torch.empty_like(t) for t in tensors]
    store.read("a", out)
    for t, o in zip(tensors, out):
        assert torch.equal(t, o)
    assert store.bytes_written == sum(t.numel() * t.element_size() for t in tensors)
    directory = store.directory
    store.close()
    assert not os.path.exists(directory)


def test_an_unwritable_disk_directory_is_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(DiskTierError, match="is not writable.*TierConfig\\(disk_dir=...\\)"):
        DiskStore(str(blocker / "sub"), rank=0)


def test_a_full_disk_keeps_the_previous_file(tmp_path, monkeypatch):
    store = DiskStore(str(tmp_path), rank=0)
    old = torch.arange(10, dtype=torch.float32)
    store.write("p", [old])

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("zero_offload._disk.os.fsync", full)
    with pytest.raises(DiskTierError, match="disk tier: writing p .* the disk is full.*previous file is intact"):
        store.write("p", [old + 100])
    monkeypatch.undo()
    assert sorted(os.listdir(store.directory)) == ["p"]  # no temporary left behind
    back = torch.empty(10)
    store.read("p", [back])
    assert torch.equal(back, old)


def test_a_truncated_file_is_reported(tmp_path):
    store = DiskStore(str(tmp_path), rank=0)
    store.write("p", [torch.ones(4)])
    with pytest.raises(DiskTierError, match="shorter than expected"):
        store.read("p", [torch.empty(8)])


# -- moves ---------------------------------------------------------------------------------
def _sharded(placement, options, tmp_path=None, device="cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = ZeroConfig(placement=placement, placement_options=options, chunk=ChunkPolicy(chunk_size=128), device=device)
    return shard(model, opt, config=config)


def _step(model, opt):
    opt.zero_grad()
    model(torch.randn(8, 16)).square().mean().backward()
    opt.step()


def test_moves_keep_bytes_exact_and_account_them(tmp_path):
    model, opt = _sharded("static", {"offload_optim_frac": 1.0, "disk_dir": str(tmp_path)})
    policy, tiers = model.engine.placement, model.engine.placement.tiers
    tiers.move = policy_call(tiers.move)  # the test moves shards as the policy would, inside its hooks
    _step(model, opt)
    chunk = model.engine.chunks[0]
    before = chunk.shard.clone()
    states = {k: v.clone() for seg in chunk.segments for k, v in opt.state[seg.param].items()}
    used = dict(tiers.used)
    tiers.move(chunk, Part.PARAMS, HOST)
    # the sharded parameters the optimizer steps now view the host shard: no copy is left behind on the device
    host = chunk.shard.untyped_storage().data_ptr()
    assert all(seg.local.untyped_storage().data_ptr() == host for seg in chunk.segments)
    for tier in (HOST, DISK, DEVICE, DISK, HOST):
        tiers.move(chunk, Part.PARAMS, tier)
        tiers.move(chunk, Part.OPTIM, tier)
        assert chunk.tier is tier and policy.tier_of(chunk) is tier
        assert chunk.shard_in_memory is (tier is not DISK)
        if tier is DISK:  # the stand-in: NaN, and writes to it fail
            assert torch.isnan(chunk.segments[0].param).all()
            with pytest.raises(RuntimeError, match="more than one element"):
                chunk.segments[0].param.data.add_(1)
    tiers.move(chunk, Part.PARAMS, DEVICE)  # where the policy placed it
    assert torch.equal(chunk.shard, before)
    after = {k: v for seg in chunk.segments for k, v in opt.state[seg.param].items()}
    assert all(torch.equal(after[k], v) for k, v in states.items())
    assert tiers.used == used  # back where it started: every byte accounted in and out


def test_gradients_stay_in_memory(tmp_path):
    model, _ = _sharded("static", {"offload_optim_frac": 1.0, "disk_dir": str(tmp_path)})
    from zero_offload import TierBudgetError

    with pytest.raises(TierBudgetError, match="gradients stay in memory"):
        model.engine.placement.tiers.move(model.engine.chunks[0], Part.GRADS, DISK)


# -- the tracer ------------------------------------------------------------------------------
def test_cpu_tracer_counts_new_storages_until_freed():
    tracer = MemoryTracer(torch.device("cpu"))
    x = torch.randn(256, 256)
    tracer.start()
    try:
        y = x @ x  # 256 KiB, new
        z = y.t()  # a view: nothing new
        y.add_(1)  # in place: nothing new
        assert tracer.live() == 256 * 256 * 4
        del y, z
        assert tracer.live() == 0
        assert tracer.sample() == 256 * 256 * 4  # the period's peak
        assert tracer.sample() == 0
    finally:
        tracer.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host copies and write-back exist only with CUDA")
def test_pinned_host_copy_is_written_back_only_when_stale():
    model, opt = _sharded("static", {"offload_optim_frac": 1.0, "offload_param_frac": 1.0}, device="cuda")
    tiers = model.engine.placement.tiers
    tiers.move = policy_call(tiers.move)  # the test moves shards as the policy would, inside its hooks
    chunk = model.engine.chunks[0]
    assert chunk.shard.is_pinned()
    host = chunk.shard
    tiers.move(chunk, Part.PARAMS, DEVICE)
    assert chunk.shard.is_cuda and tiers.host_copy[chunk.index] is host
    tiers.move(chunk, Part.PARAMS, HOST)
    assert chunk.shard is host  # fresh: the device storage was dropped, nothing copied
    tiers.move(chunk, Part.PARAMS, DEVICE)
    with torch.no_grad():
        chunk.shard.add_(1)
    tiers.mark_updated(chunk)
    expected = chunk.shard.cpu()
    tiers.move(chunk, Part.PARAMS, HOST)
    assert chunk.shard is host and torch.equal(host, expected)  # stale: written back into the same pinned copy


def test_optimizer_state_dict_reads_states_from_disk_and_loads_them_back(tmp_path):
    """state_dict() must hold real values (not the disk stand-ins), and load_state_dict() must reach the disk."""
    plain, plain_opt = _sharded("device", {})
    offloaded, opt = _sharded("static", {"offload_optim_frac": 1.0, "offload_param_frac": 1.0,
                                         "host_budget_mb": 0.007, "disk_dir": str(tmp_path)})
    tiers = offloaded.engine.placement.tiers
    assert any(tiers.tier(c, Part.OPTIM) is DISK for c in offloaded.engine.chunks)
    for step in range(2):
        torch.manual_seed(step)
        _step(plain, plain_opt)
        torch.manual_seed(step)
        _step(offloaded, opt)
    saved, expected = opt.state_dict(), plain_opt.state_dict()
    for key, state in expected["state"].items():
        for name, value in state.items():
            assert torch.equal(saved["state"][key][name], value), (key, name)
    # loading zeros into the disk-resident states must change what the next step reads
    zeroed = {**saved, "state": {k: {n: torch.zeros_like(v) if v.dim() else v for n, v in s.items()} for k, s in saved["state"].items()}}
    opt.load_state_dict(zeroed)
    plain_opt.load_state_dict({**expected, "state": {k: {n: torch.zeros_like(v) if v.dim() else v for n, v in s.items()}
                                                      for k, s in expected["state"].items()}})
    torch.manual_seed(7)
    _step(plain, plain_opt)
    torch.manual_seed(7)
    _step(offloaded, opt)
    a, b = plain.full_parameters(), offloaded.full_parameters()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_state_dict_reads_states_that_do_not_fit_the_host(tmp_path):
    """Optimizer states on disk, more than the host tier has room for: state_dict() still returns them all."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(8)]
    plain = torch.nn.Sequential(*layers)
    offloaded = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    offloaded.load_state_dict(plain.state_dict())
    runs = []
    for model, options in ((plain, {}), (offloaded, {"offload_optim_frac": 1.0, "offload_param_frac": 1.0,
                                                     "host_budget_mb": 0.3, "disk_dir": str(tmp_path)})):
        config = ZeroConfig(placement="static" if options else "device", placement_options=options,
                            chunk=ChunkPolicy(chunk_size=4160), device="cpu")
        model, opt = shard(model, torch.optim.Adam(model.parameters(), lr=1e-2), config=config)
        for step in range(2):
            torch.manual_seed(step)
            opt.zero_grad()
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
        runs.append((model, opt))
    (_, plain_opt), (model, opt) = runs
    tiers = model.engine.placement.tiers
    on_disk = sum(tiers.nbytes(c, Part.OPTIM) for c in model.engine.chunks if tiers.tier(c, Part.OPTIM) is DISK)
    assert on_disk > tiers.room(HOST)  # reading them into the host tier would not fit
    used = dict(tiers.used)
    saved, expected = opt.state_dict(), plain_opt.state_dict()
    for key, state in expected["state"].items():
        for name, value in state.items():
            assert torch.equal(saved["state"][key][name], value), (key, name)
    assert tiers.used == used  # nothing moved: the values were read for the caller only
    assert torch.isnan(next(v for s in opt.state.values() for v in s.values() if v.dim() > 0 and v.stride(0) == 0)).all()


# -- the conformance kit, as a third-party policy would run it -------------------------------
class TestStaticConformance(PlacementPolicyConformance):
    policy_class = StaticPolicy
    options = {"shard_param_frac": 0.5, "offload_optim_frac": 1.0, "offload_param_frac": 0.5}


class TestGeminiConformance(PlacementPolicyConformance):
    policy_class = GeminiPolicy
    options = {"device_budget_mb": 1.0, "margin_ratio": 0.5}


@pytest.mark.parametrize(("placement", "options", "kept"), [
    ("device", {}, True),
    ("static", {"offload_optim_frac": 1.0}, True),  # master shards on the device: a single rank keeps the chunks
    ("static", {"offload_optim_frac": 1.0, "offload_param_frac": 1.0}, False),
    ("gemini", {"device_budget_mb": 1}, False),
])
def test_a_single_rank_keeps_chunks_gathered_only_where_master_shards_stay_on_the_device(placement, options, kept):
    """One rank's gather is a copy, so chunks stay gathered; but not where the policy keeps master shards off the
    device: there whole-model full buffers would take back the device memory the offload is for."""
    model, opt = _sharded(placement, options)
    assert [c.persistent for c in model.engine.chunks] == [kept] * len(model.engine.chunks)
    before = [p.detach().clone() for p in model.full_parameters().values()]
    _step(model, opt)
    _step(model, opt)
    after = list(model.full_parameters().values())
    assert all(not torch.equal(a, b) for a, b in zip(before, after))  # it trained
    # between steps a released chunk holds no full buffer on the device
    assert [c.is_gathered for c in model.engine.chunks] == [kept] * len(model.engine.chunks)
    if not kept:
        assert model.engine.placement.context.device_bytes() == 0
    model.close()
