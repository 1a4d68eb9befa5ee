"""Units under checkpoints and lazy init: the streaming safetensors writer, atomic writes, sources, the recording."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from zero_core import CheckpointError, lazy_init
from zero_core.base._atomic import atomic_write, file_sha256
from zero_core.checkpoint._safetensors_stream import SafetensorsWriter
from zero_core.checkpoint._sources import open_source
from zero_core.setup._lazy import find_recording


def test_streamed_safetensors_file_reads_back_with_the_library(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(4).to(torch.bfloat16),
        "d": torch.tensor(2.5),
        "e": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
    }
    entries = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]

    def write(stream):
        writer = SafetensorsWriter(stream, entries, {"producer": "test"})
        for key, value in tensors.items():
            writer.write(key, value)
        writer.close()

    size, digest = atomic_write(tmp_path / "x.safetensors", write)
    assert size == (tmp_path / "x.safetensors").stat().st_size and digest == file_sha256(tmp_path / "x.safetensors")
    loaded = load_file(tmp_path / "x.safetensors")
    for key, value in tensors.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key


def test_streamed_writer_refuses_out_of_order_and_missing_tensors(tmp_path):
    entries = [("a", torch.float32, (2,)), ("b", torch.float32, (3,))]
    with open(tmp_path / "y", "wb") as f:
        writer = SafetensorsWriter(f, entries)
        with pytest.raises(CheckpointError, match="expected tensor 'a'"):
            writer.write("b", torch.zeros(3))
        writer.write("a", torch.zeros(2))
        with pytest.raises(CheckpointError, match="1 tensor"):
            writer.close()
    with pytest.raises(CheckpointError, match="cannot store"), open(tmp_path / "z", "wb") as f:
        SafetensorsWriter(f, [("c", torch.complex64, (1,))])


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "file"
    target.write_bytes(b"old")

    def fail(stream):
        stream.write(b"half of the new")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(target, fail)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # no temporary left behind


def test_safetensors_source_reads_flat_ranges_by_rows(tmp_path):
    value = torch.arange(60.0).reshape(6, 10)
    save_file({"w": value, "s": torch.tensor(3.0)}, tmp_path / "m.safetensors")
    source = open_source(tmp_path / "m.safetensors")
    assert source.shape("w") == (6, 10) and source.dtype("w") == torch.float32
    for lo, hi in [(0, 60), (7, 8), (9, 31), (30, 40), (55, 60)]:
        assert torch.equal(source.read("w", lo, hi), value.reshape(-1)[lo:hi])
    assert source.read("s").item() == 3.0


def test_index_json_source_and_its_errors(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "one.safetensors")
    save_file({"b": torch.zeros(3)}, tmp_path / "two.safetensors")
    (tmp_path / "m.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}))
    source = open_source(tmp_path)
    assert sorted(source.keys()) == ["a", "b"] and torch.equal(source.read("b"), torch.zeros(3))
    (tmp_path / "m.safetensors.index.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="sharded state dict index"):
        open_source(tmp_path / "m.safetensors.index.json")
    with pytest.raises(CheckpointError, match="non-tensor values"):
        open_source({"a": 1})
    with pytest.raises(CheckpointError, match="no state dict file"):
        open_source(tmp_path / "missing.pt")


def test_torch_file_source_is_memory_mapped(tmp_path):
    torch.save({"w": torch.arange(10.0)}, tmp_path / "m.pt")
    source = open_source(tmp_path / "m.pt")
    assert torch.equal(source.read("w", 3, 6), torch.tensor([3.0, 4.0, 5.0]))
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="not a state dict"):
        open_source(tmp_path / "list.pt")


def _replayed(recording, tensors):
    """Final values of ``tensors`` (meta) from a replay."""
    out = {}
    finals = {}
    for name, t in tensors.items():
        finals[recording.key(t)] = lambda storage, name=name, t=t: out.__setitem__(
            name, torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.size(), t.stride()).clone())
    recording.replay(device=torch.device("cpu"), finals=finals, rng_state=recording.rng_state)
    return out


def test_recording_follows_aliases_and_reassigned_data():
    torch.manual_seed(0)
    eager = torch.nn.Linear(4, 3)
    eager.weight.data.normal_()  # through the .data alias
    eager.bias.data = torch.full((3,), 7.0)  # a new storage for the same parameter
    eager.weight.data[1].zero_()  # through a view
    torch.manual_seed(0)
    with lazy_init() as recording:
        lazy = torch.nn.Linear(4, 3)
        lazy.weight.data.normal_()
        lazy.bias.data = torch.full((3,), 7.0)
        lazy.weight.data[1].zero_()
    assert lazy.weight.is_meta
    values = _replayed(recording, {"weight": lazy.weight, "bias": lazy.bias})
    assert torch.equal(values["weight"], eager.weight.detach()) and torch.equal(values["bias"], eager.bias.detach())


def test_replay_frees_each_overwritten_value():
    """Each weight drawn twice (as reset_parameters and a later init do) is freed between the draws: one alive at a time."""
    with lazy_init() as recording:
        layers = [torch.nn.Linear(256, 256, bias=False) for _ in range(6)]
        for layer in layers:
            torch.nn.init.normal_(layer.weight, std=0.02)
    _replayed(recording, {str(i): layer.weight for i, layer in enumerate(layers)})
    assert recording.peak_bytes == 256 * 256 * 4


def test_replay_of_only_what_a_buffer_needs_leaves_the_generator_alone():
    with lazy_init() as recording:
        model = torch.nn.Linear(8, 8)
        model.register_buffer("table", torch.arange(4.0) * 2)
    state = torch.random.get_rng_state()
    out = {}
    key = recording.key(model.table)
    recording.replay(device=torch.device("cpu"), rng_state=recording.rng_state, run_all=False,
                     finals={key: lambda s: out.__setitem__("t", torch.empty(0).set_(s, 0, (4,), (1,)).clone())})
    assert torch.equal(out["t"], torch.tensor([0.0, 2.0, 4.0, 6.0]))
    assert torch.equal(torch.random.get_rng_state(), state)


def test_find_recording_names_meta_tensors_made_elsewhere():
    stray = torch.empty(3, device="meta")
    with pytest.raises(Exception, match="not built under zero_core.lazy_init"):
        find_recording([stray])
