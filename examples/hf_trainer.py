"""Fine-tune a small GPT-2 with the HuggingFace Trainer under zero, then load the result with ``from_pretrained``.

Launch it the way torchrun launches any script, one process per rank (CPU, gloo):

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/hf_trainer.py

or, from a fresh clone, ``python -m pip install nox && python -m nox -s hf_trainer``.

The text is this repository's own documentation, read byte by byte (a 256-token
vocabulary), so nothing is downloaded. The Trainer's loop is unchanged: gradient
accumulation, clipping by the global norm (the logged ``grad_norm``), a cosine schedule,
``save_steps`` checkpoints (each rank writes its shards) and a final ``save_model`` that
writes ``config.json`` plus sharded safetensors. Rank 0 shows the Trainer's own progress bar
(elapsed time, ETA, steps per second) as any Trainer run does. Rank 0 then reloads that directory with
plain ``AutoModelForCausalLM.from_pretrained`` and prints a sample.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, TrainingArguments

from zero_core import ChunkPolicy, ZeroConfig
from zero_integrations.hf import ZeroTrainer

ROOT = Path(__file__).resolve().parent.parent


class ByteText(torch.utils.data.Dataset):
    """Fixed-length windows of the repository's Markdown files, one token per byte."""

    def __init__(self, seq_len: int) -> None:
        text = b"\n\n".join(path.read_bytes() for path in sorted((ROOT / "docs").rglob("*.md")))
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.data.numel() - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.data[index * self.seq_len : (index + 1) * self.seq_len]
        return {"input_ids": window, "labels": window}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    # outside the checkout, like the other examples' outputs (checkpoints, the export)
    parser.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "zero-hf-trainer"))
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=128, n_layer=4, n_head=4, bos_token_id=10,
                        eos_token_id=10, loss_type="ForCausalLM")
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        max_steps=args.steps, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=5, max_grad_norm=1.0,
        logging_steps=10, save_strategy="steps", save_steps=args.steps // 2, report_to=[], use_cpu=True,
        disable_tqdm=False, seed=0,  # the Trainer's progress bar (rank 0's): elapsed, ETA and it/s
    )
    trainer = ZeroTrainer(model=model, args=training, train_dataset=ByteText(128),
                          zero_config=ZeroConfig(stage=args.stage, chunk=ChunkPolicy(chunk_size=1 << 18)))
    trainer.train()
    export = os.path.join(args.output_dir, "final")
    trainer.save_model(export)  # every rank: the export gathers one chunk at a time

    if dist.get_rank() == 0:
        # plain transformers: no zero code is needed to read what zero wrote
        loaded = AutoModelForCausalLM.from_pretrained(export).eval()
        prompt = torch.tensor([list(b"ZeRO shards ")])
        torch.manual_seed(0)
        with torch.no_grad():
            out = loaded.generate(prompt, max_new_tokens=80, do_sample=True, temperature=0.7, top_k=20, pad_token_id=10)
        sample = bytes(out[0].tolist()).decode("utf-8", errors="replace")
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps; exported to {export}")
        print(f"sample from the reloaded model: {sample!r}")
    dist.barrier()
    trainer.model.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
