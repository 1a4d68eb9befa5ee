"""A small decoder-only transformer over bytes (vocabulary 256): the model the text example trains.

Plain PyTorch with nothing zero-specific, so the weights the example exports load into it
with ``load_state_dict`` and no zero installed. Every tensor is made by a factory function
without an explicit device, which is what ``zero_core.lazy_init()`` needs to record it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ByteGPT", "ByteGPTConfig", "next_byte_loss"]

VOCAB = 256  # one token per byte value: no tokenizer


@dataclass(frozen=True, kw_only=True, slots=True)
class ByteGPTConfig:
    """Shape of a :class:`ByteGPT`.

    Attributes:
        seq_len: Longest sequence (size of the position embedding).
        d_model: Hidden size.
        n_layer: Transformer blocks.
        n_head: Attention heads (must divide ``d_model``).
    """

    seq_len: int = 128
    d_model: int = 128
    n_layer: int = 2
    n_head: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide d_model={self.d_model}; pick a d_model that is a multiple")


class Block(nn.Module):
    def __init__(self, cfg: ByteGPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteGPT(nn.Module):
    """``forward(tokens) -> logits`` over the 256 byte values; the head is not tied to the embedding."""

    def __init__(self, cfg: ByteGPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(VOCAB, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:  # GPT-2's scaled init of the projections that write into the residual stream
            nn.init.normal_(block.proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))
            nn.init.normal_(block.out.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int, *, temperature: float = 0.0, seed: int = 0) -> torch.Tensor:
        """Continue a 1-D byte tensor, with the last ``seq_len`` bytes as context.

        Greedy at ``temperature=0``; otherwise sampled from a generator seeded with ``seed``,
        so the same weights always give the same text.
        """
        generator = torch.Generator(device=prompt.device).manual_seed(seed)
        out = prompt
        for _ in range(new_tokens):
            logits = self(out[-self.cfg.seq_len:].unsqueeze(0))[0, -1]
            if temperature == 0:
                token = logits.argmax()
            else:
                token = torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator)
            out = torch.cat([out, token.reshape(1)])
        return out

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def next_byte_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of predicting each byte from the ones before it, in nats."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
