"""Plain-PyTorch idioms on the sharded model train exactly as in one process.

After ``model, opt = shard(model, opt)`` the model keeps its class and every entry of
``model.parameters()`` is an ``nn.Parameter`` holding a DTensor (``Shard(0)``, sizes as
``torch.chunk`` cuts them, the original global shape) and is the very object in the
optimizer's param groups. So code written for one process (``zero_grad``,
``torch.nn.utils`` clipping, ``requires_grad_`` toggles, ``add_param_group``, an EMA over
the parameters, counting parameters) must work on it unchanged.

Each test runs one idiom through one training function twice: on N gloo ranks after
``shard()`` (each rank on its slice of the global batch, mean loss, so the ranks' mean
gradient is the whole batch's) and in this process on the plain model and the whole
batch. In fp32 the two agree up to summation order: losses within 1e-5 relative,
final full parameters within 1e-5 of each tensor's largest magnitude
(:func:`zero_core.testing.assert_parity`). The same function serves both runs, so the
idiom is applied identically; on the plain model ``_full`` is the identity.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from zero_core import ChunkPolicy, ZeroConfig, ZeroError, shard
from zero_core.chunks._slots import shard_cut
from zero_core.testing import RunResult, assert_parity, full_value, rank_device, run_distributed
from zero_core.testing.zoo import get_case

SEED = 1234
BATCH = 8  # global batch: 2 samples per rank at world 4
CHUNK_SIZE = 64  # the MLP's 363 elements span several chunks
TIMEOUT = 120

# Stages 2 and 3 at every world size; stage 1 (unsharded gradients) at world 2 only where the
# idiom reads or clears gradients, to keep the file's runtime down.
WORLD_STAGE = [
    pytest.param(world, stage, id=f"world{world}-stage{stage}")
    for world, stage in [(1, 2), (1, 3), (2, 2), (2, 3), (4, 2), (4, 3)]
]
WITH_STAGE_1 = [*WORLD_STAGE, pytest.param(2, 1, id="world2-stage1")]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(self.ln(h)))


class MLP(nn.Module):
    """Input layer, two residual LayerNorm blocks, a head.

    Width 10 and 3 outputs: no world size divides every first dimension, and at world 4
    torch.chunk leaves the last rank an empty shard of the head (3 rows over 4 ranks).
    """

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.blocks = nn.ModuleList(Block(10) for _ in range(2))
        self.head = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _build() -> MLP:
    torch.manual_seed(SEED)
    return MLP().to(rank_device())  # shard() keeps a model where it is; the one-process run computes there too


def _sgd(params) -> torch.optim.Optimizer:
    # Momentum: a step taken on a zero gradient (instead of skipped for a None one), or on
    # a gradient left over from the previous step, moves the parameter and shows.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# --- helpers that run identically on the plain model (world 1, no DTensors) and on the ranks ---


def _full(t: torch.Tensor) -> torch.Tensor:
    """The full value as a plain CPU tensor (``full_tensor()`` for a DTensor, a collective: every rank calls it in the
    same order; see [Note: DTensor all-gathers over gloo on CUDA] in ``zero_core.testing.values``)."""
    return full_value(t)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _batch(step: int, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the step's global batch (the whole batch at world 1)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 6, generator=g)
    y = torch.randint(0, 3, (BATCH,), generator=g)
    local = BATCH // world
    return x[rank * local:(rank + 1) * local].to(rank_device()), y[rank * local:(rank + 1) * local].to(rank_device())


def _forward(model: nn.Module, step: int, world: int, rank: int) -> torch.Tensor:
    x, y = _batch(step, world, rank)
    return F.cross_entropy(model(x), y)


def _global_loss(loss: torch.Tensor, world: int) -> float:
    """The mean of the ranks' losses, which is the global batch's mean loss (equal slices)."""
    value = loss.detach().clone()
    if world > 1:
        dist.all_reduce(value)
        value /= world
    return value.item()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: _full(p) for name, p in model.named_parameters()}


def _no_shard(model, opt):
    return model, opt


def _one_process(train, **kwargs):
    """Run ``train`` on the plain model in this process, on the whole batch."""
    return train(_no_shard, 1, 0, **kwargs)


def _on_ranks(train, stage: int, **kwargs):
    """Rank function: ``train`` with ``shard()`` as its setup, on this rank's slice."""
    config = ZeroConfig(stage=stage, chunk=ChunkPolicy(chunk_size=CHUNK_SIZE))

    def setup(model, opt):
        model, opt = shard(model, opt, config=config)
        return model, opt

    return train(setup, dist.get_world_size(), dist.get_rank(), **kwargs)


