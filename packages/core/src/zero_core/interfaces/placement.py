"""The placement policy interface and the built-in ``device`` and ``host`` policies.

A placement policy decides, at every moment, in which :class:`~zero_core.plugin.MemoryTier`
each chunk's shard lives. The engine calls it at fixed points, in this order:

1. :meth:`PlacementPolicy.from_config` builds it from ``ZeroConfig.placement_options``;
2. :meth:`PlacementPolicy.keep_gathered` may ask for some chunks to stay gathered at stage 3;
   :meth:`PlacementPolicy.initial_tier` says, for each chunk as it is built, where its master shard is
   made and filled (the device, or host memory for a shard :meth:`PlacementPolicy.attach` keeps off it);
3. :meth:`PlacementPolicy.setup` hands it the :class:`PlacementContext` (optimizer, device,
   process group, and the engine's ``step_chunks``), then :meth:`PlacementPolicy.attach`
   places every chunk for the first time;
4. during training: :meth:`PlacementPolicy.on_transition` at each engine state change,
   :meth:`PlacementPolicy.before_compute` before a module computes with some chunks,
   :meth:`PlacementPolicy.before_gather` before any all-gather reads chunks' shards
   (compute, prefetch, or serving another rank), :meth:`PlacementPolicy.after_release`,
   :meth:`PlacementPolicy.before_load` / :meth:`PlacementPolicy.after_load` around writes
   of loaded values into shards,
   :meth:`PlacementPolicy.after_backward` once a backward's gradients are reduced, and
   :meth:`PlacementPolicy.before_step` / :meth:`PlacementPolicy.after_step` around
   each optimizer step;
5. :meth:`PlacementPolicy.close` when the engine is closed.

Policies that move shards off the device live in zero-offload; the mechanics every policy
needs (moving a shard while the optimizer keeps its parameters, routing gradients,
stepping a subset of chunks) are on :class:`~zero_core.plugin.Chunk` and :class:`PlacementContext`.

Subclass :class:`zero_core.testing.PlacementPolicyConformance` to test a policy.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from zero_core.base._devices import copy_on_copy_stream
from zero_core.base._state import MemoryTier, TrainingState
from zero_core.base.errors import ConfigError, PluginContractError
from zero_core.chunks._ownership import policy_call
from zero_core.chunks.chunk import Chunk, ChunkSpec, rewrap, to_local

if TYPE_CHECKING:
    from zero_core.comm.backend import CommBackend
    from zero_core.config.api import ZeroConfig

__all__ = ["ChunkParts", "DevicePlacementPolicy", "HostPlacementPolicy", "PlacementContext", "PlacementPolicy", "absent_shard",
           "copy_shard", "move_shard"]

# The hooks inside which a policy may move shards between tiers. See [Note: who moves a chunk].
_TIER_HOOKS = ("attach", "on_transition", "before_compute", "before_gather", "after_release", "before_load",
               "after_load", "after_backward", "before_step", "after_step", "optimizer_states", "close")

#: Where each shard-sized part of one chunk lives: ``{"params": tier, "grads": tier, "optimizer_states": tier}``.
PartTiers = dict[str, MemoryTier]


@dataclass(frozen=True, kw_only=True)
class ChunkParts:
    """Bytes of one chunk's shard-sized parts on one rank, as :func:`zero_core.estimate` counts them.

    Attributes:
        params: The master shard.
        grads: The master shard's gradient (0 for a frozen chunk).
        optimizer_states: The optimizer's per-element states of the shard's real elements.
    """

    params: int
    grads: int
    optimizer_states: int


@dataclass(frozen=True, kw_only=True)
class PlacementContext:
    """What a policy may use besides the chunks, handed over once by :meth:`PlacementPolicy.setup`.

    Attributes:
        optimizer: The user's optimizer, already re-pointed at the shards' segments
            (``optimizer.state[segment.param]`` holds a segment's states once it stepped).
        device: The compute device.
        comm: The data-parallel comm backend (collective: call only where every rank does).
        config: The engine's config.
        gather_groups: The gather groups as tuples of chunk indices (gathered by one all-gather each).
        step_chunks: ``step_chunks(chunks)`` runs the optimizer on exactly these chunks'
            segments now; call it from :meth:`PlacementPolicy.before_step` to step chunks
            one tier (or one chunk) at a time. Chunks stepped this way are skipped by the
            user's ``optimizer.step()`` that follows.
        device_bytes: ``device_bytes()`` the bytes the engine itself holds on the device
            right now: gathered full buffers, gradient buffers of the running backward
            and the idle ones kept for reuse (not the shards: those are the policy's).
        model: The user's model, for policies that act on its modules (Gemini's activation
            offload); ``None`` where a policy is set up without one (unit tests).
    """

    optimizer: torch.optim.Optimizer
    device: torch.device
    comm: CommBackend
    config: ZeroConfig
    gather_groups: tuple[tuple[int, ...], ...]
    step_chunks: Callable[[Sequence[Chunk]], None]
    device_bytes: Callable[[], int]
    model: torch.nn.Module | None = None


class PlacementPolicy(ABC):
    """Where chunk shards live, and when they move.

    Attributes:
        name: The name users select it by (``ZeroConfig(placement=name)``).
    """

    name: ClassVar[str]
    #: Whether the engine may all-gather the next group ahead of use. Read before every
    #: prefetch; it decides which collectives run, so it must be equal on every rank.
    allow_prefetch: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Every hook the engine calls marks its duration: tier moves are allowed inside it only.
        super().__init_subclass__(**kwargs)
        for name in _TIER_HOOKS:
            method = cls.__dict__.get(name)
            if callable(method) and not getattr(method, "__zero_policy_call__", False):
                setattr(cls, name, policy_call(method))

    @classmethod
    def from_config(cls, config: ZeroConfig) -> PlacementPolicy:
        """Build the policy from ``config.placement_options`` (a policy without options accepts none)."""
        options = config.placement_options
        if dataclasses.is_dataclass(options) or (isinstance(options, Mapping) and options):
            shown = options if isinstance(options, Mapping) else type(options).__name__
            raise ConfigError(
                f"placement policy {cls.name!r} takes no options, but ZeroConfig.placement_options is {shown!r}; "
                "remove them or choose a policy that uses them (zero-offload's 'static' or 'gemini')."
            )
        return cls()

    def keep_gathered(self, specs: Sequence[ChunkSpec], groups: Sequence[Sequence[int]]) -> set[int]:
        """Indices of chunks that stay gathered between uses at stage 3 (default: none).

        Must give the same answer on every rank (it decides which all-gathers run).
        """
        return set()

    def keep_gathered_alone(self) -> bool:
        """Whether, on a single rank, every chunk stays gathered between uses at stage 3 (default: yes).

        One rank's gather is a local copy, so by default its chunks keep their full buffers on the
        device. A policy that keeps master shards off the device answers no: then a chunk takes
        device memory only while a module computes with it (the ``keep_gathered`` ones excepted).
        """
        return True

    def initial_tier(self, chunk: Chunk) -> MemoryTier:
        """Where ``shard()`` makes ``chunk``'s master shard and fills it: ``MemoryTier.DEVICE`` (the default) or
        ``MemoryTier.HOST`` (host memory, pinned when the compute device is CUDA). See [Note: shards made where
        they live] in ``zero_core.chunks.chunk``.

        Called once per chunk, in plan order, right after the chunk is built and before its values arrive (packed
        from the model's parameters, or replayed from a :func:`zero_core.lazy_init` recording), so before
        :meth:`setup`: decide from the chunk and the policy's own options. A policy whose :meth:`attach` moves a
        chunk's shard to the host (or, through the host, to disk) answers ``HOST`` for it: the shard is then made
        there and ``attach`` finds ``chunk.tier`` already ``HOST``, so setup never holds the model's shards on the
        device. A shard the chunk's kept full buffer holds (stages 1 and 2, chunks kept gathered) is made on the
        device whatever the answer; ``chunk.tier`` says where each shard was made.
        """
        return MemoryTier.DEVICE

    def setup(self, context: PlacementContext) -> None:
        """Receive the optimizer, device and process group; called once, right before :meth:`attach`."""
        self.context = context

    @abstractmethod
    def attach(self, chunks: Sequence[Chunk]) -> None:
        """Place every chunk's shard for the first time (called once, after packing)."""

    def on_transition(self, state: TrainingState) -> None:
        """The engine just entered ``state`` (a forward began, a backward began or ended, ...)."""

    def before_compute(self, chunks: Sequence[Chunk], *, backward: bool) -> None:
        """A module is about to run its forward (or backward) with these chunks.

        Called in the same sequence every step for a static graph, whatever was prefetched,
        so it is where a policy records and replays its access trace. Only a policy that
        overrides it is called for every module: otherwise the engine skips a module whose
        chunks are all gathered already (see :attr:`watches_computes`).
        """

    @property
    def watches_computes(self) -> bool:
        """Whether the policy overrides :meth:`before_compute`. If not, a unit's hooks return at once for a
        module whose chunks are all gathered and registered (see [Note: a unit whose chunks are ready] in
        ``zero_core.runtime._unit``)."""
        return type(self).before_compute is not PlacementPolicy.before_compute

    @property
    def moves_after_backward(self) -> bool:
        """Whether the policy overrides :meth:`after_backward` (it may move shards once every gradient is reduced).
        If not, a gradient is handed to its parameter's ``.grad`` as its reduction lands, where that is exact
        (see [Note: gradients handed over as they land] in ``zero_core.chunks._chunk_grads``); if so, at the end
        of backward, after the policy moved the shards."""
        return type(self).after_backward is not PlacementPolicy.after_backward

    def before_gather(self, chunks: Sequence[Chunk]) -> None:
        """Make sure these chunks' shards can be gathered (they are about to be): each shard is in memory, on the
        device or in host memory (a gather reads a host shard directly), not an :func:`absent_shard` stand-in.

        Default: every chunk must be on the device tier already. A policy that keeps shards anywhere else overrides
        it (see the placement policy contract in the plugin guide).
        """
        for chunk in chunks:
            if chunk.tier is not MemoryTier.DEVICE:
                raise PluginContractError(
                    f"placement policy {self.name!r} ({type(self).__module__}.{type(self).__qualname__}) left chunk "
                    f"{chunk.index} on the {chunk.tier.value} tier when it was about to be gathered, and does not "
                    "override before_gather(chunks), whose default accepts device shards only. A policy that keeps "
                    "shards off the device must implement before_gather: bring each chunk's shard back into memory "
                    "(move_shard(chunk, device) and chunk.tier = MemoryTier.DEVICE), or, for a shard it keeps in "
                    "host memory, which a gather reads directly, do nothing (as zero's 'host' policy does)"
                )

    def after_release(self, chunks: Sequence[Chunk]) -> None:
        """These chunks were just released; the policy may move their shards away."""

    def optimizer_states(self, chunk: Chunk) -> dict[int, dict[str, object]]:
        """The optimizer states of ``chunk``'s segments with readable values, by ``id(segment.param)``.

        Used to save a checkpoint one chunk at a time. Default: the optimizer's own states; a
        policy that keeps states out of memory returns fresh copies read back in.
        """
        state = self.context.optimizer.state
        return {id(seg.param): state.get(seg.param, {}) for seg in chunk.segments}

    def before_load(self, chunks: Sequence[Chunk]) -> None:
        """Values are about to be written into these chunks' master shards (loading a checkpoint or state dict).

        The shards must be in memory and writable when this returns. Default: :meth:`before_gather`.
        """
        self.before_gather(chunks)

    def after_load(self, chunks: Sequence[Chunk]) -> None:
        """These chunks' master shards were overwritten in place, and their segments' optimizer states
        replaced (on each segment's device): copies the policy keeps elsewhere are stale, and loaded
        states go where the policy keeps them. Default: :meth:`after_release`.
        """
        self.after_release(chunks)

    def after_backward(self, chunks: Sequence[Chunk]) -> None:
        """Every gradient of this backward is reduced; next, each segment's parameter gets its gradient.

        A segment's gradient must be on the same device as its parameter: a policy that
        routed gradients elsewhere (``ChunkGradients.target_device``) brings the shard there now.
        """

    def before_step(self, chunks: Sequence[Chunk]) -> None:
        """The optimizer is about to update the shards."""

    def after_step(self, chunks: Sequence[Chunk]) -> None:
        """The optimizer has updated the shards."""

    def close(self) -> None:
        """The engine is closed: release what the policy holds outside the chunks (files, pinned buffers)."""

    @abstractmethod
    def tier_of(self, chunk: Chunk) -> MemoryTier:
        """The tier this policy wants ``chunk``'s shard in between uses."""

    def estimate_tiers(self, parts: Sequence[ChunkParts]) -> list[PartTiers] | None:
        """Where this policy would put each chunk's parts after setup, for :func:`zero_core.estimate`.

        ``parts`` are the chunks of one rank in plan order. Return one mapping per chunk,
        or ``None`` (the default) when the answer depends on what the policy measures
        at run time; the estimate then reports no split by tier.
        """
        return None

    def copies_kept_shard(self, device: torch.device) -> bool:
        """Whether moving a kept-gathered chunk's master shard (or stepping it) off ``device``
        leaves a separate copy beside the full buffer, for :func:`zero_core.estimate`."""
        return True


class DevicePlacementPolicy(PlacementPolicy):
    """Keeps every shard, gradient and optimizer state on the compute device."""

    name = "device"

    def attach(self, chunks: Sequence[Chunk]) -> None:
        for chunk in chunks:
            chunk.tier = MemoryTier.DEVICE

    def tier_of(self, chunk: Chunk) -> MemoryTier:
        return MemoryTier.DEVICE

    def estimate_tiers(self, parts: Sequence[ChunkParts]) -> list[PartTiers]:
        return [dict.fromkeys(("params", "grads", "optimizer_states"), MemoryTier.DEVICE) for _ in parts]


def move_shard(chunk: Chunk, device: torch.device) -> None:
    """Keep ``chunk``'s master shard (and so its gradients and optimizer states) on ``device`` from now on.

    Gathers copy the shard to the compute device; reduced gradients are moved to the shard's
    device, not copied. Host shards are pinned when the compute device is CUDA. A tier move:
    call it from a placement policy's hooks (the chunk's :meth:`~Chunk.replace_shard` checks).
    """
    if chunk.shard_device == device:
        return
    pin = device.type == "cpu" and chunk.device.type == "cuda"
    with torch.no_grad():
        shard = torch.empty(chunk.shard_size, dtype=chunk.master_dtype, device=device, pin_memory=pin)
        copy_shard(chunk, shard, chunk.shard)
    chunk.replace_shard(shard)


def copy_shard(chunk: Chunk, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a copy of ``chunk``'s shard between the host (pinned, on CUDA) and its device: on the
    chunk's copy stream when it has streams, and ``dst`` is ready to read when this returns (the host waited the
    copy when ``dst`` is on the host, the compute stream when it is on the device); see [Note: streams of the data
    plane] in ``zero_core.base._streams``. Placement policies that keep their own host buffers copy with it."""
    if dst.device.type == src.device.type:
        dst.copy_(src)
        return
    copy_on_copy_stream(dst, src, chunk.streams)


def absent_shard(chunk: Chunk) -> torch.Tensor:
    """A stand-in for a shard that is not in memory (on disk): ``chunk``'s shard shape, one shared element, NaN.

    Pass it to :meth:`Chunk.replace_shard`. In-place updates of it fail ("more than one element of
    the written-to tensor refers to a single memory location") and reads give NaN, so an optimizer
    or gather that touches a shard the policy did not bring back fails loudly instead of using
    stale values.
    """
    fill = float("nan") if chunk.master_dtype.is_floating_point else 0
    return torch.full((1,), fill, dtype=chunk.master_dtype).expand(chunk.shard_size)


class HostPlacementPolicy(PlacementPolicy):
    """Keeps every master shard, its gradient and its optimizer state in host memory.

    The compute device holds only what a step needs at once: gathered parameters and
    the gradient buffers of the running backward. Gathers copy shards up (from pinned
    memory on CUDA), reduced gradients are moved down (not copied and kept twice), and
    the optimizer steps on the host. This is what ColossalAI's ``offload_config={"device": "cpu"}``
    did for tensor-wise ZeRO-3, for every strategy. On a machine without CUDA the host
    is the compute device, so the shards just live apart from the gathered buffers.
    """

    name = "host"

    def initial_tier(self, chunk: Chunk) -> MemoryTier:
        """Every shard is made in host memory: setup never holds the model's shards on the device."""
        return MemoryTier.HOST

    def attach(self, chunks: Sequence[Chunk]) -> None:
        host = torch.device("cpu")
        state = self.context.optimizer.state
        for chunk in chunks:
            move_shard(chunk, host)
            chunk.tier = MemoryTier.HOST
            for seg in chunk.segments:  # states an optimizer creates eagerly (Adagrad's sums) follow their shard
                for key, value in state.get(seg.param, {}).items():
                    if isinstance(value, torch.Tensor) and value.shape == seg.param.shape and key != "step":  # per element
                        state[seg.param][key] = rewrap(value, to_local(value).to(host))

    def before_gather(self, chunks: Sequence[Chunk]) -> None:
        """Nothing to move: a gather reads the host shard directly."""

    def tier_of(self, chunk: Chunk) -> MemoryTier:
        return MemoryTier.HOST

    def estimate_tiers(self, parts: Sequence[ChunkParts]) -> list[PartTiers]:
        return [dict.fromkeys(("params", "grads", "optimizer_states"), MemoryTier.HOST) for _ in parts]

    def copies_kept_shard(self, device: torch.device) -> bool:
        return device.type != "cpu"  # on a CPU machine the host shard is the compute device's: no move, no copy
