"""Activation offload (zero_offload.offload_activations): parity with plain PyTorch, parameters never packed, exact counts.

On a CPU-only machine every saved tensor is already on the host and is kept as it is; ``copy_host_tensors=True``
makes pack copy it anyway, so these tests run the copy path (pack to a fresh host tensor, unpack to a fresh
tensor on the saved tensor's device) and check that training with it is bit-for-bit plain training.
"""


import pytest
import torch
from torch import nn

from zero_core import ChunkPolicy, ConfigError, ZeroConfig, shard
from zero_core.testing.gpt import GPT, GPTConfig, lm_loss
from zero_offload import ActivationOffload, DeviceBudgetError, GeminiConfig, offload_activations
from zero_offload._activations import _Packed, copy_to

TINY = GPTConfig(vocab_size=37, seq_len=8, d_model=18, n_layer=2, n_head=2, qkv_bias=False)


def _batch(step):
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, 37, (4, 8), generator=g)


def _train(model, optimizer, steps=3):
    losses = []
    for step in range(steps):
        tokens = _batch(step)
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _plain():
    torch.manual_seed(0)
    model = GPT(TINY)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


class _Recording(ActivationOffload):
    """Keeps what pack got and gave back, to check no model tensor was ever copied."""

    def __init__(self, *args, **kwargs):
        self.seen = []
        super().__init__(*args, **kwargs)

    def _pack(self, tensor, model, group, module):
        packed = super()._pack(tensor, model, group, module)
        self.seen.append((tensor, packed))
        return packed


def test_copy_to_makes_a_copy_with_the_same_values_and_layout():
    source = torch.arange(24.0).reshape(4, 6).t()  # not contiguous: the copy keeps the strides
    out = copy_to(source, torch.device("cpu"))
    assert out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    assert out.stride() == source.stride() and out.dtype == source.dtype
    assert torch.equal(out, source)


def test_training_with_offloaded_blocks_equals_plain_training_bit_for_bit():
    expected, optimizer = _plain()
    reference = _train(expected, optimizer)
    model, optimizer = _plain()
    offload = _Recording(model.blocks, copy_host_tensors=True)
    losses = _train(model, optimizer)
    assert losses == reference
    for (name, p), q in zip(model.named_parameters(), expected.parameters()):
        assert torch.equal(p, q), name
    # every copy that went out came back, and parameters (and views of them, like a Linear's weight.t()) never went
    assert offload.offloaded > 0 and offload.unpacked == offload.offloaded and offload.kept == 0
    assert offload.prefetched > 0  # block 0's tensors, brought back when block 1's backward began
    storages = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    for tensor, packed in offload.seen:
        if tensor.untyped_storage().data_ptr() in storages:
            assert packed is tensor
        else:
            assert isinstance(packed, _Packed)
    kept_as_is = sum(packed is tensor for tensor, packed in offload.seen)
    assert offload.skipped == kept_as_is > 0


def test_counts_are_exact_for_a_known_block():
    # Linear(4, 8) -> ReLU -> Linear(8, 4) on an input that needs no gradient: the first addmm saves only its
    # input (for the weight's gradient; weight.t() would serve only the input's gradient); relu saves its result;
    # the second addmm saves its input (relu's result, packed a second time: one copy each) and weight.t(), a view
    # of a parameter, which is skipped.
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    offload = offload_activations(block, copy_host_tensors=True)
    x = torch.randn(3, 4)
    block(x).sum().backward()
    assert offload.counts() == {"offloaded": 3, "kept": 0, "skipped": 1, "unpacked": 3, "prefetched": 0,
                                "offloaded_bytes": (3 * 4 + 3 * 8 + 3 * 8) * 4}


def test_the_first_unpack_of_a_block_prefetches_the_block_before_it():
    # Two such blocks in a row: the second one's input needs a gradient, so its first addmm also saves weight.t()
    # (skipped). Its backward runs first; its first unpack brings back the first block's 3 tensors ahead of their use.
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)) for _ in range(2))
    offload = offload_activations(blocks, copy_host_tensors=True)
    x = torch.randn(3, 4)
    for step in range(2):
        blocks[1](blocks[0](x)).sum().backward()
        assert offload.counts() == {"offloaded": 6 * (step + 1), "kept": 0, "skipped": 3 * (step + 1),
                                    "unpacked": 6 * (step + 1), "prefetched": 3 * (step + 1),
                                    "offloaded_bytes": 2 * (3 * 4 + 3 * 8 + 3 * 8) * 4 * (step + 1)}


def test_without_copies_cpu_tensors_are_kept_and_counted():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with offload_activations(block) as offload:
        block(torch.randn(3, 4)).sum().backward()
    assert offload.counts() == {"offloaded": 0, "kept": 3, "skipped": 1, "unpacked": 0, "prefetched": 0,
                                "offloaded_bytes": 0}
    assert "forward" not in vars(block)  # removed on exit: the module's own forward again


def test_nothing_is_packed_without_grad():
    block = nn.Linear(4, 4)
    offload = offload_activations(block, copy_host_tensors=True)
    with torch.no_grad():
        block(torch.randn(2, 4))
    assert offload.counts()["offloaded"] == 0 and offload.counts()["skipped"] == 0


