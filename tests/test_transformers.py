"""HuggingFace ``transformers`` models train under zero with a plain PyTorch loop, to one-process parity.

GPT-2 (tied input and output embeddings, biases) and Llama (grouped-query attention,
rotary embeddings, RMSNorm, no biases) are built from tiny configs, no download, in fp32
with eager attention and no dropout. The loop is the one a user writes for any model:
``model(input_ids=..., labels=...)``, ``loss.backward()``,
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` (with a max-norm small enough
that it acts), ``optimizer.step()``, ``model.zero_grad()``. The sharded model keeps its
class and its ``config``, as HF code expects. Each rank trains on its slice of a fixed
global batch; the reference trains the same model in one process on the whole batch.
HF's causal-LM loss is a mean over tokens and every slice has the same number of
tokens, so the mean over ranks of the slices' gradients is the whole batch's gradient.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

# A test dependency (installed by ``nox -s tests``), not an optional one: no importorskip.
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import zero_core
from zero_core.testing import run_distributed

WORLD = 2
STEPS = 3
BATCH, SEQ, VOCAB = 4, 16, 128  # global batch: 4 sequences of 16 tokens, 2 per rank
MAX_NORM = 1.0  # below the gradient norm of every step (checked on the reference), so clipping acts
CHUNK_SIZE = 8192  # elements; ~30k parameters, so several chunks, some parameters spanning two
TOL = 1e-5

MODELS = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM}


def build(name: str) -> torch.nn.Module:
    """The tiny HF model, with the same initial parameters wherever it is built."""
    torch.manual_seed(0)
    common = {"attn_implementation": "eager", "bos_token_id": 0, "eos_token_id": 0, "loss_type": "ForCausalLM"}
    if name == "gpt2":
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
        return GPT2LMHeadModel(config)
    if name == "llama":
        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
                             attention_dropout=0.0, **common)
        return LlamaForCausalLM(config)
    raise ValueError(name)


def global_batch(step: int) -> torch.Tensor:
    """Token ids of one step's global batch, the same on every rank and in the reference."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def _value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered (collectively) when it is a DTensor, as is otherwise."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().clone()


def train_rank(name: str, stage: int) -> dict:
    """Run on every rank: shard the HF model and train it on this rank's slice of each batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    local = BATCH // world
    model = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = zero_core.ZeroConfig(stage=stage, chunk=zero_core.ChunkPolicy(chunk_size=CHUNK_SIZE))
    model, optimizer = zero_core.shard(model, optimizer, config=config)
    # What HF code (generate, save_pretrained, Trainer) relies on; checked in the test, after the run.
    identity = {
        "class": type(model).__name__,
        "isinstance": isinstance(model, MODELS[name]),
        "config": type(getattr(model, "config", None)).__name__,
    }
    losses, norms = [], []
    for step in range(STEPS):
        x = global_batch(step)[rank * local:(rank + 1) * local]
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        norms.append(_value(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)).item())
        optimizer.step()
        model.zero_grad()
        losses.append(out.loss.item())  # this rank's slice; the test averages over ranks
    params = {n: _value(p) for n, p in model.named_parameters()}  # every rank takes part in each gather
    return {"identity": identity, "losses": losses, "norms": norms, "params": params}


@functools.cache  # shared by both stages
def train_reference(name: str) -> dict:
    """The same model and loop in one process, on each whole global batch (treat the result as read-only)."""
    model = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, norms = [], []
    for step in range(STEPS):
        x = global_batch(step)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        model.zero_grad()
        losses.append(out.loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_model_trains_to_one_process_parity(name, stage):
    reference = train_reference(name)
    assert all(n > MAX_NORM for n in reference["norms"]), reference["norms"]  # clipping acts every step
    results = run_distributed(train_rank, WORLD, name, stage, timeout=120)

    for result in results:  # the sharded model is still the HF model (its class, or a subclass of it)
        identity = result["identity"]
        assert identity["isinstance"], identity
        assert identity["config"] == MODELS[name].config_class.__name__, identity

    losses = [sum(r["losses"][step] for r in results) / WORLD for step in range(STEPS)]
    assert losses == pytest.approx(reference["losses"], abs=TOL, rel=0)
    for result in results:  # clipping saw the global norm, the same on every rank
        assert result["norms"] == pytest.approx(reference["norms"], abs=TOL, rel=0)

    want = reference["params"]
    for rank, result in enumerate(results):
        got = result["params"]
        assert list(got) == list(want), f"rank {rank}: parameter names differ from the model's"
        for key, expected in want.items():
            actual = got[key]
            assert actual.shape == expected.shape and actual.dtype == expected.dtype, (rank, key)
            torch.testing.assert_close(actual, expected, atol=TOL, rtol=0, msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}")
