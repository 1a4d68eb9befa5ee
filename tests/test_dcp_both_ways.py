"""zero's checkpoints and PyTorch's ``torch.distributed.checkpoint`` (DCP), both ways, at another world size.

One world of 2 writes: FSDP2 (``fully_shard``) saves with ``get_state_dict`` + ``dcp.save``, and zero saves
with ``save_checkpoint`` (chunks of 64 elements, so its pieces start mid-row). One world of 4 reads each
into the other: ``load_checkpoint`` takes the FSDP2 directory, ``dcp.load`` with ``ZeroStorageReader``
takes zero's into FSDP2 and into zero; this process reads zero's into a plain model with ``no_dist=True``.
Every result is compared with the same MLP and AdamW trained in one process (``test_state_dicts``'
reference): parameters and optimizer states after the two saved steps, and the loss of the step after.
See [Note: DCP both ways] in ``zero_core.checkpoint._dcp``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _small_loop import train_step
from test_idioms import _build
from test_state_dicts import LR, _reference, _step
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zero_core
from zero_core import ChunkPolicy, ZeroConfig, ZeroStorageReader, shard
from zero_core.testing import rank_device, run_distributed

TIMEOUT = 240
# a plain load (no_dist) says it assumes one process: it does
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")
SAVED = 2  # steps before the save
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _fsdp2(model):
    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _zero(model, opt):
    return shard(model, opt, config=ZeroConfig(stage=3, chunk=ChunkPolicy(chunk_size=64)))


def _full(model, opt) -> dict:
    """Model and optimizer state, whole, on rank 0 (plain tensors keyed by parameter name)."""
    msd, osd = get_state_dict(model, opt, options=FULL)
    return {"model": {k: v.clone() for k, v in msd.items()},
            "optim": {name: {k: v.clone() for k, v in state.items()} for name, state in osd.get("state", {}).items()},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in osd.get("param_groups", [])]}


def _write(dcp_dir: str, zero_dir: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _fsdp2(_build())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    fsdp_losses = [_step(model, opt, s, world, rank) for s in range(SAVED)]
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
    # torchtitan's layout: the model's keys at the top level, the optimizer's flattened (param groups by name)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({**msd, "optimizer": osd}, checkpoint_id=dcp_dir + "-titan")

    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = _zero(model, opt)
    zero_losses = [_step(model, opt, s, world, rank) for s in range(SAVED)]
    zero_core.save_checkpoint(model, opt, zero_dir)
    zero_core.save_full_state_dict(model, zero_dir + "-hf")  # zero's own Hugging Face export, read by DCP's HF reader
    model.close()

    # a whole-tensor optimizer (Muon): its states are saved whole by each parameter's owner
    model = _muon_model()
    opt = torch.optim.Muon(model.parameters(), lr=0.02, weight_decay=0.01)
    model, opt = shard(model, opt, config=ZeroConfig(stage=3))
    for s in range(SAVED):
        train_step(model, opt, s, features=7, world=world, rank=rank)
    zero_core.save_checkpoint(model, opt, zero_dir + "-muon")
    model.close()
    return {"fsdp": fsdp_losses, "zero": zero_losses}


def _refused(model, opt, dcp_dir: str) -> tuple[str | None, bool]:
    """Load a DCP checkpoint that does not fit: its error, and whether the parameters, the optimizer states and the
    step count are as they were."""
    before = [p.to_local().clone() for p in model.parameters()]
    error = None
    try:
        zero_core.load_checkpoint(model, opt, dcp_dir)
    except zero_core.CheckpointError as exc:
        error = str(exc)
    unchanged = all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters(), strict=True)) \
        and not opt.state and model.engine.step_count == 0
    model.close()
    return error, unchanged


def _read(dcp_dir: str, zero_dir: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}

    # FSDP2 -> DCP -> zero, through zero's own verb
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = _zero(model, opt)
    assert zero_core.load_checkpoint(model, opt, dcp_dir) is None
    out["step_count"] = model.engine.step_count  # DCP has no engine step: it stays
    out["zero_from_dcp"] = _full(model, opt)
    out["zero_from_dcp_next"] = _step(model, opt, SAVED, world, rank)
    model.close()
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = _zero(model, opt)
    zero_core.load_checkpoint(model, opt, dcp_dir + "-titan")
    out["zero_from_titan"] = _full(model, opt)
    out["zero_from_titan_next"] = _step(model, opt, SAVED, world, rank)
    model.close()

    # another model (a wider head): refused on every rank before anything changes
    model = _build()
    model.head = torch.nn.Linear(10, 4)
    out["refused"], out["unchanged"] = _refused(*_zero(model, torch.optim.AdamW(model.parameters(), lr=LR)), dcp_dir)
    # another optimizer (SGD's momentum for AdamW's moments): refused, and the states made to compare are dropped
    model = _build()
    out["refused_optim"], out["unchanged_optim"] = _refused(
        *_zero(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)), dcp_dir)

    # zero -> ZeroStorageReader -> FSDP2
    model = _fsdp2(_build())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=ZeroStorageReader(zero_dir))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["fsdp_from_zero"] = _full(model, opt)
    out["fsdp_from_zero_next"] = _step(model, opt, SAVED, world, rank)

    # zero -> ZeroStorageReader -> zero (DCP's path, not load_checkpoint's)
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = _zero(model, opt)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=zero_dir, storage_reader=ZeroStorageReader())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["zero_from_zero"] = _full(model, opt)
    out["zero_from_zero_next"] = _step(model, opt, SAVED, world, rank)
    model.close()
    return out if rank == 0 else {}


def _muon_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 13, bias=False), torch.nn.Tanh(), torch.nn.Linear(13, 3, bias=False))


def _plain_reference() -> dict:
    """The one-process run's parameters, AdamW states (by parameter name) and param groups after the saved steps."""
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for s in range(SAVED):
        _step(model, opt, s, 1, 0)
    names = {id(p): n for n, p in model.named_parameters()}
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": {names[id(p)]: dict(s) for p, s in opt.state.items()},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}


