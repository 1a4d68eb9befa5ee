"""State enums: one per axis, each value documented."""

from __future__ import annotations

import enum

__all__ = ["ChunkState", "MemoryTier", "ReduceState", "TrainingState"]


class TrainingState(enum.Enum):
    """Where the engine is in a training step."""

    #: Between steps: every chunk is sharded.
    IDLE = "idle"
    #: Inside the wrapped model's forward.
    FORWARD = "forward"
    #: A forward built an autograd graph whose backward has not finished yet.
    BACKWARD_PENDING = "backward_pending"
    #: Inside ``loss.backward()``: pre-backward gathers, gradient reduction.
    BACKWARD = "backward"


class ChunkState(enum.Enum):
    """Whether a chunk's full parameter buffer exists on this rank."""

    #: Only this rank's shard exists; the full buffer's storage is freed, so any
    #: access to a parameter view fails loudly instead of reading stale data.
    SHARDED = "sharded"
    #: Released by a forward with ``reshard_after_forward=k``: as SHARDED, and this rank also keeps
    #: its ``1/k`` of the gathered values, so the backward's all-gather runs inside its group of ``k``
    #: ranks. FSDP2's ``SHARDED_POST_FORWARD``.
    SHARDED_POST_FORWARD = "sharded_post_forward"
    #: An all-gather into the full buffer is in flight (a prefetch); wait before use.
    GATHERING = "gathering"
    #: The full buffer holds every rank's shard; parameter views are valid.
    GATHERED = "gathered"


class ReduceState(enum.Enum):
    """Where a gather group (what one all-gather gathers) stands in the running backward's gradient reduction.
    See [Note: gradient reduction order] in ``zero_core.runtime._engine``."""

    #: No backward runs.
    IDLE = "idle"
    #: A gradient the forwards' graphs can deliver to one of its parameters has not arrived yet.
    WAITING = "waiting"
    #: Every gradient it waits for arrived (or none can): it is reduced as soon as its turn in the order comes.
    READY = "ready"
    #: Its trainable chunks' reductions were launched in this backward; a later gradient would be lost.
    REDUCED = "reduced"


class MemoryTier(enum.Enum):
    """Where a chunk's shard lives. Placement policies move shards between tiers."""

    #: The compute device (CUDA when present, else the CPU the model computes on).
    DEVICE = "device"
    #: Host memory (pinned when CUDA is present).
    HOST = "host"
    #: Files on disk.
    DISK = "disk"
