"""Stage 3 replays a repeated gather sequence, and a model that then branches still trains as in one process.

See [Note: replaying a repeated gather sequence] in ``zero_core.runtime._schedule``. A model takes a detour
through an extra layer only when its input asks for it. For three steps no sample does, so each pass's
sequence of all-gathers repeats and the ranks replay it with one control round per pass; at step 4 only
rank 1's samples take the detour (its chunk is in no recording), at step 5 nobody does; steps 6 to 8 are
plain again. The ranks must fall back to agreeing at step 4, replay again once a sequence has repeated,
and train exactly what one process trains on the whole batch (losses within 1e-5 relative, parameters
within 1e-5).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zero_core import ChunkPolicy, ZeroConfig, shard

STEPS, BATCH = 9, 4  # global batch: 2 samples per rank


class Detour(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.detour = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h))
            detour = x[:, 0] > 10  # per sample; the layer runs only on a rank that has such a sample
            if i == 1 and bool(detour.any()):
                h = h + detour.unsqueeze(1) * torch.tanh(self.detour(h))
        return self.head(h)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 2, (BATCH,), generator=g)
    if step == 4:
        x[BATCH // 2 :, 0] = 20.0  # rank 1's samples (the second half) take the detour
    return x, y


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, lo: int, hi: int) -> list[float]:
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[lo:hi]), y[lo:hi])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _run() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = Detour()
    sharded = Detour()
    sharded.load_state_dict(reference.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    # one chunk per layer's weight and bias (72 elements), so each module gathers its own chunk
    model, opt = shard(sharded, opt, config=ZeroConfig(stage=3, chunk=ChunkPolicy(chunk_size=72)))
    scheduler = model.engine.residency.scheduler
    replayed, control = [], []
    losses = []
    per = BATCH // world
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per])
        loss.backward()
        opt.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        losses.append(reported.item() / world)
        replayed.append(scheduler.replayed_passes)
        control.append(model.comm_stats.summary(model.comm_stats.steps[-1])["control"]["calls"])
    ref_losses = _train(reference, ref_opt, 0, BATCH)
    full = model.full_parameters()
    worst = max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    return {"losses": losses, "ref_losses": ref_losses, "worst": worst, "replayed": replayed, "control": control}


def test_replay_then_a_branch_on_one_rank_trains_as_one_process():
    from zero_core.testing import run_distributed

    results = run_distributed(_run, 2, timeout=120)
    for r in results:
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["ref_losses"])) < 1e-5
        assert r["worst"] < 1e-5
    r = results[0]
    assert results[1]["replayed"] == r["replayed"] and results[1]["control"] == r["control"]
    # passes replayed by the end of each step (forwards and backwards count alike): steps 0 and 1 record, 2 and
    # 3 replay both; at step 4 rank 1 needs the detour in forward, which no forward recording holds, so that
    # forward falls back to agreeing and its sequence is new: the next forwards agree (steps 5 and 6) until
    # theirs has repeated. The backward walk always prefetches the detour's chunk, so its recording holds it
    # and every backward from step 2 on replays.
    assert r["replayed"] == [0, 0, 2, 4, 6, 7, 8, 10, 12]
    replay_step, agreeing_step = r["control"][3], r["control"][1]
    assert replay_step == 2 + 1 + 3  # the two drains, the gradient-presence exchange, the three lockstep rounds
    assert agreeing_step > replay_step and r["control"][4] > replay_step and r["control"][8] == replay_step
