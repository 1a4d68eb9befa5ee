"""Small models that each exercise a case where sharded training tends to break.

Every case is small enough to train a few steps on CPU in well under a second, and
comes with a deterministic global batch per step, so a sharded run on N ranks (each
taking its slice of the batch) can be compared with one process on the whole batch.

========================  =========================================================
case                      what it exercises
========================  =========================================================
``gpt``                   tied embedding/head, causal-mask buffer, odd sizes (vocab 37)
``gpt_checkpointed``      the same under non-reentrant activation checkpointing
``unused``                parameters that get no gradient, differing by step and rank,
                          plus one never used at all
``frozen``                frozen parameters mixed with trainable ones, two param groups
``twice``                 one module called twice in a forward
``buffers``               buffers read and updated in forward
``odd_sizes``             parameter sizes no world size divides
========================  =========================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zero_core.testing.gpt import GPT, GPTConfig, lm_loss

__all__ = ["ZOO", "ZooCase", "get_case"]


class Unused(nn.Module):
    """Routes each sample to one of four experts by its content; one layer is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.experts = nn.ModuleList(nn.Linear(10, 10) for _ in range(4))
        self.never = nn.Linear(10, 10)
        self.out = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        route = x[:, 0].mul(4).floor().long().clamp(0, 3)
        mixed = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            sel = route == e
            if sel.any():  # an expert no local sample routes to is not in the graph at all
                mixed = mixed.index_put((sel.nonzero().squeeze(1),), expert(h[sel]))
        return self.out(mixed + h)


class Frozen(nn.Module):
    """A frozen embedding and a frozen layer between trainable ones."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.a = nn.Linear(8, 9)
        self.frozen = nn.Linear(9, 9)
        self.b = nn.Linear(9, 5)
        self.emb.weight.requires_grad_(False)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.frozen(torch.relu(self.a(self.emb(x).mean(1))))))


class Twice(nn.Module):
    """The ``shared`` layer runs twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.shared = nn.Linear(12, 12)
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h) + h)
        return self.out(h)


class Buffers(nn.Module):
    """A fixed scale buffer read in forward and a call counter updated in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.out = nn.Linear(8, 3)
        self.scale: torch.Tensor
        self.calls: torch.Tensor
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.tanh(self.inp(x)) * self.scale * (1 + 0.01 * self.calls.float())
        return self.out(h)


class FusedExperts(nn.Module):
    """Three experts fused into one ``(3, 8, 8)`` weight (transformers 5 stores Mixtral's so) and a position table
    of one row: fewer rows along dim 0 than ranks, so both are cut along a later dimension (see
    [Note: shard dimension] in ``zero_core.chunks._slots``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.pos = nn.Parameter(0.1 * torch.randn(1, 8))
        self.experts = nn.Parameter(0.3 * torch.randn(3, 8, 8))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x) + self.pos)
        route = x[:, 1].mul(3).floor().long().clamp(0, 2)  # each sample's expert, by its content
        y = torch.einsum("bi,boi->bo", h, self.experts[route])
        return self.out(torch.tanh(y) + h)


class OddSizes(nn.Module):
    """Prime-sized layers: no world size divides a parameter or the total."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 7)
        self.b = nn.Linear(7, 13)
        self.c = nn.Linear(13, 3)
        self.gain = nn.Parameter(torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.c(h) * self.gain[:3]


def _regression_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.rand(batch_size, 6, generator=g)
    y = torch.randint(0, 3, (batch_size,), generator=g)
    return x, y


def _token_batch(vocab: int, length: int) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    def batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(2000 + step)
        tokens = torch.randint(0, vocab, (batch_size, length), generator=g)
        return tokens, tokens

    return batch


def _frozen_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randint(0, 11, (batch_size, 4), generator=g), torch.randint(0, 5, (batch_size,), generator=g)


def _frozen_groups(model: nn.Module) -> list[dict[str, object]]:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


_TINY_GPT: dict[str, Any] = dict(vocab_size=37, seq_len=8, d_model=18, n_layer=2, n_head=2, qkv_bias=False)


@dataclass(frozen=True)
class ZooCase:
    """One model of the zoo, with its data and loss.

    Attributes:
        name: Identifier used by tests.
        build: Builds the model (call after seeding).
        batch: ``batch(step, global_batch_size) -> (inputs, targets)``; deterministic.
        loss: ``loss(outputs, targets) -> scalar`` (a mean over the batch).
        param_groups: Optional ``param_groups(model)`` for the optimizer; default: one group.
        chunk_size: Chunk size small enough that the model spans several chunks.
    """

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    param_groups: Callable[[nn.Module], list[dict[str, object]]] | None = None
    chunk_size: int = 64


ZOO: dict[str, ZooCase] = {
    case.name: case
    for case in [
        ZooCase("gpt", lambda: GPT(GPTConfig(**_TINY_GPT)), _token_batch(37, 8), lm_loss, chunk_size=300),
        ZooCase("gpt_checkpointed", lambda: GPT(GPTConfig(**_TINY_GPT, checkpoint=True)), _token_batch(37, 8), lm_loss,
                chunk_size=300),
        ZooCase("unused", Unused, _regression_batch, F.cross_entropy),
        ZooCase("frozen", Frozen, _frozen_batch, F.cross_entropy, param_groups=_frozen_groups),
        ZooCase("twice", Twice, _regression_batch, F.cross_entropy),
        ZooCase("buffers", Buffers, _regression_batch, F.cross_entropy),
        ZooCase("odd_sizes", OddSizes, _regression_batch, F.cross_entropy, chunk_size=50),
        ZooCase("fused_experts", FusedExperts, _regression_batch, F.cross_entropy, chunk_size=100),
    ]
}


def get_case(name: str) -> ZooCase:
    try:
        return ZOO[name]
    except KeyError:
        raise KeyError(f"no zoo case {name!r}; available: {', '.join(ZOO)}") from None