def test_bad_input_is_refused_with_the_fix():
    with pytest.raises(TypeError, match="takes a module or an iterable of modules"):
        offload_activations([nn.Linear(2, 2), "block"])
    with pytest.raises(TypeError, match="takes a module or an iterable of modules"):
        offload_activations([])
    block = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="same module twice"):
        offload_activations([block, block])
    offload_activations(block)
    with pytest.raises(ValueError, match="already replaced on the instance"):
        offload_activations(block)


def test_under_shard_one_rank_matches_plain_training_and_skips_the_gathered_parameters():
    model, optimizer = _plain()
    reference = _train(model, optimizer)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    model, optimizer = _plain()
    offload = _Recording(model.blocks, copy_host_tensors=True)
    config = ZeroConfig(stage=3, chunk=ChunkPolicy(chunk_size=300), placement="gemini",
                        placement_options={"device_budget_mb": 1})
    sharded = shard(model, optimizer, config=config)
    losses = _train(sharded.model, sharded.optimizer)
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)
    full = sharded.model.full_parameters()
    for name, value in expected.items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-7, msg=name)
    assert offload.skipped > 0 and offload.unpacked == offload.offloaded > 0


def test_gemini_installs_it_on_the_named_classes_and_trains_as_plain_pytorch():
    expected, optimizer = _plain()
    reference = _train(expected, optimizer)
    model, optimizer = _plain()
    config = ZeroConfig(stage=3, chunk=ChunkPolicy(chunk_size=300), placement="gemini",
                        placement_options=GeminiConfig(device_budget_mb=1, offload_activations=("Block",)))
    sharded = shard(model, optimizer, config=config)
    assert all("forward" in vars(block) for block in model.blocks)
    losses = _train(sharded.model, sharded.optimizer)
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)
    policy = sharded.model.engine.placement
    counts = policy.report()["activations"]
    # on the CPU every saved activation is already on the host: kept, none copied; the gathered parameters skipped
    assert counts["kept"] > 0 and counts["skipped"] > 0 and counts["offloaded"] == 0
    policy.close()
    assert not any("forward" in vars(block) for block in model.blocks)


def test_gemini_refuses_a_class_the_model_does_not_have():
    model, optimizer = _plain()
    config = ZeroConfig(stage=3, chunk=ChunkPolicy(chunk_size=300), placement="gemini",
                        placement_options={"device_budget_mb": 1, "offload_activations": ["Blokc"]})
    with pytest.raises(ConfigError, match=r"names \['Blokc'\], which no module of the model is; its module classes are"):
        shard(model, optimizer, config=config)


@pytest.mark.parametrize("value", ["Block", ("Block", 3), ("not a name",)])
def test_the_option_is_a_tuple_of_class_names(value):
    with pytest.raises(ConfigError, match=r"GeminiConfig\.offload_activations must be a tuple of module class names"):
        GeminiConfig(offload_activations=value)


DEEP = GPTConfig(vocab_size=37, seq_len=8, d_model=18, n_layer=6, n_head=2, qkv_bias=False)


def _auto(budget_bytes, steps=3):
    torch.manual_seed(0)
    model = GPT(DEEP)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = ZeroConfig(stage=3, chunk=ChunkPolicy(chunk_size=300), placement="gemini",
                        placement_options=GeminiConfig(device_budget_mb=budget_bytes / 2**20, offload_activations="auto",
                                                       trace_every_step=True))
    sharded = shard(model, optimizer, config=config)
    losses = _train(sharded.model, sharded.optimizer, steps=steps)
    policy = sharded.model.engine.placement
    report = policy.report()
    full = sharded.model.full_parameters()
    policy.close()
    return losses, full, report


def test_gemini_plans_activation_offload_from_its_trace_under_a_budget():
    """offload_activations="auto": the warm-up offloads every block and measures; the plan keeps the last blocks'
    activations on the device while they fit, traces one more step, and trains as plain PyTorch within the budget."""
    torch.manual_seed(0)
    model = GPT(DEEP)
    reference = _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    expected = dict(model.named_parameters())
    # no pressure: every block keeps its activations, and the plan is that of no offload
    _, _, roomy = _auto(2**30)
    assert roomy["planned_activations"] == [] and set(roomy["activation_bytes"]) == {f"blocks.{i}" for i in range(6)}
    unoffloaded, block = roomy["need"], max(roomy["activation_bytes"].values())
    # below what the step needs with every block offloaded: refused at planning, naming that figure
    with pytest.raises(DeviceBudgetError, match=r"with the saved activations of 6 block\(s\) in host memory") as refused:
        _auto(30_000, steps=1)
    floor = refused.value.needed
    # room for about one block's activations more: that block keeps them on the device, the others offload
    # (the CPU tracer's figures move by a few KiB between runs, with when Python frees tensors: half a block of slack)
    budget = floor + 3 * block // 2
    assert budget < unoffloaded  # without offload the step would not fit
    losses, full, report = _auto(budget)
    assert 0 < len(report["planned_activations"]) < 6, (unoffloaded, floor, budget, report)
    assert report["planned_activations"] == [f"blocks.{i}" for i in range(len(report["planned_activations"]))]
    assert report["need"] <= budget and report["audit_max"] <= budget, report  # every operator of every step audited
    assert report["activations"]["offloaded"] > 0 and report["activations"]["unpacked"] == report["activations"]["offloaded"]
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)
    for name, value in expected.items():
        torch.testing.assert_close(full[name], value.detach(), rtol=1e-5, atol=1e-7, msg=name)
