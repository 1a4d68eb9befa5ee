"""shard() makes each master shard where the placement policy puts it first (issue 48: a 1-3B model under a 4 GiB
budget failed in gemini's setup, every shard filled on the device before the first one moved to the host).

Measured at every operator of ``shard()``: on CUDA, the bytes of the device storages operators make there
(``LiveBytes``); on the CPU, where the host is the device, the bytes the chunks hold on the compute device (full
buffers, and master shards whose tier is the device), the figure gemini's budget audit counts there too. The same
setup with the policy's answer put back to the default (the device) is the figure before.
"""

import pytest
import torch
from test_lazy_init import _lazy_vs_eager

from zero_core import ChunkPolicy, PluginContractError, ZeroConfig
from zero_core.base._live_bytes import LiveBytes
from zero_core.chunks import chunk as chunk_module
from zero_core.interfaces.placement import PlacementPolicy
from zero_core.plugin import MemoryTier
from zero_core.testing import device_under_test
from zero_core.testing.checkpointing import build
from zero_core.testing.parity import SEED
from zero_core.testing.zoo import get_case
from zero_offload import GeminiPolicy

# Below the 36,240 bytes of the gpt case's master shards (12 chunks of at most 5,184 bytes gathered), above one
# gather group's full buffer and gradient buffer, which gemini's setup checks.
BUDGET = 20_000


def _config(budget=BUDGET):
    return ZeroConfig(chunk=ChunkPolicy(chunk_size=300), placement="gemini",
                      placement_options={"device_budget_mb": budget / 2**20})


class _SetupDeviceBytes:
    """The most bytes zero holds on the compute device at any operator while it is on. See the module's docstring."""

    def __init__(self, monkeypatch):
        self.chunks = []
        self.peak = 0
        self.cuda = device_under_test() == "cuda"
        built = chunk_module.Chunk.__init__

        def record(chunk, *args, **kwargs):
            built(chunk, *args, **kwargs)
            self.chunks.append(chunk)

        monkeypatch.setattr(chunk_module.Chunk, "__init__", record)
        self.mode = LiveBytes(self._sample, device_type="cuda" if self.cuda else None)

    def _held_by_chunks(self):
        total = 0
        for c in self.chunks:
            total += c.full.untyped_storage().nbytes()
            shard = c._shard  # noqa: SLF001 - not .shard: that packs a copy while the full buffer holds it
            if shard is not None and c.tier is MemoryTier.DEVICE and not c.shard_is_view:
                total += shard.untyped_storage().nbytes()
        return total

    def bound(self, model):
        """The most the setup may hold on the device with shards made in host memory: one chunk's full buffer (an
        eager model is packed there) and, on CUDA, its packed shard until the copy down, and the model's buffers."""
        one_chunk = max(c.full_bytes for c in self.chunks)
        if not self.cuda:
            return one_chunk
        buffers = sum(b.untyped_storage().nbytes() for b in model.module.buffers())
        return one_chunk + max(c.shard_bytes for c in self.chunks) + buffers

    def _sample(self):
        self.peak = max(self.peak, self.mode.held() if self.cuda else self._held_by_chunks())

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._sample()
        self.mode.__exit__(*exc)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_gemini_makes_each_shard_in_host_memory_and_setup_stays_within_one_chunk(monkeypatch, lazy):
    figures = {}
    for made_where in ("device", "policy"):
        with monkeypatch.context() as patch:
            if made_where == "device":  # the figure before: every shard made on the device, then moved down
                patch.setattr(GeminiPolicy, "initial_tier", PlacementPolicy.initial_tier)
            with _SetupDeviceBytes(patch) as tracker:
                model, _ = build("gpt", _config(), lazy=lazy)
        chunks = model.engine.chunks
        report = model.engine.placement.report()
        figures[made_where] = (tracker.peak, report["moves"]["params"], [c.shard_moves for c in chunks])
        bound = tracker.bound(model)
        params = model.full_parameters()
        assert all(c.tier is MemoryTier.HOST for c in chunks)
        assert report["used"]["device"] == 0 and report["used"]["host"] > 0
        if device_under_test() == "cuda":
            assert all(c.shard.device.type == "cpu" and c.shard.is_pinned() for c in chunks)
        model.close()
        torch.manual_seed(SEED)
        reference = dict(get_case("gpt").build().named_parameters())
        assert all(torch.equal(params[n], reference[n].detach()) for n in reference), made_where  # the same values
    shards = sum(c.shard_bytes for c in chunks)
    one_chunk = max(c.full_bytes for c in chunks)
    before, moves_before, shard_moves_before = figures["device"]
    after, moves_after, shard_moves_after = figures["policy"]
    # before: every master shard on the device at once, past the budget, then each copied down by attach
    assert before >= shards > BUDGET, figures
    assert moves_before == len(chunks) and shard_moves_before == [1] * len(chunks)
    # after: filled in host memory, never moved; the device holds at most one chunk at any operator
    assert after <= bound < BUDGET, figures
    assert moves_after == 0 and shard_moves_after == [0] * len(chunks)
    print(f"\nsetup device bytes ({'lazy' if lazy else 'eager'}): {before} made on the device, {after} made where "
          f"placed; {shards} bytes of shards, one chunk {one_chunk}, budget {BUDGET}")


def test_lazy_gemini_trains_as_eager():
    """Shards made and filled in host memory from the replayed initialisers: bitwise the eager model's values,
    losses and trained parameters, and the random generator where eager construction leaves it."""
    result = _lazy_vs_eager("gpt", _config(300_000))
    assert result == {"params": True, "buffers": True, "losses": True, "trained": True, "rng": True}


def test_with_the_disk_tier_shards_go_from_host_memory_to_disk_and_train_as_eager(tmp_path, monkeypatch):
    """Past the host budget gemini puts master shards on disk: made in host memory, written there from it."""
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=300), placement="gemini", placement_options={
        "device_budget_mb": 300_000 / 2**20, "host_budget_mb": 100_000 / 2**20, "disk_dir": str(tmp_path)})
    with monkeypatch.context() as patch, _SetupDeviceBytes(patch) as tracker:
        model, _ = build("gpt", config, lazy=True)
    chunks, report = model.engine.chunks, model.engine.placement.report()
    on_disk = [c for c in chunks if c.tier is MemoryTier.DISK]
    assert 0 < len(on_disk) < len(chunks) and tracker.peak <= (tracker.bound(model) if tracker.cuda else 0)
    # the only shard moves of the setup: host memory -> disk, one per chunk on disk
    assert report["moves"]["params"] == len(on_disk) and report["used"]["disk"] > 0
    assert report["peak"]["host"] <= report["budget"]["host"]
    model.close()
    result = _lazy_vs_eager("gpt", config)
    assert result == {"params": True, "buffers": True, "losses": True, "trained": True, "rng": True}


def test_an_initial_tier_outside_device_and_host_is_refused(monkeypatch):
    monkeypatch.setattr(GeminiPolicy, "initial_tier", lambda self, chunk: MemoryTier.DISK)
    with pytest.raises(PluginContractError, match=r"initial_tier\(chunk 0\) with .*DISK.*made on the device"):
        build("gpt", _config())
