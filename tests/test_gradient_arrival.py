"""A chunk's gradient buffer exists only from its first gradient's arrival. See [Note: gradient buffers on arrival].

GPT's tied embedding is its own chunk here; the head's backward runs first and the embedding's last, and autograd
sums both parts before the weight's gradient arrives. Midway through the backward (as the first block's backward
begins) that chunk must hold no gradient buffer at stages 2 and 3, while a block's chunk whose gradients have
arrived holds one; stage 1 keeps its buffer for the whole run. The step still trains as one process does.

This runs at one rank, where stages 2 and 3 take no buffer at all unless told to (``buffers``): autograd's own
gradients wait on the unsharded parameters instead (see [Note: gradients handed over as autograd made them] in
``zero_core.chunks._chunk_grads``), so the tied chunk's parameter has none midway and the block's have theirs.
"""

from __future__ import annotations

import pytest
import torch

from zero_core import ChunkPolicy, ZeroConfig, shard
from zero_core.testing.gpt import GPT, GPTConfig, lm_loss


@pytest.mark.parametrize("buffers", [True, False])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_tied_embeddings_gradient_buffer_waits_for_its_gradient(stage, buffers):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, seq_len=16, d_model=32, n_layer=2, n_head=2)
    reference, model = GPT(cfg), GPT(cfg)
    model.load_state_dict(reference.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model, opt = shard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       config=ZeroConfig(stage=stage, chunk=ChunkPolicy(chunk_size=512 * 32)))
    engine = model.engine
    tied = next(c for c in engine.chunks if any(s.name.endswith("wte.weight") for s in c.slots))
    last_block = next(c for c in engine.chunks if any(".1." in s.name for s in c.slots))
    if buffers:  # as at more ranks, where the gradients must be laid out for the reduce-scatter
        for chunk in engine.chunks:
            chunk.grads.may_hand_directly = False
    direct = stage != 1 and not buffers
    seen = {}

    def midway(grad):
        seen["tied"], seen["last_block"] = tied.grads.unreduced, last_block.grads.unreduced
        seen["tied_held"] = [s.param.grad is not None for s in tied.slots]
        seen["held"] = [s.param.grad is not None for s in last_block.slots]
        seen["arrived"] = list(last_block.grads.got)

    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    hidden = {}
    model.blocks[0].register_forward_hook(lambda m, a, out: hidden.setdefault("h", out))
    loss = lm_loss(model(tokens), tokens)
    hidden["h"].register_hook(midway)  # fires as the first block's backward begins
    loss.backward()
    opt.step()
    ref_loss = lm_loss(reference(tokens), tokens)
    ref_loss.backward()
    ref_opt.step()
    # the tied chunk's one parameter has no gradient yet (stage 1: its kept buffer's view); the block's chunk has
    # some of its gradients (those of the second block): every parameter points into its buffer, or where there is
    # none, exactly those that arrived hold autograd's own tensors
    arrived = seen.pop("arrived")
    assert 0 < sum(arrived) < len(arrived)
    assert seen == {"tied": stage == 1, "last_block": not direct, "tied_held": [stage == 1],
                    "held": arrived if direct else [True] * len(arrived)}
    full = model.full_parameters()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6)
