"""A deep, thin language model of Linear + LayerNorm + GELU blocks: the host-overhead section's model.

At width 32 a block's arithmetic takes microseconds, so a step's time is the per-module and
per-unit work of the framework that wraps the model (hooks, gathers, bookkeeping, the optimizer's
dispatch), which is what the section measures. It reads tokens and returns next-token logits,
like the bench's GPT, so the bench's data, loss and loss check apply to it unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MLPBlock", "ThinMLP", "block_params"]


def block_params(width: int) -> int:
    """Elements in one :class:`MLPBlock`: the linear's weight and bias, the norm's weight and bias."""
    return width * width + 3 * width


class MLPBlock(nn.Module):
    """``GELU(LayerNorm(Linear(x)))``: three modules, four parameters."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.linear(x)))


class ThinMLP(nn.Module):
    """A token embedding, ``layers`` :class:`MLPBlock` s in ``blocks`` (FSDP2 wraps each one, and the chunk
    search gives each its own chunk: ``blocks.N`` is a numbered prefix), and an untied head."""

    def __init__(self, *, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
