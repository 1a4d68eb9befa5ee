"""State dicts as PyTorch users expect them, and full parameters on demand.

``model.state_dict()`` (and the DDP idiom ``model.module.state_dict()``) returns the
sharded DTensors under the plain model's keys, in master precision; ``load_state_dict``
takes such a dict or a plain full one and writes into the master shards, so the next
step trains from the loaded values; ``torch.distributed.checkpoint`` saves model and
optimizer at one world size and loads them at another; ``get_model_state_dict(...,
full_state_dict=True, cpu_offload=True)`` gives rank 0 the plain fp32 state dict;
``model.gathered_parameters(writable=True)`` re-initialises a layer. Every check compares
with the same model trained in one process (the MLP of ``test_idioms``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from test_idioms import _batch, _build, _full
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from zero_core import ChunkPolicy, Precision, ZeroConfig, shard
from zero_core.testing import run_distributed

LR = 0.05
TIMEOUT = 120


def _config(stage: int, compute: str | None = None) -> ZeroConfig:
    return ZeroConfig(stage=stage, chunk=ChunkPolicy(chunk_size=64), precision=Precision(compute=compute))


def _step(model, opt, step: int, world: int, rank: int) -> float:
    x, y = _batch(step, world, rank)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if world > 1:
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss /= world
    return float(loss.detach())


def _reference(steps: int, *, reinit_at: int | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        if step == reinit_at:
            with torch.no_grad():
                model.head.weight.fill_(0.01)
        losses.append(_step(model, opt, step, 1, 0))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- model.state_dict / load_state_dict ---------------------------------------------------------------
def _state_dict_rank(stage: int, compute: str | None) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _build()
    plain_keys = list(model.state_dict().keys())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = shard(model, opt, config=_config(stage, compute))
    _step(model, opt, 0, world, rank)
    sd = model.state_dict()
    module_sd = model.module.state_dict()
    out = {
        "keys": list(sd.keys()) == plain_keys and list(module_sd.keys()) == plain_keys,
        "dtensors": all(isinstance(v, DTensor) for v in sd.values()),
        "dtypes": {str(v.dtype) for v in sd.values()},
        "values": {k: _full(v) for k, v in sd.items()},
    }
    # 1) a sharded state dict saved now, loaded after another step, takes the model back: the next
    #    steps equal the run that never took the extra step
    saved = {k: v.detach().clone() for k, v in sd.items()}
    saved_opt = copy.deepcopy(opt.state_dict())  # state_dict() holds references, as in plain PyTorch
    _step(model, opt, 99, world, rank)
    model.load_state_dict(saved)
    opt.load_state_dict(saved_opt)
    out["after_sharded_load"] = [_step(model, opt, s, world, rank) for s in (1, 2)]
    # 2) a plain full state dict (what torch.load of a one-process checkpoint gives) loads as well
    plain = _build().state_dict()
    model.load_state_dict(plain)
    out["after_plain_load"] = {k: _full(v) for k, v in model.state_dict().items()}
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage,compute", [(2, None), (3, None), (2, "bf16")])
def test_model_state_dict_and_load(world, stage, compute):
    results = run_distributed(_state_dict_rank, world, stage, compute, timeout=TIMEOUT)
    losses, _ = _reference(3)
    ref_after_one = _reference(1)[1]
    plain = _build().state_dict()
    for r in results:
        assert r["keys"] and r["dtensors"]
        assert r["dtypes"] == {"torch.float32"}  # the fp32 masters, not the bf16 compute copies
        for k, v in r["values"].items():
            tol = 1e-2 if compute else 1e-5
            assert torch.allclose(v, ref_after_one[k], atol=tol), k
        for k, v in r["after_plain_load"].items():
            assert torch.equal(v, plain[k]), k
        if compute is None:
            assert r["after_sharded_load"] == pytest.approx(losses[1:], rel=1e-5)


# -- torch.distributed.checkpoint -------------------------------------------------------------------
def _dcp_save(path: str, stage: int) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = shard(model, opt, config=_config(stage))
    losses = [_step(model, opt, s, world, rank) for s in range(2)]
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return losses


def _dcp_load(path: str, stage: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = shard(model, opt, config=_config(stage))
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = [_step(model, opt, s, world, rank) for s in (2, 3)]
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"losses": losses, "full": {k: v.clone() for k, v in full.items()}}


@pytest.mark.parametrize("save_world,load_world", [(2, 2), (2, 4), (4, 1)])
def test_torch_distributed_checkpoint_round_trip(tmp_path, save_world, load_world):
    path = str(tmp_path / "dcp")
    saved = run_distributed(_dcp_save, save_world, path, 3, timeout=TIMEOUT)
    loaded = run_distributed(_dcp_load, load_world, path, 2 if load_world != 2 else 3, timeout=TIMEOUT)
    losses, final = _reference(4)
    assert saved[0] == pytest.approx(losses[:2], rel=1e-5)
    assert loaded[0]["losses"] == pytest.approx(losses[2:], rel=1e-5)
    # the full fp32 state dict on rank 0 only (cpu_offload), the plain model's keys and values
    assert list(loaded[0]["full"]) == list(final)
    for k, v in loaded[0]["full"].items():
        assert v.dtype == torch.float32 and not isinstance(v, DTensor)
        assert torch.allclose(v, final[k], atol=1e-5), k
    for r in loaded[1:]:
        assert r["full"] == {}


# -- full parameters on demand ----------------------------------------------------------------------
def _gathered_rank(stage: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = shard(model, opt, config=_config(stage))
    losses = [_step(model, opt, 0, world, rank)]
    with model.gathered_parameters():
        seen = {n: p.detach().clone() for n, p in model.named_parameters()}
        plain = all(not isinstance(p, DTensor) for p in model.parameters())
    with model.gathered_parameters(writable=True):
        with torch.no_grad():
            model.head.weight.fill_(0.01)  # every rank writes the same values
    losses += [_step(model, opt, s, world, rank) for s in (1, 2)]
    return {"seen": seen, "plain": plain, "losses": losses,
            "final": {k: _full(v) for k, v in model.state_dict().items()},
            "sharded_after": all(isinstance(p, DTensor) for p in model.parameters())}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [2, 3])
def test_gathered_parameters_reads_and_writes_back(world, stage):
    results = run_distributed(_gathered_rank, world, stage, timeout=TIMEOUT)
    _, after_one = _reference(1)
    losses, final = _reference(3, reinit_at=1)
    for r in results:
        assert r["plain"] and r["sharded_after"]
        for k, v in r["seen"].items():
            assert torch.allclose(v, after_one[k], atol=1e-5), k
        assert r["losses"] == pytest.approx(losses, rel=1e-5)
        for k, v in r["final"].items():
            assert torch.allclose(v, final[k], atol=1e-5), k
