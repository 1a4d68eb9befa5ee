"""A Llama-shaped decoder, optionally with fused mixture-of-experts layers, for benchmarks and layout tests.

The shapes are what matter here, not the quality of the model: RMSNorm, grouped-query
attention (fewer key/value heads than query heads), a SwiGLU MLP whose width is not a
multiple of the hidden size (Llama's 8/3 ratio), an untied head, and, with ``n_experts``,
experts stored the way transformers 5 stores Mixtral's: one ``gate_up_proj`` of shape
``[experts, 2 * ffn, d_model]`` and one ``down_proj`` of ``[experts, d_model, ffn]``, with
top-k routing. Positions are not encoded (the synthetic tokens need none). The blocks are
``model.blocks`` so that the benchmarks wrap them for FSDP2 as they wrap the GPT's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Llama", "LlamaConfig"]


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a :class:`Llama`.

    Attributes:
        vocab_size: Tokens in the vocabulary.
        seq_len: Longest sequence.
        d_model: Hidden size.
        n_layer: Transformer blocks.
        n_head: Query heads (must divide ``d_model``).
        n_kv_head: Key and value heads (must divide ``n_head``).
        ffn: Width of the MLP (of each expert).
        n_experts: Experts per block; 0 for a dense MLP.
        top_k: Experts each token is routed to.
    """

    vocab_size: int
    seq_len: int
    d_model: int
    n_layer: int
    n_head: int
    n_kv_head: int
    ffn: int
    n_experts: int = 0
    top_k: int = 2

    def __post_init__(self) -> None:
        if self.d_model % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must divide d_model ({self.d_model}) and n_kv_head "
                             f"({self.n_kv_head}) must divide n_head")
        if self.n_experts and not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be between 1 and n_experts ({self.n_experts}), got {self.top_k}")


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.d_model // cfg.n_head
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Top-k routed SwiGLU experts, fused into two parameters (transformers 5's Mixtral layout)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.top_k, self.ffn = cfg.top_k, cfg.ffn
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.n_experts, 2 * cfg.ffn, cfg.d_model))
        self.down_proj = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model, cfg.ffn))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.softmax(self.router(tokens), dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for expert in range(self.gate_up_proj.shape[0]):
            rows, slot = (chosen == expert).nonzero(as_tuple=True)
            if rows.numel() == 0:  # an expert no token chose: its parameters get no gradient on this rank
                continue
            gate, up = (tokens[rows] @ self.gate_up_proj[expert].T).split(self.ffn, dim=-1)
            y = (F.silu(gate) * up) @ self.down_proj[expert].T
            out = out.index_add(0, rows, y * weights[rows, slot, None])
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.d_model)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.d_model)
        self.mlp = Experts(cfg) if cfg.n_experts else SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Decoder-only transformer in Llama's shapes; ``forward(tokens) -> logits``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))
