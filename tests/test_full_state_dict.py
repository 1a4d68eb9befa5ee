"""Full state dicts: the plain model's keys and shapes, fp32 masters, one chunk at a time, rank 0 writes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from zero_core import ChunkPolicy, Precision, ZeroConfig, save_full_state_dict
from zero_core.testing import run_distributed
from zero_core.testing.checkpointing import build, train_steps
from zero_core.testing.zoo import get_case


def _save_and_describe(case_name, config, directory):
    """Train two steps, then take the full state dict in memory and as files in both formats."""
    case = get_case(case_name)
    model, opt = build(case, config)
    train_steps(model, opt, case, 0, 2)
    params = model.full_parameters()
    state = model.full_state_dict()
    everywhere = model.full_state_dict(rank0_only=False)
    save_full_state_dict(model, f"{directory}/model.safetensors")
    save_full_state_dict(model, f"{directory}/model.pt")
    buffers = {n: b.detach().cpu().clone() for n, b in model.module.named_buffers()}
    model.close()
    return {"rank": dist.get_rank() if dist.is_initialized() else 0, "state": state, "everywhere": everywhere,
            "params": params, "buffers": buffers}


def _check_against_plain_model(case_name, results, directory):
    case = get_case(case_name)
    plain = case.build()
    expected = plain.state_dict()
    rank0 = results[0]
    for result in results[1:]:
        assert result["state"] == {}  # only rank 0 keeps the values
        assert result["everywhere"].keys() == rank0["state"].keys()
    state = rank0["state"]
    assert list(state) == list(expected)  # the plain model's keys, in its order
    for key, value in expected.items():
        assert state[key].shape == value.shape, key
    for name, value in rank0["params"].items():
        assert torch.equal(state[name], value), name
    for name, value in rank0["buffers"].items():
        if name in state:
            assert torch.equal(state[name], value), name
    for path in (directory / "model.safetensors", directory / "model.pt"):
        loaded = load_file(path) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)
        assert set(loaded) == set(expected)
        for key in expected:
            assert torch.equal(loaded[key], state[key]), (path.name, key)
        plain.load_state_dict(loaded, strict=True)
    return state


@pytest.mark.parametrize(("world", "stage"), [(1, 3), (2, 3), (4, 3), (2, 1)])
def test_full_state_dict_is_the_plain_models(world, stage, tmp_path):
    config = ZeroConfig(stage=stage, chunk=ChunkPolicy(chunk_size=300))
    results = run_distributed(_save_and_describe, world, "gpt", config, str(tmp_path))
    state = _check_against_plain_model("gpt", results, tmp_path)
    assert state["head.weight"] is state["wte.weight"]  # tied, as the plain model has it


@pytest.mark.parametrize("case", ["buffers", "frozen", "odd_sizes"])
def test_full_state_dict_of_zoo_models(case, tmp_path):
    config = ZeroConfig(strategy="tensor", chunk=ChunkPolicy(chunk_size=get_case(case).chunk_size or 64))
    _check_against_plain_model(case, run_distributed(_save_and_describe, 2, case, config, str(tmp_path)), tmp_path)


def test_full_state_dict_holds_fp32_masters_under_bf16(tmp_path):
    config = ZeroConfig(precision=Precision(compute="bf16"), chunk=ChunkPolicy(chunk_size=300))
    results = run_distributed(_save_and_describe, 2, "gpt", config, str(tmp_path))
    state = _check_against_plain_model("gpt", results, tmp_path)
    weight = state["blocks.0.fc.weight"]
    assert weight.dtype == torch.float32
    assert not torch.equal(weight, weight.to(torch.bfloat16).float())  # not rounded to the compute dtype


def test_full_state_dict_with_offloaded_shards_on_disk(tmp_path):
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=300), placement="static", placement_options={
        "offload_optim_frac": 1.0, "offload_param_frac": 1.0, "host_budget_mb": 0.04, "disk_dir": str(tmp_path / "tier")})
    (tmp_path / "out").mkdir()
    _check_against_plain_model("gpt", run_distributed(_save_and_describe, 2, "gpt", config, str(tmp_path / "out")),
                               tmp_path / "out")


def _load_full(case_name, config, source, lazy):
    case = get_case(case_name)
    model, opt = build(case, config, lazy=lazy, seed=999)  # other values than the saved ones
    model.load_full_state_dict(source)
    params = model.full_parameters()
    buffers = {n: b.detach().cpu().clone() for n, b in model.module.named_buffers()}
    losses = train_steps(model, opt, case, 0, 2)
    model.close()
    return params, buffers, losses


@pytest.fixture(scope="module")
def buffers_saved_at_2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("full")
    run_distributed(_save_and_describe, 2, "buffers", ZeroConfig(chunk=ChunkPolicy(chunk_size=64)), str(directory))
    return directory


@pytest.mark.parametrize(("fmt", "world"), [("safetensors", 1), ("pt", 2), ("safetensors", 4)])
def test_load_full_state_dict_reshards(world, fmt, buffers_saved_at_2):
    """Saved at 2 ranks with chunks, loaded at 1, 2 and 4 ranks (tensor-wise at 4), eager or lazy."""
    tmp_path = buffers_saved_at_2
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    strategy = "tensor" if world == 4 else "chunk"
    config = ZeroConfig(strategy=strategy, stage=2 if world == 1 else 3, chunk=ChunkPolicy(chunk_size=100))
    for lazy in (False, True):
        params, buffers, _ = run_distributed(_load_full, world, "buffers", config, str(tmp_path / f"model.{fmt}"), lazy)[0]
        for name, value in params.items():
            assert torch.equal(value, saved[name]), name
        for name, value in buffers.items():
            if name in saved:
                assert torch.equal(value, saved[name]), name


def _pretrained(case_name, config, path):
    """A lazily built model whose parameters come straight from a file: its initialisers never run on them."""
    case = get_case(case_name)
    model, opt = build(case, config, lazy=True, load_from=path, seed=7)
    params = model.full_parameters()
    model.close()
    return params


@pytest.mark.parametrize("world", [1, 2, 4])
def test_pretrained_weights_into_a_lazily_built_model(world, tmp_path):
    torch.manual_seed(3)
    plain = get_case("gpt").build()
    torch.save(plain.state_dict(), tmp_path / "pretrained.bin")
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=300))
    params = run_distributed(_pretrained, world, "gpt", config, str(tmp_path / "pretrained.bin"))[0]
    for name, value in plain.named_parameters():
        assert torch.equal(params[name], value.detach()), name


def test_pretrained_state_dict_without_tied_duplicate(tmp_path):
    """Files that store a tied weight once (as Hugging Face does) load: the tied twin's name stands in."""
    torch.manual_seed(3)
    plain = get_case("gpt").build()
    state = {k: v for k, v in plain.state_dict().items() if k != "head.weight"}
    from safetensors.torch import save_file

    save_file(state, tmp_path / "model.safetensors")
    params = run_distributed(_pretrained, 2, "gpt", ZeroConfig(chunk=ChunkPolicy(chunk_size=300)),
                             str(tmp_path / "model.safetensors"))[0]
    assert torch.equal(params["wte.weight"], plain.wte.weight.detach())


