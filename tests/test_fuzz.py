"""A seeded random driver of user actions, checked against plain PyTorch after every action.

Each rank runs the sharded model and, beside it, the plain model on the whole batch, and
applies the same random sequence of actions to both: forward and backward, validation
forwards (with gradients, under ``no_grad``, under ``inference_mode``), optimizer steps,
both ``zero_grad``s with both ``set_to_none`` values, ``no_sync()`` micro-batches,
gradient clipping, freezing and unfreezing a parameter, saving and loading a checkpoint,
writes outside the registered optimizer (a second optimizer's step, ``nn.init`` on a layer,
an in-place clamp, an EMA copied into the model), a gradient penalty (``autograd.grad`` with
``create_graph`` before the backward), a ``copy.deepcopy`` of the state dict restored later,
and an exception injected in forward, in backward or in the optimizer step. Per-rank divergent
actions (``diverge:*``) have rank 0 alone clear its gradients between backward and step, assign a
``.grad``, skip the clip the others run, or run an extra micro-batch (with and without
``no_sync()``): every rank must raise ``RanksOutOfStepError`` with nothing stepped, then every rank
clears its gradients and the run goes on in step (see [Note: what a step round agrees on] in
``zero_core.runtime._step_state``). Each sequence holds every kind at least once. The sequences end with
a rank that leaves the others for good: a forward that raises on one rank only, which skips its
batch, or (every other configuration) a rank that skips ``optimizer.step()``: every rank
must then raise ``RanksOutOfStepError`` instead of averaging different batches or aborting. After every action every parameter
must equal the plain model's (fp32, 1e-5 of each tensor's largest magnitude), and every
loss the plain loss. A rule-based generator keeps the sequence meaningful (no
checkpoint while gradients are pending, no clipping of a half-accumulated window); a
step inside an open ``no_sync()`` window is generated on purpose and must raise.

A sequence is a list of action names drawn up front from a seed, identical on every rank
and in the failure message, so a failing seed replays exactly. ``nox -s soak``
(``ZERO_SOAK=1``) runs more seeds and longer sequences: the suite runs 1 seed x 7
configurations x 90 actions (in the five multi-rank ones 5 to 8 divergent ones per sequence, each kind at least
once, and the two endings over the configurations; the two one-rank ones have neither), the soak 6 seeds x 7
configurations x 400 actions (about 20 divergent ones per multi-rank sequence).
"""

from __future__ import annotations

import contextlib
import copy
import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import zero_core
from zero_core import ChunkPolicy, ZeroConfig, ZeroError, shard
from zero_core.testing import run_distributed

SOAK = bool(os.environ.get("ZERO_SOAK"))
ACTIONS_PER_RUN = 400 if SOAK else 90
SEEDS = range(6) if SOAK else range(1)
WORLD = 2
BATCH = 8
RTOL = 1e-5