def _sharded(train, world: int, stage: int, **kwargs) -> list:
    return run_distributed(_on_ranks, world, train, stage, timeout=TIMEOUT, **kwargs)


def _assert_all_ranks_match(reference: RunResult, results: list[RunResult], what: str = "") -> None:
    for rank, result in enumerate(results):  # full values are the same on every rank
        assert_parity(reference, result, label=f"{what} rank {rank}:")


# --- 1. zero_grad ---

# (whose zero_grad, set_to_none, where in the step it is called)
ZERO_GRAD_VARIANTS = [
    ("model", True, "after_step"),
    ("model", False, "after_step"),
    ("optimizer", True, "after_step"),
    ("optimizer", False, "after_step"),
    ("optimizer", True, "before_forward"),
    ("model", False, "before_forward"),
]
# Between forward and backward (`loss = ...; opt.zero_grad(); loss.backward(); opt.step()`,
# the tutorial loop): the forward has gathered the parameters, and under stage 2 they stay
# gathered until backward, yet zero_grad must clear the gradients the step uses. A test of
# its own: FSDP2 fails model.zero_grad() here at reshard_after_forward=False (its registered
# parameters are then unsharded stand-ins, so the sharded gradients are left to accumulate).
BETWEEN_FORWARD_AND_BACKWARD = [
    ("optimizer", False, "before_backward"),
    ("model", True, "before_backward"),
]


def _cleared(opt: torch.optim.Optimizer, set_to_none: bool, after_backward: bool) -> bool:
    """What plain zero_grad leaves: no gradients, or (once a backward made them) zeroed ones.

    Read through the optimizer's parameters: between steps they are model.parameters()
    (test_parameter_counts_... checks that), while between forward and backward a sharded
    model may register stand-ins whose gradients are not the ones the optimizer steps on.
    """
    grads = [p.grad for group in opt.param_groups for p in group["params"]]
    if set_to_none or not after_backward:
        return all(g is None for g in grads)
    return all(g is not None and not _local(g).any() for g in grads)


def _train_zero_grad(setup, world, rank, *, variants, steps=4):
    results = {}
    for who, set_to_none, where in variants:
        model = _build()
        model, opt = setup(model, _sgd(model.parameters()))
        owner = model if who == "model" else opt
        losses, cleared = [], []
        for step in range(steps):
            if where == "before_forward":
                owner.zero_grad(set_to_none=set_to_none)
                cleared.append(_cleared(opt, set_to_none, after_backward=step > 0))
            loss = _forward(model, step, world, rank)
            if where == "before_backward":
                owner.zero_grad(set_to_none=set_to_none)
                cleared.append(_cleared(opt, set_to_none, after_backward=step > 0))
            loss.backward()
            opt.step()
            if where == "after_step":
                owner.zero_grad(set_to_none=set_to_none)
                cleared.append(_cleared(opt, set_to_none, after_backward=True))
            losses.append(_global_loss(loss, world))
        results[(who, set_to_none, where)] = (RunResult(losses, _params(model)), cleared)
    return results


def _check_zero_grad(world, stage, variants):
    reference = _one_process(_train_zero_grad, variants=variants)
    for rank, rank_results in enumerate(_sharded(_train_zero_grad, world, stage, variants=variants)):
        for variant, (result, cleared) in rank_results.items():
            ref, ref_cleared = reference[variant]
            assert all(ref_cleared)  # the check itself holds for plain PyTorch
            assert all(cleared), f"{variant} rank {rank}: gradients not cleared as plain zero_grad clears them: {cleared}"
            assert_parity(ref, result, label=f"{variant} rank {rank}:")


@pytest.mark.parametrize(("world", "stage"), WITH_STAGE_1)
def test_zero_grad_of_model_and_optimizer(world, stage):
    _check_zero_grad(world, stage, ZERO_GRAD_VARIANTS)


