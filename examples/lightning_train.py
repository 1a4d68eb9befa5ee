"""Train a small regression MLP with PyTorch Lightning under zero (``Trainer(strategy="zero")``).

Launch it with torchrun, one process per rank (CPU, gloo):

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/lightning_train.py

or let Lightning start the second process itself: ``python examples/lightning_train.py``.

The LightningModule is ordinary Lightning code; only the Trainer's ``strategy`` changes.
The run accumulates 2 micro-batches per step, clips the global gradient norm, saves
sharded checkpoints every 10 steps (each rank writes its own shard file), then resumes a
fresh Trainer from the first one and checks it ends with the same weights. Lightning's progress bar
on rank 0 shows the elapsed time, ETA and steps per second; rank 0 prints the losses and writes the
final weights as one plain ``state_dict`` file.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import zero_core
import zero_integrations.lightning  # noqa: F401  (registers strategy="zero")
from zero_integrations.lightning import ZeroStrategy


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=40)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1280, 32, generator=generator)  # 20 micro-batches per rank: 10 steps per epoch
    y = (x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True)).tanh()
    return DataLoader(TensorDataset(x, y), batch_size=32)


def make_trainer(args: argparse.Namespace, **kwargs) -> pl.Trainer:
    # ZeroStrategy(config=...) picks the stage and chunk size; strategy="zero" alone means ZeroConfig()
    strategy = ZeroStrategy(config=zero_core.ZeroConfig(stage=args.stage, chunk=zero_core.ChunkPolicy(chunk_size=2048)))
    return pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, precision=args.precision,
                      max_steps=args.steps, accumulate_grad_batches=2, gradient_clip_val=1.0,
                      logger=False, enable_model_summary=False, **kwargs)  # Lightning's bar: rank 0's, with ETA and it/s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", 2)))
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "zero-lightning-example"))
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)

    # Every 10 steps is every epoch's last step: Lightning resumes a plain DataLoader mid-epoch from the
    # epoch's start. Saved after the step (on_train_batch_end), not at on_train_epoch_end: with accumulation,
    # Lightning 2.6 resumes epoch-end checkpoints one micro-batch off, with or without zero.
    checkpoints = ModelCheckpoint(dirpath=args.dir, every_n_train_steps=10, save_top_k=-1)
    model = Regressor()
    trainer = make_trainer(args, callbacks=[checkpoints])
    trainer.fit(model, data())
    final = model.full_state_dict()  # collective: every rank calls it, rank 0 gets the whole state dict

    resumed = Regressor()
    first = os.path.join(args.dir, "epoch=0-step=10.ckpt")  # a directory: one shard file per rank
    make_trainer(args, enable_checkpointing=False).fit(resumed, data(), ckpt_path=first)
    again = resumed.full_state_dict()

    if trainer.is_global_zero:
        print(f"final loss {trainer.callback_metrics['loss'].item():.4f}; checkpoint files in {first}:")
        for name in sorted(os.listdir(first)):
            print("   ", name)
        diff = max((final[k] - again[k]).abs().max().item() for k in final)
        print(f"resumed from step 10 vs uninterrupted: max |weight diff| {diff:.2e}")
        torch.save(final, os.path.join(args.dir, "final_state_dict.pt"))
        Regressor().load_state_dict(final)  # a plain state dict: loads into the unsharded module


if __name__ == "__main__":
    main()
