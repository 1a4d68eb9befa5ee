"""Real text that every Python installation ships: the standard library's own sources, as bytes.

The corpus is the sorted top-level ``*.py`` files of ``sysconfig.get_paths()["stdlib"]``
(no download, no tokenizer). Every tenth file is held out for validation, so validation
measures text from files the model never trained on. Batches are a pure function of the
step, so a run resumed from a checkpoint, or run at another world size, sees the same
global batches as one that never stopped.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["StdlibText", "load_stdlib_text"]

HOLD_OUT_EVERY = 10  # files[9::10] are the validation split


@dataclass(frozen=True, kw_only=True)
class StdlibText:
    """The two splits as flat byte streams, and where they came from.

    Attributes:
        train: The training files' bytes, concatenated (uint8).
        val: The validation files' bytes, concatenated (uint8).
        train_files: How many files the training split has.
        val_files: How many files the validation split has.
        root: The standard library directory the files were read from.
    """

    train: torch.Tensor
    val: torch.Tensor
    train_files: int
    val_files: int
    root: Path

    def train_batch(self, step: int, micro: int, rows: int, seq_len: int, *, seed: int = 0) -> torch.Tensor:
        """``rows`` random windows of ``seq_len`` bytes, a function of (seed, step, micro-batch) only."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + micro)
        starts = torch.randint(0, len(self.train) - seq_len + 1, (rows,), generator=g)
        return torch.stack([self.train[s:s + seq_len] for s in starts.tolist()]).long()

    def val_windows(self, count: int, seq_len: int) -> torch.Tensor:
        """``count`` fixed windows spread evenly over the validation split: the same every evaluation."""
        starts = torch.linspace(0, len(self.val) - seq_len, count).long()
        return torch.stack([self.val[s:s + seq_len] for s in starts.tolist()]).long()


def load_stdlib_text(root: str | Path | None = None, *, max_train_bytes: int = 4 << 20) -> StdlibText:
    """Read the corpus; the training split is cut at ``max_train_bytes`` to keep its size fixed."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if len(files) < HOLD_OUT_EVERY:
        raise FileNotFoundError(f"found {len(files)} *.py files in {root}; the example needs the Python standard library's "
                                "sources (some minimal installs strip them): pass --corpus DIR with a directory of .py files")
    val_files = files[HOLD_OUT_EVERY - 1::HOLD_OUT_EVERY]
    held_out = set(val_files)
    train_files = [f for f in files if f not in held_out]
    train = b"\n".join(f.read_bytes() for f in train_files)[:max_train_bytes]
    val = b"\n".join(f.read_bytes() for f in val_files)
    return StdlibText(train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
                      val=torch.frombuffer(bytearray(val), dtype=torch.uint8),
                      train_files=len(train_files), val_files=len(val_files), root=root)
