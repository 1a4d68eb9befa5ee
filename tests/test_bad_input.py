"""Bad input fails with a clear error that says what to change, and never hangs."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from zero_core import (
    ChunkPolicy,
    GradientLostError,
    PluginNotFoundError,
    RanksDisagreeError,
    ZeroConfig,
    ZeroError,
    ZeroSetupError,
    shard,
)
from zero_core.testing import run_distributed
from zero_core.testing.zoo import get_case

SMALL = ZeroConfig(chunk=ChunkPolicy(chunk_size=64))


def model_and_opt(case="odd_sizes"):
    torch.manual_seed(0)
    model = get_case(case).build()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_optimizer_over_other_parameters():
    model, _ = model_and_opt()
    stranger = nn.Linear(3, 3)
    with pytest.raises(ZeroSetupError, match=r"param group 0, parameter 0 \(shape \(3, 3\)\) is not a parameter of the model"):
        shard(model, torch.optim.SGD(stranger.parameters(), lr=0.1), config=SMALL)


def test_not_an_optimizer_or_not_a_module():
    model, opt = model_and_opt()
    with pytest.raises(ZeroSetupError, match="needs a torch.optim.Optimizer"):
        shard(model, "adam", config=SMALL)  # type: ignore[arg-type]
    with pytest.raises(ZeroSetupError, match="needs an nn.Module"):
        shard(lambda x: x, opt, config=SMALL)  # type: ignore[arg-type]


def test_model_wrapped_twice():
    model, opt = model_and_opt()
    sharded, opt = shard(model, opt, config=SMALL)
    with pytest.raises(ZeroSetupError, match="already sharded"):
        shard(sharded, opt, config=SMALL)
    with pytest.raises(ZeroSetupError, match="already sharded"):
        shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=SMALL)


def test_optimizer_that_already_stepped():
    model, opt = model_and_opt()
    model(torch.rand(2, 6)).sum().backward()
    opt.step()
    with pytest.raises(ZeroSetupError, match="already has state"):
        shard(model, opt, config=SMALL)


def test_world_size_above_one_without_a_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model, opt = model_and_opt()
    with pytest.raises(ZeroSetupError, match=r"WORLD_SIZE is 2 but torch.distributed is not initialised.*init_process_group"):
        shard(model, opt, config=SMALL)


def test_unknown_plugin_names_list_the_available_ones(monkeypatch):
    model, opt = model_and_opt()
    with pytest.raises(PluginNotFoundError, match=r"no placement policy named 'gemni' .*available: device, gemini, host.*static"):
        shard(model, opt, config=ZeroConfig(placement="gemni"))
    monkeypatch.setenv("ZERO_BLOCKED_PLUGINS", "zero-offload")  # as if it were not installed: the error says what to install
    # a command that works from here: this checkout's package, editable (zero is not on an index yet)
    with pytest.raises(PluginNotFoundError, match=r"no placement policy named 'gemini' .*available: device, host.*pip install -e .*packages/offload"):
        shard(model, opt, config=ZeroConfig(placement="gemini"))
    with pytest.raises(PluginNotFoundError, match=r"no shard strategy named 'tensr' .*available: chunk, tensor"):
        shard(model, opt, config=ZeroConfig(strategy="tensr"))


def test_first_use_order_needs_example_inputs():
    model, opt = model_and_opt()
    with pytest.raises(ZeroSetupError, match="needs example_inputs"):
        shard(model, opt, config=ZeroConfig(chunk=ChunkPolicy(param_order="first_use")))


def test_calling_a_submodule_outside_the_wrapped_model():
    model, opt = model_and_opt()
    shard(model, opt, config=SMALL)
    with pytest.raises(ZeroError, match="call the model returned by zero_core.shard"):
        model.a(torch.rand(2, 6))


def test_state_dict_refusals_name_the_fix(tmp_path):
    """state_dict and load_state_dict work between steps (test_state_dicts.py); these are the cases they refuse."""
    model, opt = model_and_opt()
    sharded, _ = shard(model, opt, config=SMALL)
    with pytest.raises(ZeroError, match=r"assign=True.*load without assign=True"):
        sharded.load_state_dict(sharded.state_dict(), assign=True)
    handle = next(iter(sharded.children())).register_forward_hook(lambda *_: sharded.state_dict())
    with pytest.raises(ZeroError, match=r"inside forward or backward.*between steps"):
        sharded(*get_case("odd_sizes").batch(0, 2)[:1])
    handle.remove()
    # shards on disk: the error names the verbs that stage them in
    disk = ZeroConfig(chunk=ChunkPolicy(chunk_size=64), placement="static",
                      placement_options={"offload_param_frac": 1.0, "offload_optim_frac": 1.0, "host_budget_mb": 0.003,
                                         "disk_dir": str(tmp_path / "tier")})
    model, opt = model_and_opt()
    on_disk, _ = shard(model, opt, config=disk)
    with pytest.raises(ZeroError, match=r"on disk.*save_checkpoint.*full_state_dict"):
        on_disk.state_dict()
    on_disk.close()


def _disagreeing_ranks():
    torch.manual_seed(0)
    width = 7 if dist.get_rank() == 0 else 8
    model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2))
    try:
        shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=SMALL)
    except RanksDisagreeError as err:
        return str(err)
    return "no error"


def test_ranks_that_build_different_models_fail_at_setup_on_every_rank():
    messages = run_distributed(_disagreeing_ranks, 2, timeout=60)
    for message in messages:
        assert "rank 1 holds a different model or config than rank 0" in message
        assert "param 0.weight shape=(7, 4)" in message and "param 0.weight shape=(8, 4)" in message


class ReentrantBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return x


def _reentrant_checkpoint():
    torch.manual_seed(0)
    model = ReentrantBlocks()
    model, opt = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=ZeroConfig(chunk=ChunkPolicy(chunk_size=72)))
    try:
        model(torch.rand(2, 8, requires_grad=True)).sum().backward()
    except GradientLostError as err:
        return str(err)
    return "no error"


def test_reentrant_activation_checkpointing_is_refused_in_forward():
    for message in run_distributed(_reentrant_checkpoint, 2, timeout=60):
        assert "reentrant activation checkpointing" in message and "use_reentrant=False" in message