def _save_peak(directory, fmt):
    """Peak RSS growth of each rank while it saves the full state dict of a 29M-parameter GPT."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: large blocks are unmapped when freed

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    from zero_core import shard
    from zero_core.testing.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8192, seq_len=64, d_model=512, n_layer=8, n_head=8))
    numel = sum(p.numel() for p in model.parameters())
    # release_host_memory=False: this test sets malloc itself (a lower threshold than shard()'s)
    model, _ = shard(model, torch.optim.AdamW(model.parameters()),
                     config=ZeroConfig(chunk=ChunkPolicy(chunk_size=1 << 20), release_host_memory=False))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current RSS
    baseline = status("VmRSS:")
    save_full_state_dict(model, f"{directory}/model.{fmt}")
    peak = status("VmHWM:") - baseline
    largest = max(c.size for c in model.engine.chunks) * 4
    model.close()
    return {"peak": peak, "model": numel * 4, "largest_chunk": largest}


def test_streamed_full_state_dict_holds_one_chunk_at_a_time(tmp_path):
    streamed = run_distributed(_save_peak, 2, str(tmp_path), "safetensors")
    whole = run_distributed(_save_peak, 2, str(tmp_path), "pt")
    for rank in range(2):
        # One gathered chunk, the all-gather's receive buffer it is copied out of, and on gloo the all-gather's
        # send buffer of the same size (it runs as an all-to-all, see [Note: all-gather on gloo] in zero_comm),
        # plus bookkeeping: never the model, not even on rank 0, which writes the file.
        assert streamed[rank]["peak"] <= 3 * streamed[rank]["largest_chunk"] + 16 * 2**20, streamed[rank]
        assert 3 * streamed[rank]["largest_chunk"] + 16 * 2**20 < streamed[rank]["model"]
    assert whole[0]["peak"] >= whole[0]["model"]  # torch.save needs the whole state dict on rank 0


def test_directory_of_several_safetensors_files(tmp_path):
    """A directory of shard files without an index: every tensor of every file is found."""
    from safetensors.torch import save_file

    torch.manual_seed(3)
    plain = get_case("gpt").build()
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    keys = list(state)
    save_file({k: state[k] for k in keys[: len(keys) // 2]}, tmp_path / "part-1.safetensors")
    save_file({k: state[k] for k in keys[len(keys) // 2 :]}, tmp_path / "part-2.safetensors")
    params = run_distributed(_pretrained, 2, "gpt", ZeroConfig(chunk=ChunkPolicy(chunk_size=300)), str(tmp_path))[0]
    for name, value in plain.named_parameters():
        assert torch.equal(params[name], value.detach()), name


def _load_from_twice(good, bad):
    """A wrong file fails before anything is built, naming load_strict; the same model then loads the right one."""
    from zero_core import CheckpointError, shard
    from zero_core.testing.parity import make_optimizer

    case = get_case("gpt")
    torch.manual_seed(1)
    model = case.build()
    opt = make_optimizer(case, model)
    try:
        shard(model, opt, config=ZeroConfig(chunk=ChunkPolicy(chunk_size=300)), load_from=bad)
        message = None
    except CheckpointError as exc:
        message = str(exc)
    sharded, _ = shard(model, opt, config=ZeroConfig(chunk=ChunkPolicy(chunk_size=300)), load_from=good)
    params = sharded.full_parameters()
    sharded.close()
    return message, params


def test_load_from_is_checked_before_anything_is_built(tmp_path):
    torch.manual_seed(3)
    plain = get_case("gpt").build()
    torch.save(plain.state_dict(), tmp_path / "good.pt")
    torch.save({**plain.state_dict(), "extra.bias": torch.zeros(3)}, tmp_path / "bad.pt")
    for message, params in run_distributed(_load_from_twice, 2, str(tmp_path / "good.pt"), str(tmp_path / "bad.pt")):
        assert "nothing was built" in message and "'extra.bias'" in message and "load_strict=False" in message
        for name, value in plain.named_parameters():
            assert torch.equal(params[name], value.detach()), name


def _partial_pretrained(path, lazy):
    from zero_core.testing.checkpointing import build

    case = get_case("gpt")
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=300))
    init, _ = build(case, config, lazy=lazy)
    expected = init.full_parameters()
    init.close()
    sharded, _ = build(case, config, lazy=lazy, load_from=path, load_strict=False)
    params = sharded.full_parameters()
    sharded.close()
    return expected, params


@pytest.mark.parametrize("lazy", [False, True])
def test_load_strict_false_keeps_the_initial_values_of_what_the_file_lacks(lazy, tmp_path):
    torch.manual_seed(3)
    plain = get_case("gpt").build()
    state = {k: v for k, v in plain.state_dict().items() if not k.startswith("blocks.1.")}
    state["unrelated"] = torch.zeros(2)
    torch.save(state, tmp_path / "partial.pt")
    expected, params = run_distributed(_partial_pretrained, 2, str(tmp_path / "partial.pt"), lazy)[0]
    for name, value in params.items():
        want = expected[name] if name.startswith("blocks.1.") else dict(plain.named_parameters())[name].detach()
        assert torch.equal(value, want), name


def _full_load_of_a_checkpoint_dir(directory):
    from zero_core import CheckpointError

    model, _ = build(get_case("gpt"), ZeroConfig(chunk=ChunkPolicy(chunk_size=300)))
    try:
        model.load_full_state_dict(directory, strict=False)
        return None
    except CheckpointError as exc:
        return str(exc)
    finally:
        model.close()


def test_a_sharded_checkpoint_is_not_taken_for_a_state_dict(tmp_path):
    from zero_core.testing.checkpointing import phase

    run_distributed(phase, 2, "gpt", ZeroConfig(chunk=ChunkPolicy(chunk_size=300)), str(tmp_path), mode="save", k=1)
    for message in run_distributed(_full_load_of_a_checkpoint_dir, 2, str(tmp_path)):
        assert "zero_core.load_checkpoint" in message
