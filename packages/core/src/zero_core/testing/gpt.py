"""A GPT-style language model and synthetic data with learnable structure.

Used by the demo, the benchmarks and the test zoo. The head is tied to the token
embedding (one parameter registered under two modules), the causal mask is a buffer,
and blocks can run under non-reentrant activation checkpointing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["GPT", "GPTConfig", "SyntheticTokens"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    Attributes:
        vocab_size: Tokens in the vocabulary.
        seq_len: Longest sequence (size of the position embedding and causal mask).
        d_model: Hidden size.
        n_layer: Transformer blocks.
        n_head: Attention heads (must divide ``d_model``).
        checkpoint: Run each block under ``torch.utils.checkpoint`` (non-reentrant).
        qkv_bias: Give the query/key/value projection a bias. The key part of that bias
            has an exactly zero gradient (softmax ignores a shift shared by all keys),
            so Adam turns its rounding noise into learning-rate-sized steps; parity
            tests turn it off because no two summation orders agree on noise.
    """

    vocab_size: int = 8192
    seq_len: int = 128
    d_model: int = 512
    n_layer: int = 6
    n_head: int = 8
    checkpoint: bool = False
    qkv_bias: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide d_model={self.d_model}")

    @property
    def num_params(self) -> int:
        """Parameter count with the head tied to the embedding."""
        d = self.d_model
        block = 2 * 2 * d + (3 * d * d + 3 * d * self.qkv_bias) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        return self.vocab_size * d + self.seq_len * d + self.n_layer * block + 2 * d


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.mask: torch.Tensor
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        mask = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).tril()
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:t, :t])
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(tokens) -> logits``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        blocks = [Block(cfg) for _ in range(cfg.n_layer)]
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied
        self.apply(self._init)
        for block in blocks:
            nn.init.normal_(block.out.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.cfg.checkpoint else block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class SyntheticTokens:
    """Token sequences from a fixed random Markov chain over a small alphabet.

    Each of ``alphabet`` tokens (drawn from the vocabulary) is followed by one of
    ``branching`` successors with equal probability, so a model can drive the loss
    from ``ln(vocab_size)`` down to ``ln(branching)``. Batches are a pure function of
    the step, so every run (and every world size) sees the same global batch.
    """

    def __init__(self, *, vocab_size: int, seq_len: int, alphabet: int = 64, branching: int = 2, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seq_len = seq_len
        self.tokens = torch.randperm(vocab_size, generator=g)[:alphabet]
        self.successors = torch.randint(0, alphabet, (alphabet, branching), generator=g)
        self.seed = seed

    @property
    def floor(self) -> float:
        """The lowest achievable loss (entropy of the next token)."""
        return math.log(self.successors.shape[1])

    def batch(self, step: int, batch_size: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        state = torch.randint(0, len(self.tokens), (batch_size,), generator=g)
        cols = [state]
        choices = torch.randint(0, self.successors.shape[1], (batch_size, self.seq_len - 1), generator=g)
        for i in range(self.seq_len - 1):
            state = self.successors[state, choices[:, i]]
            cols.append(state)
        return self.tokens[torch.stack(cols, dim=1)]
