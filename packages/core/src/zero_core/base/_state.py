"""State enums: one per axis, each value documented."""

from __future__ import annotations

import enum

__all__ = ["BackwardEnd", "BackwardKind", "ChunkState", "MemoryTier", "ReduceState", "TrainingState", "UnitState"]


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


class BackwardKind(enum.Enum):
    """What the running backward does with the parameters' gradients, decided when it begins.
    See [Note: backwards that accumulate nothing] in ``zero_core.runtime._engine``."""

    #: ``loss.backward()``: it accumulates into trainable parameters, and reduces them when it ends (outside
    #: ``no_sync()``), each chunk as soon as its gradients are in.
    REDUCE = "reduce"
    #: ``torch.autograd.grad`` over inputs (or ``backward(inputs=...)`` naming no parameter): it gathers what
    #: modules need and accumulates, prepares and reduces nothing.
    CAPTURE = "capture"
    #: As CAPTURE, with ``create_graph=True``: the gradients it returns have a graph that reads the gathered
    #: parameters, so the chunks stay gathered (BACKWARD_PENDING) until the backward after it ends, and that
    #: backward releases nothing before its end.
    CAPTURE_FOR_GRAPH = "capture_for_graph"


class BackwardEnd(enum.Enum):
    """How a backward ended: what the one end-of-backward sequence (``Engine._end_backward``) completes."""

    #: The autograd engine ran the callback queued when the backward began: the rest is reduced and handed over.
    FINISHED = "finished"
    #: The backward raised (autograd dropped the queued callback), found by the next entry point's settle: its
    #: collectives are finished with the peers and everything it produced is dropped.
    RAISED = "raised"


class UnitState(enum.Enum):
    """Where one unit of gather and release (``zero_core.runtime._unit.Unit``: a module that registers
    parameters, or the compiled block above such modules) stands in the step. Its chunks' own states are
    ``ChunkState``: a chunk is shared by the units whose parameters it holds, so a unit's moment in the step
    says what its hooks did, not whether its chunks are gathered."""

    #: Between steps, or its forward has not run in this step.
    IDLE = "idle"
    #: Its forward runs (its pre-hook gathered, or found gathered, its chunks); also a recomputation in backward.
    FORWARD = "forward"
    #: Its forward returned inside a forward that builds a graph: its backward may come.
    AFTER_FORWARD = "after_forward"
    #: The backward reached its outputs: its chunks were gathered again for its backward. A kept unit, which has
    #: nothing to gather (see [Note: kept units] in ``zero_core.runtime._unit``), is moved here, and to AFTER_FORWARD,
    #: with all the others when the backward begins (the wrapped model's forward returns).
    BACKWARD = "backward"
    #: Every chunk of it was launched for reduction in this backward (its gradients are all in, or the backward
    #: ended): no gradient of its parameters can come any more, and each ``.grad`` that can be is set as its
    #: reduction lands. IDLE again when the backward ends.
    AFTER_BACKWARD = "after_backward"


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