@pytest.mark.parametrize(("world", "stage"), WORLD_STAGE)
def test_zero_grad_between_forward_and_backward(world, stage):
    _check_zero_grad(world, stage, BETWEEN_FORWARD_AND_BACKWARD)


# --- 2. torch.nn.utils.clip_grad_norm_ ---

CLIP_NORM = 0.1  # below every step's gradient norm (1-norm and 2-norm), so clipping acts at every step
# Not the inf-norm: torch's clip_grad_norm_ takes a per-tensor _foreach_norm of each DTensor's
# local shard, which raises on an empty shard for inf (no identity), and torch.chunk leaves
# rank 3 of 4 an empty shard of the head. FSDP2 fails the same way; that is torch's limit.
NORM_TYPES = (2.0, 1.0)


def _train_clip_norm(setup, world, rank, *, steps=4):
    results = {}
    for norm_type in NORM_TYPES:
        model = _build()
        model, opt = setup(model, _sgd(model.parameters()))
        losses, norms = [], []
        for step in range(steps):
            loss = _forward(model, step, world, rank)
            loss.backward()
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM, norm_type)
            # a DTensor total norm is resolved on every rank; the plain one is already a tensor
            norms.append(_full(total).item())
            opt.step()
            opt.zero_grad()
            losses.append(_global_loss(loss, world))
        results[norm_type] = RunResult(losses, _params(model), norms=norms)
    return results


@pytest.mark.parametrize(("world", "stage"), WITH_STAGE_1)
def test_torch_clip_grad_norm(world, stage):
    reference = _one_process(_train_clip_norm)
    results = _sharded(_train_clip_norm, world, stage)
    for norm_type, ref in reference.items():
        assert all(n > CLIP_NORM for n in ref.norms), ref.norms  # clipping acts
        # the returned norm is the global one, on every rank (assert_parity compares norms within 1e-5)
        _assert_all_ranks_match(ref, [r[norm_type] for r in results], f"norm_type={norm_type}")


# --- 3. torch.nn.utils.clip_grad_value_ ---

CLIP_VALUE = 0.02  # below the largest gradient element of every step


def _train_clip_value(setup, world, rank, *, steps=4):
    model = _build()
    model, opt = setup(model, _sgd(model.parameters()))
    losses, largest = [], []
    for step in range(steps):
        loss = _forward(model, step, world, rank)
        loss.backward()
        # the largest unclipped gradient element: shows clipping acts, and that gradients agree before it
        largest.append(max(_full(p.grad).abs().max().item() for p in model.parameters()))
        torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        opt.step()
        opt.zero_grad()
        losses.append(_global_loss(loss, world))
    return RunResult(losses, _params(model), norms=largest)


@pytest.mark.parametrize(("world", "stage"), WITH_STAGE_1)
def test_torch_clip_grad_value(world, stage):
    reference = _one_process(_train_clip_value)
    assert all(g > CLIP_VALUE for g in reference.norms), reference.norms
    _assert_all_ranks_match(reference, _sharded(_train_clip_value, world, stage))


# --- 4. requires_grad_ toggles after shard() ---


def _set_head_bias(model: nn.Module, requires_grad: bool) -> None:
    for name, p in model.named_parameters():  # by name, as a training script picks parameters
        if name == "head.bias":
            p.requires_grad_(requires_grad)


def _train_freeze(setup, world, rank, *, steps=6):
    model = _build()
    model, opt = setup(model, _sgd(model.parameters()))
    losses, with_grad = [], []
    for step in range(steps):
        opt.zero_grad()  # set_to_none: a frozen parameter then has no gradient, and SGD skips it
        if step == 1:
            model.blocks[0].requires_grad_(False)  # a middle block: gradients still flow through it to `inp`
        if step == 2:
            _set_head_bias(model, False)
        if step == 4:
            model.blocks[0].requires_grad_(True)
        if step == 5:
            _set_head_bias(model, True)
        loss = _forward(model, step, world, rank)
        loss.backward()
        with_grad.append(sorted(name for name, p in model.named_parameters() if p.grad is not None))
        opt.step()
        losses.append(_global_loss(loss, world))
    return RunResult(losses, _params(model)), with_grad


