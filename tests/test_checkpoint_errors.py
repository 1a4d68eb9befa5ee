"""Bad checkpoints and failures during saves: a clear error on every rank, nothing loaded, nothing lost."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from zero_core import CheckpointError, ChunkPolicy, ZeroConfig, load_checkpoint, save_checkpoint, save_full_state_dict
from zero_core.testing import DistributedTestError, run_distributed
from zero_core.testing.checkpointing import build, kill_after_bytes, phase, train_steps
from zero_core.testing.gpt import GPT, GPTConfig
from zero_core.testing.zoo import _TINY_GPT, ZooCase, get_case

CONFIG = ZeroConfig(chunk=ChunkPolicy(chunk_size=300))


def _save(world, directory, case="gpt", k=2):
    return run_distributed(phase, world, case, CONFIG, str(directory), mode="save", k=k)[0]


@pytest.fixture(scope="module")
def _saved_at_2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved")
    _save(2, directory)
    return directory


@pytest.fixture
def saved(_saved_at_2, tmp_path):
    """A fresh copy of a checkpoint of the zoo GPT saved at 2 ranks after 2 steps (tests may damage it)."""
    shutil.copytree(_saved_at_2, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _try_load(case, directory, *, full=False, strict=True):
    """Load into a freshly built model; return the error message (or None) and whether the model is untouched."""
    case = _resized_gpt() if case == "gpt-wide" else get_case(case)
    model, opt = build(case, CONFIG)
    before = model.full_parameters()
    try:
        if full:
            model.load_full_state_dict(directory, strict=strict)
        else:
            load_checkpoint(model, opt, directory, strict=strict)
        message = None
    except CheckpointError as exc:
        message = str(exc)
    after = model.full_parameters()
    model.close()
    return message, all(torch.equal(before[n], after[n]) for n in before)


def _resized_gpt():
    """The zoo's GPT with a wider vocabulary: same keys, some shapes differ."""
    case = get_case("gpt")
    return ZooCase("gpt-wide", lambda: GPT(GPTConfig(**{**_TINY_GPT, "vocab_size": 80})), case.batch, case.loss,
                   chunk_size=300)


def _all_raise(results, *fragments):
    for message, untouched in results:
        assert message is not None, "a rank loaded what it should have refused"
        for fragment in fragments:
            assert fragment in message, message
        assert untouched, "a failed load changed the model"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_checkpoint_of_another_model(world, saved):
    results = run_distributed(_try_load, world, "odd_sizes", str(saved))
    _all_raise(results, "does not match this model", "missing", "'a.weight'", "unexpected", "'wte.weight'")


@pytest.mark.parametrize("world", [2])
def test_checkpoint_with_other_shapes(world, saved):
    results = run_distributed(_try_load, world, "gpt-wide", str(saved))
    _all_raise(results, "shape mismatch", "'wte.weight'", "(37, 18) saved, (80, 18) in the model")


def test_strict_false_skips_missing_and_unexpected_keys_but_never_shapes(saved):
    message, _ = run_distributed(_try_load, 2, "gpt-wide", str(saved), strict=False)[0]
    assert "shape mismatch" in message


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_damaged_shard_is_detected_by_size_or_checksum(world, damage, saved):
    metadata = json.loads((saved / "zero_checkpoint.json").read_text())
    target = saved / metadata["files"][1]["name"]
    data = bytearray(target.read_bytes())
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the values; the size is unchanged
        target.write_bytes(data)
    results = run_distributed(_try_load, world, "gpt", str(saved))
    expected = "truncated" if damage == "truncate" else "fails its checksum"
    _all_raise(results, expected, target.name)