def _assert_state(got: dict, want: dict, what: str) -> None:
    assert list(got["model"]) == list(want["model"]), what
    for k, v in want["model"].items():
        assert torch.allclose(got["model"][k], v, rtol=1e-5, atol=1e-6), f"{what}: {k}"
    assert set(got["optim"]) == set(want["optim"]), what
    for name, state in want["optim"].items():
        assert set(got["optim"][name]) == set(state), f"{what}: {name}"
        for key, value in state.items():
            assert torch.allclose(got["optim"][name][key].float(), value.float(), rtol=1e-5, atol=1e-7), \
                f"{what}: {name}.{key}"
    for g, w in zip(got["groups"], want["groups"], strict=True):
        assert g["lr"] == w["lr"] and tuple(g["betas"]) == tuple(w["betas"]) and g["eps"] == w["eps"], what


def test_fsdp2_and_zero_read_each_others_checkpoints(tmp_path):
    dcp_dir, zero_dir = str(tmp_path / "dcp"), str(tmp_path / "zero")
    written = run_distributed(_write, 2, dcp_dir, zero_dir, timeout=TIMEOUT)[0]
    read = run_distributed(_read, 4, dcp_dir, zero_dir, timeout=TIMEOUT)[0]
    losses, _ = _reference(SAVED + 1)
    want = _plain_reference()
    assert written["fsdp"] == pytest.approx(losses[:SAVED], rel=1e-5)
    assert written["zero"] == pytest.approx(losses[:SAVED], rel=1e-5)
    assert read["step_count"] == 0
    assert "other shapes than this model" in read["refused"] and "model.head.weight: (3, 10) saved, (4, 10)" \
        in read["refused"] and read["unchanged"]
    assert "does not match this model: it lacks" in read["refused_optim"] and "momentum_buffer" in read["refused_optim"]
    assert read["unchanged_optim"]
    for what in ("zero_from_dcp", "zero_from_titan", "fsdp_from_zero", "zero_from_zero"):
        _assert_state(read[what], want, what)
        assert read[f"{what}_next"] == pytest.approx(losses[SAVED], rel=1e-5), what

    # zero -> ZeroStorageReader -> a plain model and optimizer, no process group
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=ZeroStorageReader(zero_dir), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    names = {id(p): n for n, p in model.named_parameters()}
    plain = {"model": dict(model.state_dict()), "optim": {names[id(p)]: dict(s) for p, s in opt.state.items()},
             "groups": opt.param_groups}
    _assert_state(plain, want, "plain")
    assert _step(model, opt, SAVED, 1, 0) == pytest.approx(losses[SAVED], rel=1e-5)

    # the whole checkpoint as one nested dict, as dcp_to_torch_save writes it
    whole = _load_state_dict_from_keys(storage_reader=ZeroStorageReader(zero_dir))
    assert set(whole) == {"model", "optim"}
    for k, v in want["model"].items():
        assert torch.allclose(whole["model"][k], v, rtol=1e-5, atol=1e-6), k
    # one group, of every parameter (in the order of zero's chunks: get_state_dict matches them by name)
    assert sorted(whole["optim"]["param_groups"][0]["params"]) == sorted(n for n, _ in _build().named_parameters())

    # zero's Hugging Face export, through DCP's own Hugging Face reader
    plain = dict(_build().state_dict())
    dcp.load(plain, storage_reader=HuggingFaceStorageReader(zero_dir + "-hf"), no_dist=True)
    for k, v in want["model"].items():
        assert torch.allclose(plain[k], v, rtol=1e-5, atol=1e-6), k

    # Muon's whole-tensor states, into a plain model and Muon
    model = _muon_model()
    opt = torch.optim.Muon(model.parameters(), lr=0.02, weight_decay=0.01)
    losses = [train_step(model, opt, s, features=7, world=1, rank=0) for s in range(SAVED + 1)]
    after = {k: v.clone() for k, v in model.state_dict().items()}
    model = _muon_model()
    opt = torch.optim.Muon(model.parameters(), lr=0.02, weight_decay=0.01)
    for s in range(SAVED):  # the reference's state after the saved steps, to compare the loaded one with
        train_step(model, opt, s, features=7, world=1, rank=0)
    want_muon = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    model = _muon_model()
    opt = torch.optim.Muon(model.parameters(), lr=0.02, weight_decay=0.01)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=ZeroStorageReader(zero_dir + "-muon"), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for n, p in model.named_parameters():
        assert set(opt.state[p]) == set(want_muon[n]) == {"momentum_buffer"}, n
        assert torch.allclose(opt.state[p]["momentum_buffer"], want_muon[n]["momentum_buffer"], rtol=1e-5, atol=1e-7), n
    assert train_step(model, opt, SAVED, features=7, world=1, rank=0) == pytest.approx(losses[SAVED], rel=1e-5)
    for k, v in after.items():
        assert torch.allclose(model.state_dict()[k], v, rtol=1e-5, atol=1e-6), k

    # a damaged rank file fails its checksum before anything is read from it
    meta = json.loads((tmp_path / "zero" / "zero_checkpoint.json").read_text())
    victim = tmp_path / "zero" / meta["files"][1]["name"]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointException, match="fails its checksum"):
        dcp.load({"model": dict(_build().state_dict())}, storage_reader=ZeroStorageReader(zero_dir), no_dist=True)
