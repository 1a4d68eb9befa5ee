"""``Trainer(strategy="zero")`` on 2 gloo ranks matches Lightning in one process, and resumes exactly.

The model is a tiny MLP in fp32; the run accumulates 2 micro-batches per step and clips the
gradient norm at a value below every step's norm (checked on the reference), so both act.
Lightning's DistributedSampler (``shuffle=False``) gives rank r the samples r, r+2, ...; the
reference trains on batches twice the size, each the union of the ranks' micro-batches, with
a mean loss, so its gradients are the mean of the ranks' (what zero's reduction computes).
One 2-rank run serves the parity and the resume tests: it saves a checkpoint at the end of
epoch 0 with ``ModelCheckpoint(every_n_train_steps=2)`` and, in the same processes, a fresh Trainer and module resume
from it with ``fit(ckpt_path=...)``.
"""

from __future__ import annotations

import functools
import os
import re
import tempfile

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import zero_core
import zero_integrations.lightning as zl
from zero_core.testing import run_distributed

WORLD = 2
LOCAL_BATCH = 4
SAMPLES = 32  # 4 micro-batches per rank per epoch: 2 optimizer steps per epoch with accumulation 2
ACCUMULATE = 2
MAX_STEPS = 4  # 2 epochs; the checkpoint is taken at the end of the first
CLIP = 0.05  # below every step's gradient norm (asserted on the reference), so clipping acts
CHUNK_SIZE = 64  # elements; the MLP has 212 parameters, so several chunks, some parameters spanning two
TOL = 1e-5


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        if not isinstance(self, zero_core.ZeroModule):  # the reference: the norm before clipping
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.grad_norms.append(torch.nn.utils.get_total_norm(grads).item())

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)  # resuming must restore it
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader(batch_size: int, rank: int | None = None) -> DataLoader:
    """The data; with ``rank``, that rank's slice (samples rank, rank+2, ...), as a DistributedSampler without shuffling."""
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(SAMPLES, 8, generator=generator), torch.randn(SAMPLES, 4, generator=generator))
    # Lightning's own sampler would shuffle (it always does for training), which the reference cannot follow
    sampler = None if rank is None else DistributedSampler(data, num_replicas=WORLD, rank=rank, shuffle=False)
    return DataLoader(data, batch_size=batch_size, shuffle=False, sampler=sampler)


def trainer(**kwargs) -> pl.Trainer:
    options = dict(accelerator="cpu", max_steps=MAX_STEPS, accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, deterministic=True, use_distributed_sampler=False)
    options.update(kwargs)
    return pl.Trainer(**options)


@functools.cache
def reference() -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """Lightning in one process, no strategy, on the global batches."""
    model = MLP()
    trainer(devices=1).fit(model, loader(LOCAL_BATCH * WORLD))
    return model.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, model.grad_norms


