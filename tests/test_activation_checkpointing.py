"""HuggingFace activation (gradient) checkpointing under zero.

Non-reentrant checkpointing (transformers' default) recomputes each block's forward
inside backward; the recomputation's forward pre-hooks gather the block's chunks again
(stage 3), so it trains to one-process parity. Reentrant checkpointing runs the block
under ``no_grad`` and hides its parameters from the autograd graph until backward, so
zero cannot know which gradients to wait for; the forward raises
:class:`~zero_core.GradientLostError` naming the one-line fix. A tiny GPT-2 is built from
a config (no download); the reference trains the same checkpointed model in one process
on the whole batch with the same loop (clipping included).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import zero_core
from zero_core.testing import run_distributed

WORLD = 2
STEPS = 3
BATCH, SEQ, VOCAB = 4, 16, 128
MAX_NORM = 1.0
CHUNK_SIZE = 8192
TOL = 1e-5
FIX = 'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})'


def build(reentrant: bool) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", bos_token_id=0,
                        eos_token_id=0, loss_type="ForCausalLM")
    model = GPT2LMHeadModel(config)
    # transformers 5 names it activation_checkpointing_enable; gradient_checkpointing_enable is its deprecated
    # alias (the name most user code has), which warns.
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    model.train()
    return model


def global_batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def _loop(model, optimizer, slice_of) -> list[float]:
    losses = []
    for step in range(STEPS):
        x = slice_of(global_batch(step))
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        model.zero_grad()
        losses.append(out.loss.item())
    return losses


def train_rank(stage: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    local = BATCH // world
    model = build(reentrant=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = zero_core.ZeroConfig(stage=stage, chunk=zero_core.ChunkPolicy(chunk_size=CHUNK_SIZE))
    model, optimizer = zero_core.shard(model, optimizer, config=config)
    losses = _loop(model, optimizer, lambda x: x[rank * local:(rank + 1) * local])
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    model.close()
    return {"losses": losses, "params": params}


@functools.cache
def reference() -> dict:
    model = build(reentrant=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = _loop(model, optimizer, lambda x: x)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("stage", [2, 3])
def test_non_reentrant_checkpointing_trains_to_one_process_parity(stage):
    want = reference()
    results = run_distributed(train_rank, WORLD, stage, timeout=180)
    losses = [sum(r["losses"][step] for r in results) / WORLD for step in range(STEPS)]
    assert losses == pytest.approx(want["losses"], abs=TOL, rel=0)
    for rank, result in enumerate(results):
        for key, expected in want["params"].items():
            torch.testing.assert_close(result["params"][key], expected, atol=TOL, rtol=0,
                                       msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}")


def _reentrant() -> dict:
    rank = dist.get_rank()
    messages = {}
    for stage in (2, 3):
        model = build(reentrant=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        config = zero_core.ZeroConfig(stage=stage, chunk=zero_core.ChunkPolicy(chunk_size=CHUNK_SIZE))
        model, optimizer = zero_core.shard(model, optimizer, config=config)
        x = global_batch(0)[rank * 2:(rank + 1) * 2]
        try:
            model(input_ids=x, labels=x)
        except zero_core.GradientLostError as err:
            messages[stage] = str(err)
        model.close()
    return messages


def test_reentrant_checkpointing_is_refused_in_forward_with_the_one_line_fix():
    for messages in run_distributed(_reentrant, WORLD, timeout=120):
        assert set(messages) == {2, 3}, messages
        for message in messages.values():
            assert "reentrant activation checkpointing" in message and FIX in message, message
