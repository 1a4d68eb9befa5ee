"""A chunk's gradient buffer exists only from its first gradient's arrival. See [Note: gradient buffers on arrival].

GPT's tied embedding is its own chunk here; the head's backward runs first and the embedding's last, and autograd
sums both parts before the weight's gradient arrives. Midway through the backward (as the first block's backward
begins) that chunk must hold no gradient buffer at stages 2 and 3, while a block's chunk whose gradients have
arrived holds one; stage 1 keeps its buffer for the whole run. The step still trains as one process does.
"""

from __future__ import annotations

import pytest
import torch

from zero_core import ChunkPolicy, ZeroConfig, shard
from zero_core.testing.gpt import GPT, GPTConfig, lm_loss


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_tied_embeddings_gradient_buffer_waits_for_its_gradient(stage):
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
    seen = {}

    def midway(grad):
        seen["tied"], seen["last_block"] = tied.grads.unreduced, last_block.grads.unreduced

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
    assert seen == {"tied": stage == 1, "last_block": True}
    full = model.full_parameters()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6)