@pytest.mark.parametrize(("world", "stage"), WITH_STAGE_1)
def test_freeze_and_unfreeze_with_requires_grad(world, stage):
    reference, ref_with_grad = _one_process(_train_freeze)
    assert "blocks.0.fc.weight" not in ref_with_grad[2] and "head.bias" not in ref_with_grad[3]
    for rank, (result, with_grad) in enumerate(_sharded(_train_freeze, world, stage)):
        assert with_grad == ref_with_grad, f"rank {rank}: parameters with a gradient per step differ"
        assert_parity(reference, result, label=f"rank {rank}:")


# --- 5. optimizer.add_param_group after shard() ---


def _train_add_param_group(setup, world, rank, *, steps=5):
    model = _build()
    model.head.requires_grad_(False)  # frozen and not in the optimizer at shard() time
    model.blocks[1].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    model, opt = setup(model, opt)
    losses = []
    for step in range(steps):
        if step == 2:
            model.head.requires_grad_(True)
            opt.add_param_group({"params": list(model.head.parameters()), "lr": 3e-3})
        if step == 3:
            block = [p for name, p in model.named_parameters() if name.startswith("blocks.1.")]
            for p in block:
                p.requires_grad_(True)
            opt.add_param_group({"params": block, "lr": 2e-3, "weight_decay": 0.0})
        loss = _forward(model, step, world, rank)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_global_loss(loss, world))
    return RunResult(losses, _params(model)), [len(g["params"]) for g in opt.param_groups]


@pytest.mark.parametrize(("world", "stage"), WORLD_STAGE)
def test_add_param_group_for_parameters_unfrozen_later(world, stage):
    reference, ref_groups = _one_process(_train_add_param_group)
    assert ref_groups == [6, 2, 4]
    for rank, (result, groups) in enumerate(_sharded(_train_add_param_group, world, stage)):
        assert groups == ref_groups
        assert_parity(reference, result, label=f"rank {rank}:")


# --- 6. an EMA of the parameters with torch._foreach_lerp_ ---


def _train_ema(setup, world, rank, *, steps=4):
    model = _build()
    model, opt = setup(model, _sgd(model.parameters()))
    ema = [p.detach().clone() for p in model.parameters()]  # sharded like the parameters, on the sharded model
    losses = []
    for step in range(steps):
        loss = _forward(model, step, world, rank)
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            torch._foreach_lerp_(ema, list(model.parameters()), 0.1)
        losses.append(_global_loss(loss, world))
    names = [name for name, _ in model.named_parameters()]
    return RunResult(losses, _params(model)), RunResult(losses, {name: _full(e) for name, e in zip(names, ema)})


@pytest.mark.parametrize(("world", "stage"), WORLD_STAGE)
def test_ema_with_foreach_lerp(world, stage):
    reference, ref_ema = _one_process(_train_ema)
    # the EMA lags the parameters, so its comparison checks something the parameters' does not
    assert any(not torch.equal(ref_ema.params[n], reference.params[n]) for n in reference.params)
    for rank, (result, ema) in enumerate(_sharded(_train_ema, world, stage)):
        assert_parity(reference, result, label=f"rank {rank} params:")
        assert_parity(ref_ema, ema, label=f"rank {rank} EMA:")


# --- 6b. writes that bypass the registered optimizer (see [Note: writes outside the optimizer]) ---

WRITES = ["second_optimizer", "recreated_optimizer", "init_a_layer", "clamp_in_place", "ema_swapped_in"]


def _train_writes(setup, world, rank, *, steps=4):
    """Each way of writing parameters outside the optimizer given to shard(), then forwards that must see it."""
    results = {}
    for how in WRITES:
        model = _build()
        model, opt = setup(model, _sgd(model.parameters()))
        if how == "recreated_optimizer":  # FSDP2's recipe: an optimizer built over model.parameters() after sharding
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
        extra = torch.optim.SGD(model.head.parameters(), lr=0.05) if how == "second_optimizer" else None
        ema = [p.detach().clone() for p in model.parameters()]
        losses = []
        for step in range(steps):
            loss = _forward(model, step, world, rank)
            loss.backward()
            opt.step()
            if extra is not None:
                extra.step()
            opt.zero_grad()
            with torch.no_grad():
                torch._foreach_lerp_(ema, list(model.parameters()), 0.5)
                if how == "init_a_layer" and step == 1:
                    nn.init.constant_(model.blocks[0].fc.weight, 0.05)
                    nn.init.zeros_(model.head.bias)
                if how == "clamp_in_place":
                    for p in model.parameters():
                        p.clamp_(-0.25, 0.25)
                if how == "ema_swapped_in" and step == 2:
                    for p, e in zip(model.parameters(), ema):
                        p.copy_(e)
            losses.append(_global_loss(loss, world))
            with torch.no_grad():  # an evaluation forward between steps reads the written values too
                losses.append(_global_loss(_forward(model, 100 + step, world, rank), world))
        results[how] = RunResult(losses, _params(model))
    return results


