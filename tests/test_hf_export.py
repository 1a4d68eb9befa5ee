"""The Hugging Face checkpoint layout, from zero itself and from ``zero consolidate``.

Tiny GPT-2 (tied input and output embeddings) and Llama, built from configs (no download),
are trained one step on 2 ranks, then written with ``save_full_state_dict(model, DIR, ...)``
and ``save_checkpoint``, all in one distributed run that every test here shares. The
directories must load with plain ``transformers.AutoModelForCausalLM.from_pretrained``
(no zero involved) to the same logits as a plain model holding the zero model's full
parameters, and back into zero with ``shard(..., load_from=DIR)``, exactly.
``zero consolidate`` turns the sharded checkpoint into the same layout offline.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

# A test dependency (installed by ``nox -s tests``), not an optional one: no importorskip.
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import zero_core
from zero_core.checkpoint._consolidate import consolidate
from zero_core.checkpoint._hf_folder import parse_shard_size
from zero_core.cli._cli import main as cli_main
from zero_core.testing import get_case, run_distributed

NAMES = ("gpt2", "llama")
VOCAB, SEQ = 128, 16
SHARD = 40_000  # bytes: each tiny model (~120-170 KB in fp32) splits into several files
TIED = {"gpt2": ("transformer.wte.weight", "lm_head.weight")}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = {"attn_implementation": "eager", "bos_token_id": 0, "eos_token_id": 0}
    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common))
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=32, **common))


def tokens(seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _config() -> zero_core.ZeroConfig:
    return zero_core.ZeroConfig(stage=3, chunk=zero_core.ChunkPolicy(chunk_size=8192))


def export_rank(directory: str) -> dict:
    """Every rank: train one step, export both ways, then load the export back into a fresh sharded model."""
    rank, out = dist.get_rank(), {}
    for name in NAMES:
        plain = build(name)
        model, optimizer = zero_core.shard(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), config=_config())
        x = tokens(1)[rank : rank + 1]
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        base = Path(directory) / name
        zero_core.save_full_state_dict(model, base / "hf", max_shard_size=SHARD)
        zero_core.save_full_state_dict(model, base / "hf-bf16", dtype=torch.bfloat16)
        zero_core.save_checkpoint(model, optimizer, base / "ckpt")
        state = model.full_state_dict()
        model.close()

        # back into zero from the directory: every parameter exactly
        fresh = build(name)
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        loaded, _ = zero_core.shard(fresh, torch.optim.AdamW(fresh.parameters()), config=_config(),
                                    load_from=str(base / "hf"))
        reloaded = loaded.full_state_dict()
        loaded.close()
        out[name] = {"state": state, "reloaded": reloaded}
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    directory = tmp_path_factory.mktemp("export")
    results = run_distributed(export_rank, 2, str(directory), timeout=150)
    return directory, results[0]


def _plain(name: str, state: dict) -> torch.nn.Module:
    model = build(name)
    model.load_state_dict(state, strict=True)
    return model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens(7, batch=3)).logits


def _from_pretrained(path: Path, **kwargs) -> torch.nn.Module:
    model, info = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", output_loading_info=True,
                                                       **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.parametrize("name", NAMES)
def test_directory_loads_with_from_pretrained_to_the_same_logits(exported, name):
    directory, rank0 = exported
    hf = directory / name / "hf"
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and files == sorted(p.name for p in hf.glob("model-*.safetensors"))
    assert not (hf / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for k, t in rank0[name]["state"].items() if k in index["weight_map"])
    for file in files:  # no file past the limit unless one tensor alone is
        assert (hf / file).stat().st_size < SHARD + 4096
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == [type(build(name)).__name__]  # not the Zero<...> subclass
    if name in TIED:  # stored once, as save_pretrained does
        kept, dropped = TIED[name]
        assert kept in index["weight_map"] and dropped not in index["weight_map"]

    reference = _plain(name, rank0[name]["state"])
    loaded = _from_pretrained(hf)
    assert type(loaded) is type(reference)
    diff = (_logits(loaded) - _logits(reference)).abs().max().item()
    print(f"{name}: max |logits(from_pretrained) - logits(zero full params)| = {diff:.3g}")
    assert diff <= 1e-6


@pytest.mark.parametrize("name", NAMES)
def test_bf16_export_stores_bf16_and_says_so(exported, name):
    directory, rank0 = exported
    hf = directory / name / "hf-bf16"
    assert sorted(p.name for p in hf.iterdir() if p.suffix == ".safetensors") == ["model.safetensors"]
    assert not (hf / "model.safetensors.index.json").exists()
    with safe_open(str(hf / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        for key in f.keys():
            assert torch.equal(f.get_tensor(key), rank0[name]["state"][key].to(torch.bfloat16)), key
    assert json.loads((hf / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = _from_pretrained(hf)
    assert next(loaded.parameters()).dtype == torch.bfloat16  # from_pretrained follows the config's dtype


@pytest.mark.parametrize("name", NAMES)
def test_load_from_directory_restores_parameters_exactly(exported, name):
    _, rank0 = exported
    state, reloaded = rank0[name]["state"], rank0[name]["reloaded"]
    assert reloaded.keys() == state.keys()
    for key in state:
        assert torch.equal(reloaded[key], state[key]), key


def _consolidated(directory: Path, name: str, out: Path, *extra: str, console_script: bool = False) -> str:
    command = ["zero"] if console_script else [sys.executable, "-m", "zero_core.cli._cli"]
    done = subprocess.run([*command, "consolidate", str(directory / name / "ckpt"), str(out), *extra],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_consolidate_writes_a_directory_from_pretrained_loads(exported, tmp_path):
    directory, rank0 = exported
    out = tmp_path / "gpt2-hf"
    stdout = _consolidated(directory, "gpt2", out, "--max-shard-size", str(SHARD))
    assert "config.json" in stdout
    state = rank0["gpt2"]["state"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index == json.loads((directory / "gpt2" / "hf" / "model.safetensors.index.json").read_text())
    loaded = _from_pretrained(out)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key
    reference = _plain("gpt2", state)
    assert (_logits(loaded) - _logits(reference)).abs().max().item() <= 1e-6


def test_consolidate_console_script_writes_one_file(exported, tmp_path):
    directory, rank0 = exported
    assert shutil.which("zero"), "the console script of zero-core is not installed: pip install -e packages/core"
    out = tmp_path / "llama.safetensors"
    _consolidated(directory, "llama", out, "--dtype", "bf16", console_script=True)
    state = rank0["llama"]["state"]
    with safe_open(str(out), framework="pt") as f:
        assert sorted(f.keys()) == sorted(state)  # every key of state_dict(), as save_full_state_dict writes it
        for key in f.keys():
            assert torch.equal(f.get_tensor(key), state[key].to(torch.bfloat16)), key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama.safetensors"]


def test_consolidate_single_file_directory_and_tied_twins(exported, tmp_path):
    directory, rank0 = exported
    single = tmp_path / "single"
    report = consolidate(directory / "gpt2" / "ckpt", single, single_file=True)
    assert report.files == ("model.safetensors",) and report.configs == ("config.json", "generation_config.json")
    loaded = _from_pretrained(single)  # the embedding stored once, tied again by from_pretrained
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert torch.equal(loaded.lm_head.weight, rank0["gpt2"]["state"]["lm_head.weight"])
    plain_file = tmp_path / "gpt2.safetensors"
    consolidate(directory / "gpt2" / "ckpt", plain_file)
    with safe_open(str(plain_file), framework="pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("transformer.wte.weight"))


def test_consolidate_holds_one_block_not_the_model(exported, tmp_path):
    directory, rank0 = exported
    block = 1000  # elements; far below the largest parameter (128 x 32 embeddings)
    report = consolidate(directory / "llama" / "ckpt", tmp_path / "out", max_shard_size=SHARD, dtype="bf16",
                         block_elements=block)
    # one fp32 block read plus its bf16 copy, counted as the consolidator allocates them
    assert report.peak_bytes_held == block * 4 + block * 2
    assert report.peak_bytes_held < report.largest_shard_bytes < report.total_bytes
    assert len(report.files) >= 2


def test_consolidate_errors_say_what_is_wrong(exported, tmp_path, capsys):
    directory, _ = exported
    ckpt = directory / "gpt2" / "ckpt"

    def fails(*args: str) -> str:
        assert cli_main(["consolidate", *args]) == 1
        return capsys.readouterr().err

    assert "is not a zero checkpoint" in fails(str(tmp_path), str(tmp_path / "o1"))
    assert "does not exist" in fails(str(tmp_path / "nowhere"), str(tmp_path / "o2"))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    assert "exists and is not empty; pass --overwrite" in fails(str(ckpt), str(tmp_path / "taken"))
    assert "bf16, fp16 or fp32" in fails(str(ckpt), str(tmp_path / "o3"), "--dtype", "int3")
    assert "is not a size" in fails(str(ckpt), str(tmp_path / "o4"), "--max-shard-size", "lots")
    # --overwrite writes the weights beside files it does not own, and keeps those
    assert cli_main(["consolidate", str(ckpt), str(tmp_path / "taken"), "--overwrite"]) == 0
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "taken" / "model.safetensors").is_file()

    # an interrupted save (shard files, no metadata) and a damaged shard file
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    rank_file = next(broken.glob("*.rank00001-of-00002.safetensors"))
    with open(rank_file, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")
    assert "fails its checksum" in fails(str(broken), str(tmp_path / "o5"))
    (broken / "zero_checkpoint.json").unlink()
    assert "incomplete checkpoint" in fails(str(broken), str(tmp_path / "o6"))
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 7))  # nothing written on any error


def test_shard_sizes_parse_as_transformers_does():
    assert parse_shard_size("5GB") == 5 * 10**9
    assert parse_shard_size("500MB") == 500 * 10**6
    assert parse_shard_size("2GiB") == 2 * 2**30
    assert parse_shard_size(1234) == 1234


def layouts_rank(directory: str) -> dict:
    """4 ranks: a zoo model with tied and frozen parameters on a 2x2 mesh (chunk), and 1-D with the tensor strategy."""
    from zero_core.testing import checkpointing

    out = {}
    for label, config, mesh_shape in (
        ("chunk-2x2", zero_core.ZeroConfig(stage=3, chunk=zero_core.ChunkPolicy(chunk_size=300)), (2, 2)),
        ("tensor-4", zero_core.ZeroConfig(stage=2, strategy="tensor"), None),
    ):
        model, optimizer = checkpointing.build("gpt", config, mesh_shape=mesh_shape)
        checkpointing.train_steps(model, optimizer, get_case("gpt"), 0, 1)
        zero_core.save_checkpoint(model, optimizer, Path(directory) / label)
        out[label] = model.full_state_dict()
        model.close()
    return out


@pytest.fixture(scope="module")
def layout_checkpoints(tmp_path_factory):
    directory = tmp_path_factory.mktemp("layouts")
    return directory, run_distributed(layouts_rank, 4, str(directory), timeout=180)[0]


@pytest.mark.parametrize("label", ["chunk-2x2", "tensor-4"])
def test_consolidate_reads_any_layout(layout_checkpoints, tmp_path, label):
    directory, states = layout_checkpoints
    state = states[label]
    out = tmp_path / "model.safetensors"
    consolidate(directory / label, out)
    with safe_open(str(out), framework="pt") as f:
        assert sorted(f.keys()) == sorted(state)
        for key in f.keys():
            assert torch.equal(f.get_tensor(key), state[key]), key