@pytest.mark.parametrize("world", [2])
def test_not_a_checkpoint(world, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hello")
    (tmp_path / "file.bin").write_bytes(b"\0" * 16)
    for path, fragment in [(tmp_path / "empty", "is not a zero checkpoint"), (tmp_path / "other", "notes.txt"),
                           (tmp_path / "file.bin", "is a file, not a checkpoint directory"),
                           (tmp_path / "missing", "the path does not exist")]:
        _all_raise(run_distributed(_try_load, world, "gpt", str(path)), fragment)


@pytest.mark.parametrize("world", [1, 4])
def test_incomplete_checkpoint_without_metadata(world, tmp_path):
    _save(world, tmp_path)
    (tmp_path / "zero_checkpoint.json").unlink()
    _all_raise(run_distributed(_try_load, world, "gpt", str(tmp_path)), "incomplete checkpoint", "interrupted")


def test_damaged_metadata(saved):
    (saved / "zero_checkpoint.json").write_text("{not json")
    _all_raise(run_distributed(_try_load, 2, "gpt", str(saved)), "cannot be read as JSON")


def _save_and_die(directory, victim, limit):
    """Train one step past the saved checkpoint, then save again; rank ``victim`` is killed mid-write."""
    import torch.distributed as dist

    case = get_case("gpt")
    model, opt = build(case, CONFIG)
    train_steps(model, opt, case, 0, 3)
    if dist.get_rank() == victim:
        with kill_after_bytes(limit):
            save_checkpoint(model, opt, directory)
    else:
        save_checkpoint(model, opt, directory)
    return "saved"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_rank_killed_in_the_middle_of_a_save_leaves_the_previous_checkpoint(world, tmp_path):
    saved = _save(world, tmp_path, k=2)
    before = json.loads((tmp_path / "zero_checkpoint.json").read_text())
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(_save_and_die, world, str(tmp_path), world - 1, 2000, timeout=60, grace=30)
    report = str(failure.value)
    assert f"rank {world - 1} exited with code {-signal.SIGKILL}" in report
    if world > 1:
        assert "another rank failed or stopped responding" in report  # the survivors failed fast, with a reason
    assert json.loads((tmp_path / "zero_checkpoint.json").read_text()) == before
    resumed = run_distributed(phase, world, "gpt", CONFIG, str(tmp_path), mode="load", k=2)[0]
    for name, value in saved["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    # the next complete save removes what the interrupted one left behind
    _save(world, tmp_path)
    after = json.loads((tmp_path / "zero_checkpoint.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["zero_checkpoint.json"] + [f["name"] for f in after["files"]])


def _die_writing_metadata(directory):
    """Rank 0 is killed halfway through writing the metadata, after every shard file is complete."""
    import torch.distributed as dist

    from zero_core.checkpoint import _checkpoint

    case = get_case("gpt")
    model, opt = build(case, CONFIG)
    train_steps(model, opt, case, 0, 3)
    original = _checkpoint.atomic_write

    def atomic_write(path, write):
        if dist.get_rank() == 0 and Path(path).name == _checkpoint.METADATA:
            def half(stream):
                stream.write(b'{"format": "zero-sharded')
                os.kill(os.getpid(), signal.SIGKILL)
            return original(path, half)
        return original(path, write)

    _checkpoint.atomic_write = atomic_write
    save_checkpoint(model, opt, directory)
    return "saved"


def test_killed_while_writing_the_metadata(tmp_path):
    saved = _save(2, tmp_path, k=2)
    before = (tmp_path / "zero_checkpoint.json").read_text()
    with pytest.raises(DistributedTestError):
        run_distributed(_die_writing_metadata, 2, str(tmp_path), timeout=60, grace=30)
    assert (tmp_path / "zero_checkpoint.json").read_text() == before
    resumed = run_distributed(phase, 2, "gpt", CONFIG, str(tmp_path), mode="load", k=2)[0]
    for name, value in saved["params"].items():
        assert torch.equal(resumed["params"][name], value), name


def _save_into(path):
    case = get_case("gpt")
    model, opt = build(case, CONFIG)
    errors = []
    for call in (lambda: save_checkpoint(model, opt, path), lambda: save_full_state_dict(model, f"{path}/x.safetensors")):
        try:
            call()
            errors.append(None)
        except CheckpointError as exc:
            errors.append(str(exc))
    model.close()
    return errors


@pytest.mark.parametrize("world", [2])
def test_saving_where_nothing_can_be_written(world, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for errors in run_distributed(_save_into, world, str(blocker / "ckpt")):
        assert errors[0] is not None and "cannot use" in errors[0]
        assert errors[1] is not None and "saving the full state dict" in errors[1]


def _full_save_fails_midway(path):
    case = get_case("gpt")
    model, opt = build(case, CONFIG)
    import torch.distributed as dist

    from zero_core.base import _atomic

    original = _atomic.HashingWriter.write

    def write(self, data):
        if self.nbytes > 4000:
            raise OSError(28, "No space left on device")
        return original(self, data)

    _atomic.HashingWriter.write = write
    try:
        save_full_state_dict(model, path)
        message = None
    except CheckpointError as exc:
        message = str(exc)
    finally:
        _atomic.HashingWriter.write = original
    model.close()
    return message, dist.get_rank()


def test_full_state_dict_write_failure_keeps_the_old_file(tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"previous contents")
    for message, rank in run_distributed(_full_save_fails_midway, 2, str(target)):
        assert "No space left on device" in message and (rank == 0 or "(on rank 0)" in message), (rank, message)
    assert target.read_bytes() == b"previous contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


@pytest.mark.parametrize("world", [1, 4])
def test_full_state_dict_of_another_model(world, tmp_path):
    torch.save(get_case("odd_sizes").build().state_dict(), tmp_path / "other.pt")
    _all_raise(run_distributed(_try_load, world, "gpt", str(tmp_path / "other.pt"), full=True),
               "does not match this model", "missing", "unexpected")
    (tmp_path / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    _all_raise(run_distributed(_try_load, world, "gpt", str(tmp_path / "broken.safetensors"), full=True),
               "broken.safetensors")