def _check_each_variant(train, stage: int) -> None:
    """``train`` returns one RunResult per variant: each must match one process's, on 2 ranks."""
    reference = _one_process(train)
    for rank, rank_results in enumerate(_sharded(train, 2, stage)):
        for how, result in rank_results.items():
            assert_parity(reference[how], result, label=f"{how} rank {rank}:")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_writes_outside_the_registered_optimizer_are_seen(stage):
    _check_each_variant(_train_writes, stage)


# --- 6c. gradients of the inputs: a gradient penalty, and autograd.grad before backward ---


def _train_input_gradients(setup, world, rank, *, steps=3):
    results = {}
    for how in ("penalty", "grad_then_backward"):
        model = _build()
        model, opt = setup(model, _sgd(model.parameters()))
        losses = []
        for step in range(steps):
            x, y = _batch(step, world, rank)
            x.requires_grad_(True)
            # per-sample terms summed, over the global batch size: the ranks' mean gradient is one process's
            summed = F.cross_entropy(model(x), y, reduction="sum")
            if how == "penalty":  # a gradient penalty (WGAN-GP, R1): backward through the input gradient's own graph
                (g,) = torch.autograd.grad(summed, x, create_graph=True)
                total = (summed + g.pow(2).sum()) / (BATCH // world)
            else:  # the input gradient read for logging, then the ordinary backward
                (g,) = torch.autograd.grad(summed, x, retain_graph=True)
                total = summed / (BATCH // world) + 0 * g.sum()
            total.backward()
            opt.step()
            opt.zero_grad()
            losses.append(_global_loss(total, world))
        results[how] = RunResult(losses, _params(model))
    return results


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_of_inputs_before_the_backward(stage):
    _check_each_variant(_train_input_gradients, stage)


# --- 6d. copies of the state: early stopping with copy.deepcopy, torch.save per rank ---


def _train_state_copies(setup, world, rank, *, steps=4):
    import copy
    import io

    model = _build()
    model, opt = setup(model, _sgd(model.parameters()))
    losses, best, saved = [], None, io.BytesIO()
    for step in range(steps):
        loss = _forward(model, step, world, rank)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_global_loss(loss, world))
        if step == 1:  # the best model so far: kept in memory and saved, as an early-stopping callback does
            best = copy.deepcopy(model.state_dict())
            torch.save(model.state_dict(), saved)
    at_best = {k: _full(v) for k, v in best.items()}
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    model.load_state_dict(best)  # restore the best weights, then evaluate
    with torch.no_grad():
        losses.append(_global_loss(_forward(model, 9, world, rank), world))
    refused = []
    if dist.is_initialized():
        from torch.optim.swa_utils import AveragedModel

        for copying in (lambda: copy.deepcopy(model), lambda: AveragedModel(model)):
            try:
                copying()
                refused.append("copied")
            except ZeroError as err:
                refused.append("state_dict()" in str(err))
    return RunResult(losses, _params(model)), at_best, {k: _full(v) for k, v in loaded.items()}, refused


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_dict_copies_like_a_tensor_and_the_model_refuses_deepcopy(stage):
    reference, ref_best, ref_loaded, _ = _one_process(_train_state_copies)
    for name in ref_best:
        assert torch.equal(ref_best[name], ref_loaded[name])
    for rank, (result, best, loaded, refused) in enumerate(_sharded(_train_state_copies, 2, stage)):
        assert_parity(reference, result, label=f"rank {rank}:")
        for name, value in ref_best.items():
            torch.testing.assert_close(best[name], value, rtol=1e-5, atol=1e-6)
            assert torch.equal(loaded[name], best[name]), name
        assert refused == [True, True], refused  # a ZeroError naming the alternative, for deepcopy and AveragedModel


# --- 7. counting parameters, shapes, class and state_dict keys ---


def _describe(model: nn.Module, opt: torch.optim.Optimizer, world: int, rank: int) -> dict:
    """What a script reads off a model; on the sharded one also the DTensor layout, checked against torch.chunk."""
    layout = {}
    for name, p in model.named_parameters() if dist.is_initialized() else ():  # the plain model has no layout
        # dim 0, or a later one where dim 0 would pad more than 1% (the head's 3 rows: see [Note: shard dimension]),
        # or a grid of dims 0 and dim2 where no one dimension divides evenly (see [Note: two-dimension cut])
        dim, dim2, split = shard_cut(p.shape, world)
        parts = world // split
        expected = list(torch.empty(p.shape[dim]).chunk(parts)) if p.dim() else []
        rows = expected[rank // split].numel() if rank // split < len(expected) else 0
        local = [*p.shape[:dim], rows, *p.shape[dim + 1:]]
        placements: tuple = (Shard(dim),)
        if split > 1:
            local[dim2] //= split
            placements = (Shard(dim), Shard(dim2))
        layout[name] = {
            "parameter": isinstance(p, nn.Parameter),
            "dtensor": isinstance(p, DTensor),
            "placements": tuple(p.placements) == placements if isinstance(p, DTensor) else False,
            "local_shape": tuple(_local(p).shape) == tuple(local),
        }
    in_optimizer = {id(p) for group in opt.param_groups for p in group["params"]}
    return {
        "named": [(name, tuple(p.shape), p.numel()) for name, p in model.named_parameters()],
        "total": sum(p.numel() for p in model.parameters()),
        "state_dict": [(key, tuple(value.shape)) for key, value in model.state_dict().items()],
        "same_objects_as_optimizer": in_optimizer == {id(p) for p in model.parameters()},
        "values": _params(model),
        "layout": layout,
    }


def _build_gpt() -> nn.Module:
    torch.manual_seed(SEED)
    return get_case("gpt").build().to(rank_device())  # a tied head (two state_dict keys, one parameter) and a non-persistent buffer


def _metadata(setup, world, rank):
    described = {}
    for name, build in (("mlp", _build), ("gpt", _build_gpt)):
        model = build()
        original = type(model)
        model, opt = setup(model, _sgd(model.parameters()))
        described[name] = (_describe(model, opt, world, rank), isinstance(model, original))
    return described


@pytest.mark.parametrize(("world", "stage"), WITH_STAGE_1)
def test_parameter_counts_shapes_class_and_state_dict_keys(world, stage):
    reference = _one_process(_metadata)
    for rank, results in enumerate(_sharded(_metadata, world, stage)):
        for name, (got, same_class) in results.items():
            ref, _ = reference[name]
            label = f"{name} rank {rank}"
            assert same_class, f"{label}: the sharded model is not an instance of the original class"
            assert got["named"] == ref["named"], f"{label}: names, shapes or numel differ"
            assert got["total"] == ref["total"], f"{label}: sum(p.numel()) {got['total']} vs {ref['total']}"
            assert got["state_dict"] == ref["state_dict"], f"{label}: state_dict keys or shapes differ"
            assert got["same_objects_as_optimizer"], f"{label}: model.parameters() are not the optimizer's parameters"
            for param, value in ref["values"].items():  # shard() keeps the values
                assert torch.equal(got["values"][param], value), f"{label}: {param} changed by shard()"
            for param, layout in got["layout"].items():
                assert all(layout.values()), f"{label}: {param} is not an nn.Parameter DTensor Shard(d) cut like torch.chunk: {layout}"
            assert got["layout"].keys() == ref["values"].keys()


def _foreach_seen():
    model = _build()
    model, opt = shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=ZeroConfig(stage=3))
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(o.param_groups[0]["foreach"]))  # after zero's
    _forward(model, 0, dist.get_world_size(), dist.get_rank()).backward()
    before = opt.param_groups[0]["foreach"]
    opt.step()
    return before, seen, opt.param_groups[0]["foreach"], opt.state_dict()["param_groups"][0]["foreach"]


def test_optimizer_steps_sharded_parameters_with_foreach_and_keeps_the_users_setting():
    # see [Note: foreach over sharded parameters]: the same update, one dispatch per op over the DTensors
    assert run_distributed(_foreach_seen, 2) == [(None, [True], None, None)] * 2
