"""The Llama-shaped test model (grouped-query attention, SwiGLU, fused top-2 experts) trains under zero as in one process.

Its fused expert parameters are split along the experts' dimension, and the experts a rank's
tokens never chose get no gradient there (see [Note: agreeing on all-gathers]).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _small_loop import step_on

from zero_core import ChunkPolicy, ZeroConfig, shard
from zero_core.testing import run_distributed
from zero_core.testing.gpt import SyntheticTokens, lm_loss
from zero_core.testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=256, seq_len=16, d_model=32, n_layer=2, n_head=4, n_kv_head=2, ffn=40, n_experts=4)
STEPS, BATCH = 3, 8


def _train(world: int, rank: int, zero: ZeroConfig | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Llama(CONFIG)
    # SGD, not Adam: Adam scales an element's reassociation noise up to a learning-rate step where its gradient
    # is near zero (an expert few tokens chose), which says nothing about the layout
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if zero is not None:
        model, opt = shard(model, opt, config=zero)
    data = SyntheticTokens(vocab_size=CONFIG.vocab_size, seq_len=CONFIG.seq_len)
    local = BATCH // world
    losses = []
    for step in range(STEPS):
        tokens = data.batch(step, BATCH)[rank * local:(rank + 1) * local]
        losses.append(step_on(lm_loss(model(tokens), tokens), opt, world=world))
    params = model.full_parameters() if zero is not None else {n: p.detach() for n, p in model.named_parameters()}
    return losses, params


def _sharded(strategy: str, stage: int):
    config = ZeroConfig(strategy=strategy, stage=stage, chunk=ChunkPolicy(chunk_size=4096))
    return _train(dist.get_world_size(), dist.get_rank(), config)


@pytest.mark.parametrize(("strategy", "stage"), [("chunk", 3), ("tensor", 3), ("chunk", 2)])
def test_llama_shaped_moe_matches_one_process(strategy, stage):
    ref_losses, ref_params = _train(1, 0, None)
    for losses, params in run_distributed(_sharded, 2, strategy, stage):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, value in ref_params.items():
            scale = value.abs().max().item()
            assert (params[name] - value).abs().max().item() <= 1e-5 * scale, name