def train_rank(stage: int, directory: str) -> dict:
    """On every rank: train under ZeroStrategy with a checkpoint per epoch, then resume a fresh run from epoch 0's."""
    # stage 2 writes its checkpoints in the background: the resume below must not tell the difference
    strategy = zl.ZeroStrategy(config=zero_core.ZeroConfig(stage=stage, chunk=zero_core.ChunkPolicy(chunk_size=CHUNK_SIZE)),
                               async_checkpoints=stage == 2)
    # Saved after the step (on_train_batch_end). Lightning 2.6's epoch-end checkpoints (every_n_epochs, or
    # Trainer.save_checkpoint after fit) resume one micro-batch off with accumulation, in one process too.
    checkpoint = ModelCheckpoint(dirpath=directory, every_n_train_steps=MAX_STEPS // 2, save_top_k=-1)
    model = MLP()
    trainer(devices=WORLD, strategy=strategy, enable_checkpointing=True, callbacks=[checkpoint]).fit(model, loader(LOCAL_BATCH, dist.get_rank()))
    weights = model.full_state_dict()
    first = os.path.join(directory, f"epoch=0-step={MAX_STEPS // 2}.ckpt")
    files = sorted(os.listdir(first))

    resumed = MLP()
    trainer(devices=WORLD, strategy="zero").fit(resumed, loader(LOCAL_BATCH, dist.get_rank()), ckpt_path=first)
    is_zero = (type(trainer(devices=WORLD, strategy="zero").strategy) is zl.ZeroStrategy)
    return {"losses": model.losses, "weights": weights, "files": files, "resumed": resumed.full_state_dict(),
            "resumed_losses": resumed.losses, "by_name": is_zero, "rank": dist.get_rank()}


@functools.cache
def zero_run(stage: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="zero-lightning-") as directory:
        return run_distributed(train_rank, WORLD, stage, directory, timeout=150)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("stage", [3, 2])
def test_parity_with_one_process(stage: int) -> None:
    ref_losses, ref_weights, ref_norms = reference()
    assert len(ref_norms) == MAX_STEPS and min(ref_norms) > CLIP, ref_norms  # clipping acted on every step
    results = zero_run(stage)
    # each rank's loss is its micro-batch's mean; the reference's is the mean over the union
    losses = [sum(r["losses"][i] for r in results) / WORLD for i in range(len(ref_losses))]
    assert len(results[0]["losses"]) == MAX_STEPS * ACCUMULATE == len(ref_losses)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    weight_diff = _max_diff(results[0]["weights"], ref_weights)
    print(f"stage {stage}: max |loss diff| {loss_diff:.2e}, max |weight diff| {weight_diff:.2e}")
    assert loss_diff < TOL
    assert weight_diff < TOL
    assert results[1]["weights"] == {}  # full_state_dict: rank 0 only


@pytest.mark.parametrize("stage", [3, 2])
def test_resume_equals_uninterrupted(stage: int) -> None:
    results = zero_run(stage)
    diff = _max_diff(results[0]["resumed"], results[0]["weights"])
    print(f"stage {stage}: resumed vs uninterrupted max |weight diff| {diff:.2e}")
    assert diff < 1e-6
    # the resumed run trained only the second epoch, and its losses are the uninterrupted run's
    for r in results:
        assert r["resumed_losses"] == pytest.approx(r["losses"][len(r["losses"]) // 2:], abs=1e-6)
    # every rank wrote its own shard file
    files = results[0]["files"]
    for rank in range(WORLD):
        assert any(re.search(rf"rank{rank:05d}-of-{WORLD:05d}\.safetensors$", f) for f in files), files


def test_strategy_by_name_resolves() -> None:
    assert "zero" in pl.strategies.StrategyRegistry
    assert all(r["by_name"] for r in zero_run(3))  # on 2 ranks, inside the distributed run
    one = pl.Trainer(accelerator="cpu", devices=1, strategy="zero", logger=False)
    assert isinstance(one.strategy, zl.ZeroStrategy)
    assert isinstance(one.precision_plugin, zl.ZeroPrecision)


@pytest.mark.parametrize("precision", ["64-true", "16-true", "bf16-true"])
def test_unsupported_precision_is_refused(precision: str) -> None:
    with pytest.raises(zero_core.ConfigError, match=r"does not support Trainer\(precision="):
        pl.Trainer(accelerator="cpu", devices=1, strategy="zero", precision=precision, logger=False)


def test_ddp_wrapper_options_are_refused() -> None:
    with pytest.raises(zero_core.ConfigError, match="find_unused_parameters"):
        zl.ZeroStrategy(find_unused_parameters=True)


def test_conflicting_precisions_are_refused() -> None:
    strategy = zl.ZeroStrategy(config=zero_core.ZeroConfig(precision=zero_core.Precision(compute=torch.bfloat16)))
    pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="32-true", logger=False)
    with pytest.raises(zero_core.ConfigError, match="disagrees with"):
        strategy.zero_config  # noqa: B018 - the property raises