class Fuzzed(nn.Module):
    """Layers, plus a parameter read outside its module (a stand-in at stage 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.mid = nn.Linear(8, 8)
        self.query = nn.Embedding(2, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.inp(x)))) + self.query.weight.mean(0)
        return self.head(h)


FREEZABLE = ("mid.weight", "query.weight", "head.bias")


class Boom(Exception):
    pass


# rank 0 alone does something else in the step; the kind each needs: "grads" (gradients set, no open window) or "idle"
# (no open window). See the module docstring.
DIVERGENT = {"diverge:zero_grad": "grads", "diverge:grad_set": "idle", "diverge:clip": "grads",
             "diverge:extra_micro_batch": "idle", "diverge:extra_micro_batch_no_sync": "idle"}
DIVERGE_EVERY = 12  # a divergent action not drawn yet is forced in about this often, so every sequence has each
ENDINGS = ("one_rank_skip", "diverge:skip_step")


def generate(seed: int, n: int, ending: str | None = "one_rank_skip") -> list[str]:
    """A random action sequence that a correct training loop could run (see the module docstring). ``ending``
    None: one rank alone (no divergent action, no ending that leaves the others)."""
    rng = random.Random(seed)
    actions: list[str] = []
    grads = False  # the optimizer's gradients are set (a backward outside no_sync since the last zero_grad)
    window = False  # a no_sync() window holds accumulated, unreduced gradients
    frozen: set[str] = set()
    while len(actions) < n:
        choices = ["forward_backward"] * 4 + ["no_sync_forward_backward"] * 2 + ["step"] * 3 + [
            "zero_grad_optimizer_none", "zero_grad_optimizer_zeros", "zero_grad_model_none", "zero_grad_model_zeros",
            "forward_only", "eval_no_grad", "eval_inference_mode", "raise_in_forward", "gradient_penalty",
            "reinit_layer", "clamp_in_place", "ema_update", "ema_swap_in"]
        if not window:
            choices += ["raise_in_backward", "raise_in_step"]
        if grads and not window:
            choices += ["clip", "second_optimizer_step"]
        if not grads and not window:
            choices += ["freeze", "unfreeze", "save", "load", "snapshot_state_dict", "restore_state_dict"]
        eligible = [a for a, need in DIVERGENT.items() if not window and (grads or need == "idle")] \
            if ending is not None else []
        if rng.random() < 0.3:  # about one action in 20 diverges: the others keep most of the sequence
            choices += eligible
        missing = [a for a in eligible if a not in actions]
        drawn = len(set(actions) & set(DIVERGENT))
        force = missing and len(actions) >= DIVERGE_EVERY * (drawn + 1)
        action = rng.choice(missing) if force else rng.choice(choices)
        if action == "freeze":
            options = [n for n in FREEZABLE if n not in frozen]
            if not options:
                continue
            name = rng.choice(options)
            frozen.add(name)
            action = f"freeze:{name}"
        elif action == "unfreeze":
            if not frozen:
                continue
            name = rng.choice(sorted(frozen))
            frozen.discard(name)
            action = f"unfreeze:{name}"
        elif action in ("forward_backward", "gradient_penalty"):
            grads, window = True, False
        elif action == "no_sync_forward_backward":
            window = True
        elif action.startswith("zero_grad"):
            grads = action.endswith("zeros") and grads  # zeroed gradients still count as present
            window = False
        elif action in DIVERGENT:
            grads = window = False  # every rank clears after the error
        actions.append(action)
    # Every sequence ends with a rank leaving the others for good (a one-rank skip of a batch or of a step: after it
    # the ranks are out of step, see drive). In long (soak) sequences a pass replays its gather sequence by then: the
    # rank that left the forward finishes its all-gathers first (see [Note: a forward that raises finishes its
    # gathers]).
    if ending is not None:
        actions[-1] = ending
    return actions


def _batch(i: int, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
    n = BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _mean(value: torch.Tensor, world: int) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / world


def _raise_in_backward(module, args, output):
    def fail(grad):
        raise Boom("injected in backward")
    output.register_hook(fail)


def _raise_in_step(optimizer, args, kwargs):
    raise Boom("injected in optimizer.step()")


def _raise_in_forward(module, args, output):
    raise Boom("injected in forward")


def drive(actions: list[str], *, stage: int, strategy: str, directory: str, across_replicas: bool = False) -> int:
    """Apply ``actions`` to the sharded model and to the plain one; check after each. Returns the count applied.

    ``across_replicas``: on a 2x2 mesh with the optimizer states sharded across the replicas (4 ranks)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(3)
    plain = Fuzzed()
    sharded = copy.deepcopy(plain)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    chunk = ChunkPolicy(chunk_size=64) if strategy == "chunk" else ChunkPolicy()
    mesh = {}
    if across_replicas:
        from torch.distributed.device_mesh import init_device_mesh

        mesh["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, opt = shard(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1, momentum=0.9),
                       config=ZeroConfig(stage=stage, strategy=strategy, chunk=chunk,
                                         shard_optimizer_across_replicas=across_replicas), **mesh)
    saved: tuple[dict, dict] | None = None
    snapshot: tuple[dict, dict] | None = None
    window = False  # a no_sync() window is open
    # optimizers and an EMA outside the one shard() was given: their writes must reach the next forward
    extra, plain_extra = torch.optim.SGD(model.head.parameters(), lr=0.05), torch.optim.SGD(plain.head.parameters(), lr=0.05)
    ema = [p.detach().clone() for p in model.parameters()]
    plain_ema = [p.detach().clone() for p in plain.parameters()]

    def both_forward(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _batch(i, world, rank)
        xs, ys = _batch(i, 1, 0)
        return F.cross_entropy(model(x), y), F.cross_entropy(plain(xs), ys)

    for i, action in enumerate(actions):
        where = f"action {i} ({action}) of {actions}"
        name = action.split(":", 1)[1] if ":" in action else None
        if action == "forward_backward":
            loss, ref = both_forward(i)
            loss.backward()
            ref.backward()
            window = False
            assert abs(_mean(loss, world) - ref.item()) <= RTOL * max(abs(ref.item()), 1e-6), where
        elif action == "no_sync_forward_backward":
            with model.no_sync():
                loss, ref = both_forward(i)
                loss.backward()
            ref.backward()
            window = True
        elif action == "step":
            if window:
                with pytest.raises(ZeroError, match="no_sync"):  # a clear error, and nothing changed
                    opt.step()
            else:
                opt.step()
                plain_opt.step()
        elif action.startswith("zero_grad"):
            set_to_none = action.endswith("none")
            window = False
            (opt if "optimizer" in action else model).zero_grad(set_to_none=set_to_none)
            (plain_opt if "optimizer" in action else plain).zero_grad(set_to_none=set_to_none)
        elif action == "gradient_penalty":  # per-sample terms over the batch size: the ranks' mean is the plain total
            totals = []
            for net, (x, y), n in ((model, _batch(i, world, rank), BATCH // world), (plain, _batch(i, 1, 0), BATCH)):
                x.requires_grad_(True)
                summed = F.cross_entropy(net(x), y, reduction="sum")
                (g,) = torch.autograd.grad(summed, x, create_graph=True)
                total = (summed + 0.1 * g.pow(2).sum()) / n
                total.backward()
                totals.append(total)
            window = False
            assert abs(_mean(totals[0], world) - totals[1].item()) <= RTOL * max(abs(totals[1].item()), 1e-6), where
        elif action == "second_optimizer_step":
            extra.step()
            plain_extra.step()
        elif action in ("reinit_layer", "clamp_in_place", "ema_update", "ema_swap_in"):
            for net, averages in ((model, ema), (plain, plain_ema)):
                with torch.no_grad():
                    if action == "reinit_layer":
                        nn.init.constant_(net.mid.bias, 0.1)
                        nn.init.ones_(net.head.weight)
                    elif action == "clamp_in_place":
                        for p in net.parameters():
                            p.clamp_(-0.5, 0.5)
                    elif action == "ema_update":
                        torch._foreach_lerp_(averages, list(net.parameters()), 0.5)
                    else:
                        for p, e in zip(net.parameters(), averages):
                            p.copy_(e)
        elif action == "snapshot_state_dict":  # an early-stopping callback keeps the best weights in memory
            snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(plain.state_dict()))
        elif action == "restore_state_dict":
            if snapshot is None:
                continue
            model.load_state_dict(snapshot[0])
            plain.load_state_dict(snapshot[1])
        elif action == "forward_only":  # a validation forward with gradients enabled, never backwarded
            loss, ref = both_forward(i)
            assert abs(_mean(loss, world) - ref.item()) <= RTOL * max(abs(ref.item()), 1e-6), where
        elif action in ("eval_no_grad", "eval_inference_mode"):
            with torch.no_grad() if action == "eval_no_grad" else torch.inference_mode():
                loss, ref = both_forward(i)
            assert abs(_mean(loss, world) - ref.item()) <= RTOL * max(abs(ref.item()), 1e-6), where
        elif action == "clip":
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            ref_total = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
            assert abs(_full(total).item() - ref_total.item()) <= 1e-4 * max(ref_total.item(), 1e-6), where
        elif action.startswith("freeze") or action.startswith("unfreeze"):
            flag = action.startswith("unfreeze")
            model.get_parameter(name).requires_grad_(flag)
            plain.get_parameter(name).requires_grad_(flag)
        elif action == "save":
            zero_core.save_checkpoint(model, opt, directory)
            saved = (copy.deepcopy(plain.state_dict()), copy.deepcopy(plain_opt.state_dict()))
        elif action == "load":
            if saved is None:
                continue
            zero_core.load_checkpoint(model, opt, directory)
            plain.load_state_dict(saved[0])
            # a copy: torch's optimizer adopts the dict's tensors as its state and updates them in place
            plain_opt.load_state_dict(copy.deepcopy(saved[1]))
        elif action == "raise_in_forward":
            handle = model.mid.register_forward_hook(_raise_in_forward)
            with pytest.raises(Boom):
                model(_batch(i, world, rank)[0])
            handle.remove()
        elif action == "one_rank_skip":  # rank 0's forward raises and only rank 0 skips its batch: every rank raises
            if rank == 0:
                handle = model.mid.register_forward_hook(_raise_in_forward)
                with pytest.raises(Boom):
                    model(_batch(i, world, rank)[0])
                handle.remove()
            with pytest.raises(zero_core.RanksOutOfStepError, match="out of step"):
                loss = F.cross_entropy(model(_batch(i + 1, world, rank)[0]), _batch(i + 1, world, rank)[1])
                loss.backward()
                opt.step()
            return len(actions)  # the ranks cannot be brought back in step: the run ends here
        elif action == "diverge:skip_step":  # rank 0 skips a step: its next round is a step behind, on every rank
            with pytest.raises(zero_core.RanksOutOfStepError, match="out of step"):
                for j in (i, i + 1):
                    loss = F.cross_entropy(model(_batch(j, world, rank)[0]), _batch(j, world, rank)[1])
                    loss.backward()
                    if rank != 0 or j != i:
                        opt.step()
                    opt.zero_grad()
            return len(actions)
        elif action in DIVERGENT:  # rank 0 alone does something else: every rank raises, nothing is stepped
            lone = rank == 0
            with pytest.raises(zero_core.RanksOutOfStepError, match="out of step"):
                if action == "diverge:zero_grad" and lone:
                    opt.zero_grad()
                elif action == "diverge:grad_set" and lone:
                    bias = model.get_parameter("mid.bias")
                    bias.grad = torch.ones_like(bias)
                elif action == "diverge:clip" and not lone:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                elif action.startswith("diverge:extra_micro_batch"):
                    if lone:  # one micro-batch more than its peers
                        with model.no_sync() if action.endswith("no_sync") else contextlib.nullcontext():
                            x, y = _batch(i + 1000, world, rank)
                            F.cross_entropy(model(x), y).backward()
                    x, y = _batch(i, world, rank)
                    F.cross_entropy(model(x), y).backward()
                opt.step()
            opt.zero_grad()  # every rank clears: the ranks are in step again, and the plain model follows
            plain_opt.zero_grad()
            window = False
        elif action == "raise_in_step":  # a step pre-hook raises after the engine prepared the step: nothing changes
            handle = opt.register_step_pre_hook(_raise_in_step)
            with pytest.raises(Boom):
                opt.step()
            handle.remove()
        elif action == "raise_in_backward":  # the failed backward contributes nothing: plain skips it
            handle = model.mid.register_forward_hook(_raise_in_backward)
            loss, _ = both_forward(i)
            handle.remove()
            with pytest.raises(Boom):
                loss.backward()
        else:
            raise AssertionError(f"unknown action {action!r}")
        for pname, p in plain.named_parameters():
            got, ref = _full(model.get_parameter(pname)), p.detach()
            scale = max(ref.abs().max().item(), 1e-6)
            diff = (got - ref).abs().max().item()
            assert diff <= RTOL * scale, f"{pname} differs by {diff:.3g} (scale {scale:.3g}) after {where}"
    return len(actions)


CONFIGS = [pytest.param(stage, strategy, False, WORLD, id=f"{strategy}-stage{stage}")
           for strategy, stage in [("chunk", 1), ("chunk", 2), ("chunk", 3), ("tensor", 3)]]
CONFIGS.append(pytest.param(3, "chunk", True, 4, id="chunk-stage3-2x2-optimizer-across-replicas"))
# one rank, where gradients are handed over as autograd made them (see [Note: gradients handed over as autograd made
# them] in zero_core.chunks._chunk_grads): no divergent action, no ending that leaves the others
CONFIGS += [pytest.param(stage, "chunk", False, 1, id=f"chunk-stage{stage}-one-rank") for stage in (2, 3)]


@pytest.mark.parametrize(("stage", "strategy", "across_replicas", "world"), CONFIGS)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_user_actions_match_plain_pytorch(stage, strategy, across_replicas, world, seed, tmp_path):
    # the ending alternates over configurations and seeds, so each kind runs in the suite's single seed
    ending = ENDINGS[(seed + stage + (strategy == "tensor") + across_replicas) % len(ENDINGS)] if world > 1 else None
    actions = generate(seed, ACTIONS_PER_RUN, ending)
    applied = run_distributed(drive, world, actions, stage=stage, strategy=strategy, directory=str(tmp_path),
                              across_replicas=across_replicas, timeout=600 if SOAK else 120)
    assert applied == [len(actions)] * world
