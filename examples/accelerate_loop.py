"""A custom training loop written for HuggingFace Accelerate, under zero: only the ``prepare`` call changes.

    accelerate launch --cpu --num_processes 2 examples/accelerate_loop.py            # zero, 2 CPU ranks
    python examples/accelerate_loop.py --plain --batch-size 16                       # plain Accelerate, 1 process

It trains a small MLP regression for one epoch with gradient accumulation (``accelerator.accumulate``),
``accelerator.backward``, ``accelerator.clip_grad_norm_``, a learning-rate schedule and ``accelerator.save_state``
part way; then it resumes from that checkpoint with ``accelerator.load_state`` and replays the rest of the epoch,
which must give the same losses. ``--resume-from DIR`` (repeatable) loads other runs' checkpoints instead, for
example one written by the other mode or at another world size: the checkpoint is world-size free. ``--out FILE`` writes the
losses, gradient norms and final parameters (rank 0) for a comparison; tests/test_accelerate.py runs it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed

SAMPLES, FEATURES = 128, 12
MAX_NORM = 0.4  # below every step's norm here: clipping acts at each step


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def data(batch_size: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = (x[:, :3].sum(dim=1, keepdim=True) + 0.1 * torch.randn(SAMPLES, 1, generator=g)).tanh()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def train(accelerator: Accelerator, model, optimizer, scheduler, loader, *, skip: int = 0, save_at: int | None = None,
          save_dir: str | None = None) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    started, total = time.perf_counter(), len(loader)
    batches = accelerator.skip_first_batches(loader, skip) if skip else loader
    for i, (x, y) in enumerate(batches, start=skip):
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
            optimizer.step()
            if accelerator.sync_gradients:
                scheduler.step()
            optimizer.zero_grad()
        losses.append(float(accelerator.gather(loss.detach()).mean()))
        elapsed = time.perf_counter() - started
        rate = (i + 1 - skip) / elapsed
        accelerator.print(f"batch {i + 1}/{total}  loss {losses[-1]:.5f}  {elapsed:.1f} s  {rate:.1f} batches/s  "
                          f"ETA {(total - i - 1) / rate:.1f} s")
        if save_at is not None and i == save_at:
            accelerator.save_state(save_dir)  # every rank: zero gathers the full state into the checkpoint
    return losses, norms


def full_parameters(accelerator: Accelerator, model: torch.nn.Module, plain: bool) -> dict[str, list[float]]:
    state = model.state_dict() if plain else model.full_state_dict(rank0_only=True)
    return {k: v.flatten().tolist() for k, v in state.items()} if accelerator.is_main_process else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plain", action="store_true", help="plain Accelerate (DDP on several processes), not zero")
    p.add_argument("--stage", type=int, default=3, help="zero's stage (1, 2 or 3)")
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--accumulate", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--save-at", type=int, default=3, help="save after this batch (0-based, after an optimizer step)")
    p.add_argument("--checkpoint", default="accelerate-ckpt", help="where save_state writes")
    p.add_argument("--resume-from", action="append", default=[], metavar="DIR",
                   help="load this checkpoint and replay the rest of the epoch (repeatable; with --no-train, the only "
                        "runs); default: the checkpoint this run wrote")
    p.add_argument("--no-train", action="store_true", help="skip the first pass: only resume from --resume-from")
    p.add_argument("--out", type=Path, default=None, help="write losses, norms and final parameters here (JSON)")
    args = p.parse_args()

    # step_scheduler_with_optimizer=False: the schedule counts optimizer steps, at any number of processes (by default
    # Accelerate steps a scheduler once per process at each step, so the schedule would depend on the world size)
    accelerator = Accelerator(gradient_accumulation_steps=args.accumulate, step_scheduler_with_optimizer=False,
                              cpu=not torch.cuda.is_available())
    model, optimizer, scheduler = build()
    loader = data(args.batch_size)
    if args.plain:
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    else:
        from zero_core import ZeroConfig
        from zero_integrations.accelerate import prepare

        model, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader, scheduler,
                                                      config=ZeroConfig(stage=args.stage))
    result: dict = {"world_size": accelerator.num_processes, "resumed": []}
    if not args.no_train:
        result["losses"], result["norms"] = train(accelerator, model, optimizer, scheduler, loader,
                                                  save_at=args.save_at, save_dir=args.checkpoint)
        result["parameters"] = full_parameters(accelerator, model, args.plain)
    for directory in args.resume_from or [args.checkpoint]:
        accelerator.load_state(directory)
        losses, norms = train(accelerator, model, optimizer, scheduler, loader, skip=args.save_at + 1)
        result["resumed"].append({"from": directory, "losses": losses, "norms": norms,
                                  "parameters": full_parameters(accelerator, model, args.plain)})
    if args.out is not None and accelerator.is_main_process:
        args.out.write_text(json.dumps(result))
    accelerator.print(f"done: {accelerator.num_processes} process(es), final loss {result['resumed'][-1]['losses'][-1]:.5f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
