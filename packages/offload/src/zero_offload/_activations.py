"""Activation offload: the tensors autograd saves in chosen modules' forwards wait in host memory for their backward.

[Note: activation offload]
A second capacity lever beside activation checkpointing: instead of recomputing a block's
activations in backward, keep them, but on the host. :func:`offload_activations` wraps the
forward of each chosen module in ``torch.autograd.graph.saved_tensors_hooks``:

- *pack* (forward, for each tensor autograd saves): a tensor on an accelerator is copied
  into a pinned host buffer on a copy stream of its own (the copy stream waits for the
  compute stream first, and the device tensor is held, with the event its copy recorded,
  until that event has passed, so the caching allocator cannot hand its memory out before
  the copy ends: events, not ``record_stream``, as in [Note: streams of the data plane] in
  ``zero_core.base._streams``); the device copy is then free once the forward drops it. A tensor already on the host (every tensor on a
  CPU-only machine) is kept as it is: there is nowhere cheaper to put it, and copying it
  would only double it. Both are counted (:class:`ActivationOffload` ``offloaded``, ``kept``).
- *unpack* (backward): an offloaded tensor comes back to its device. The first unpack of
  a block's tensors starts bringing back those of the block whose forward ran just
  before it (its backward comes next): on CUDA on the copy stream, into memory
  allocated on the compute stream, which waits for that copy's event only when autograd
  asks for the tensor. So at most two blocks' offloaded activations are back on the
  device at once. A tensor not prefetched (the last block's) comes back when asked,
  on the compute stream after its copy out's event.
- Parameters, buffers and views of either are never packed: they are model data, which the
  engine and the placement policy own (under ``shard()`` a module's parameters are views of
  a gathered chunk buffer). A saved tensor whose storage is a storage of one of the module's
  parameters or buffers at the time of the call is kept as it is (``skipped``).

Gemini chooses the blocks itself with ``GeminiConfig(offload_activations="auto")``: its warm-up
offloads every block of the model's ``nn.ModuleList`` s and counts each one's saved bytes
(``saved_bytes``); the plan then keeps the last blocks' activations on the device while its
estimate fits the budget, and traces one more step to plan from exact figures (see [Note:
gemini's decisions]). On a CPU-only
machine, where the device budget is for a simulated device, Gemini's offload copies the tensors
anyway as engine work (``simulate_host=True``), so the tracer sees them leave the device.
The CUDA streams are written but not yet run on a GPU.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zero_core.plugin import engine_work_context

__all__ = ["ActivationOffload", "offload_activations"]


def copy_to(tensor: torch.Tensor, device: torch.device, *, pin: bool = False,
            stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """A copy of ``tensor`` on ``device`` with its shape, strides and dtype (pinned if ``pin``).

    With ``stream`` (CUDA) the copy runs there, without blocking the host: ``stream`` first
    waits for the current stream, which produced ``tensor``. The caller keeps ``tensor`` (and
    ``out``) alive until an event recorded on ``stream`` after the copy has passed, so the
    allocator cannot reuse their memory while the copy runs (no ``record_stream``).
    """
    out = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device, pin_memory=pin)
    if stream is None:
        out.copy_(tensor, non_blocking=pin)
        return out
    stream.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(stream):
        out.copy_(tensor, non_blocking=True)
    return out


def _model_storages(module: nn.Module) -> set[int]:
    """The storages of ``module``'s parameters and buffers that are in memory now. Under ``shard()`` a submodule's
    parameters are stand-ins until its own forward gathers them (see [Note: parameters used outside their module] in
    ``zero_core.runtime._released``): their storage is not read, which would gather them outside their module."""
    # a stand-in carries its chunk (``_zero_chunk``); reading the attribute is no torch function, so gathers nothing
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())
            if getattr(t, "_zero_chunk", None) is None}


def _is_model(tensor: torch.Tensor, model: set[int], module: nn.Module) -> bool:
    """Whether a saved tensor is a parameter, a buffer or a view of one: looked up again on a miss, since a
    submodule's parameters are gathered by the time it saves them."""
    if isinstance(tensor, nn.Parameter):
        return True
    ptr = tensor.untyped_storage().data_ptr()
    if ptr in model:
        return True
    model.update(_model_storages(module))
    return ptr in model


class _Group:
    """The tensors one call of a wrapped forward offloaded, and the group offloaded just before it.

    Weak references only: a graph that is dropped without a backward frees its host copies.
    """

    def __init__(self, previous: _Group | None) -> None:
        self.items: list[weakref.ref[_Packed]] = []
        self.previous = weakref.ref(previous) if previous is not None else None
        self.prefetched = False


@dataclass
class _Packed:
    """A saved tensor moved to the host: where it came from, the event its copy out recorded (CUDA), its group, and
    its copy back once prefetched (with the event that copy recorded on CUDA)."""

    host: torch.Tensor
    device: torch.device
    event: torch.cuda.Event | None
    group: _Group
    back: torch.Tensor | None = None
    back_event: torch.cuda.Event | None = None


class ActivationOffload:
    """Installed by :func:`offload_activations`; counts what its hooks did. See [Note: activation offload].

    Attributes:
        modules: The modules whose forwards are wrapped.
        offloaded: Saved tensors copied to the host by pack.
        kept: Saved tensors already on the host, kept as they were (every one on a CPU-only machine).
        skipped: Saved tensors that were parameters, buffers or views of them, never moved.
        unpacked: Offloaded tensors brought back to their device by unpack.
        prefetched: Of those, tensors already on their way back when unpack asked (see [Note: activation offload]).
        offloaded_bytes: Bytes copied to the host by pack.
    """

    def __init__(self, modules: Iterable[nn.Module], *, copy_host_tensors: bool = False, measure: bool = False,
                 simulate_host: bool = False) -> None:
        self.modules = list(modules)
        if not self.modules or not all(isinstance(m, nn.Module) for m in self.modules):
            raise TypeError(
                "offload_activations() takes a module or an iterable of modules (the blocks whose saved activations "
                f"go to the host), got {self.modules!r}"
            )
        if len({id(m) for m in self.modules}) != len(self.modules):
            raise ValueError("offload_activations() got the same module twice; name each block once")
        # Tests only: copy tensors that are already on the host too, so a CPU-only machine runs the copy path.
        self._copy_host = copy_host_tensors or simulate_host
        # Gemini on a CPU-only machine: the host copies are not device data, so they are made as engine work
        # (a memory tracer leaves them out), and the tensors they copy leave its count once the forward drops them.
        self._simulate_host = simulate_host
        # Gemini's warm-up with offload_activations="auto": the modules' saved bytes are to be planned from.
        self.measure = measure
        self.saved_bytes: dict[int, int] = {}  # by id(module), over every call
        self.call_order: list[nn.Module] = []  # each module once, in the order of its first call
        self._stream: torch.cuda.Stream | None = None
        # CUDA: tensors a copy stream still reads or writes, with the event after which they may be freed.
        self._in_flight: list[tuple[torch.cuda.Event, torch.Tensor]] = []
        self.offloaded = self.kept = self.skipped = self.unpacked = self.prefetched = self.offloaded_bytes = 0
        self._last: _Group | None = None  # the group of the latest wrapped forward: the next one's previous
        for module in self.modules:
            if "forward" in vars(module):
                raise ValueError(
                    f"{type(module).__name__}'s forward is already replaced on the instance (offload_activations() "
                    "installed twice, or another wrapper): remove that first"
                )
            module.forward = self._wrap(module, module.forward)

    def _wrap(self, module: nn.Module, forward: Any) -> Any:
        def offloaded_forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # nothing is saved for a backward
                return forward(*args, **kwargs)
            # read at each call: under shard() the engine re-points parameters at gathered buffers before it
            model = _model_storages(module)
            if id(module) not in self.saved_bytes:
                self.saved_bytes[id(module)] = 0
                self.call_order.append(module)
            group = self._last = _Group(self._last)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, model, group, module), self._unpack):
                return forward(*args, **kwargs)

        return offloaded_forward

    def measured(self) -> list[tuple[nn.Module, int]]:
        """Each module's saved bytes (what pack moves or would move, over every call), in the order of first calls."""
        return [(m, self.saved_bytes[id(m)]) for m in self.call_order]

    def _settle(self) -> None:
        """Let go of the tensors whose copy has ended (see :func:`copy_to`)."""
        self._in_flight = [(e, t) for e, t in self._in_flight if not e.query()]

    def _pack(self, tensor: torch.Tensor, model: set[int], group: _Group, module: nn.Module) -> Any:
        if _is_model(tensor, model, module):
            self.skipped += 1
            return tensor
        self.saved_bytes[id(module)] += tensor.numel() * tensor.element_size()
        host = torch.device("cpu")
        if tensor.device == host and not self._copy_host:
            self.kept += 1  # already on the host: nowhere cheaper to keep it, and a copy would double it
            return tensor
        stream = None
        if tensor.device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(tensor.device)
            stream = self._stream
        if self._simulate_host:
            with engine_work_context():  # not device data: see __init__
                copy = copy_to(tensor, host)
        else:
            copy = copy_to(tensor, host, pin=tensor.device.type == "cuda", stream=stream)
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self._settle()
            self._in_flight.append((event, tensor))  # kept until the copy has read it
        self.offloaded += 1
        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        packed = _Packed(copy, tensor.device, event, group)
        group.items.append(weakref.ref(packed))
        return packed

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed  # kept or skipped: the tensor itself
        self.unpacked += 1
        # this group's backward has begun: the group offloaded before it is the next to be asked for
        previous = packed.group.previous() if packed.group.previous is not None else None
        if previous is not None and not previous.prefetched:
            previous.prefetched = True
            for ref in previous.items:
                item = ref()
                if item is not None and item.back is None:
                    self._fetch(item)
        if packed.back is not None:  # prefetched: used once (a second unpack, with retain_graph, copies again)
            self.prefetched += 1
            out, event, packed.back, packed.back_event = packed.back, packed.back_event, None, None
            if event is not None:
                torch.cuda.current_stream(packed.device).wait_event(event)
            return out
        if packed.event is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.event)
        # from a pinned buffer the copy does not block the host; the pinned allocator keeps the buffer until it is done
        return packed.host.to(packed.device, non_blocking=packed.host.is_pinned(), copy=True)

    def _fetch(self, packed: _Packed) -> None:
        """Start ``packed``'s copy back to its device ahead of its unpack (on CUDA on the copy stream)."""
        if packed.device.type != "cuda" or self._stream is None:
            packed.back = packed.host.to(packed.device, copy=True)
            return
        stream = self._stream
        compute = torch.cuda.current_stream(packed.device)
        # allocated on the compute stream, which uses it; the copy stream waits for that stream's earlier use of the memory
        back = torch.empty_strided(packed.host.shape, packed.host.stride(), dtype=packed.host.dtype, device=packed.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            if packed.event is not None:
                stream.wait_event(packed.event)
            back.copy_(packed.host, non_blocking=True)
        packed.back_event = torch.cuda.Event()
        packed.back_event.record(stream)
        packed.back = back
        self._settle()
        self._in_flight.append((packed.back_event, back))  # kept until written, even if its graph is dropped unused

    def remove(self) -> None:
        """Put the modules' own forwards back (tensors already packed still come back in their backward)."""
        for module in self.modules:
            vars(module).pop("forward", None)
        self.modules = []

    def __enter__(self) -> ActivationOffload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def counts(self) -> dict[str, int]:
        return {"offloaded": self.offloaded, "kept": self.kept, "skipped": self.skipped, "unpacked": self.unpacked,
                "prefetched": self.prefetched, "offloaded_bytes": self.offloaded_bytes}


def offload_activations(modules: nn.Module | Iterable[nn.Module], *, copy_host_tensors: bool = False) -> ActivationOffload:
    """Send the tensors autograd saves in ``modules``' forwards to pinned host memory until their backward.

    Call it on the blocks to offload (for example ``model.layers[:8]``), before or after
    ``shard()``; use the result as a context manager or call ``.remove()`` to undo it.
    See [Note: activation offload] for what moves and what never does.

    Args:
        modules: A module, or an iterable of modules such as an ``nn.ModuleList`` (each wrapped once).
        copy_host_tensors: Copy tensors that are already on the host too (they are
            otherwise kept as they are): for tests of the copy path on a CPU-only machine.
    """
    # a ModuleList has no forward of its own: it names its blocks
    chosen = [modules] if isinstance(modules, nn.Module) and not isinstance(modules, nn.ModuleList) else list(modules)
    return ActivationOffload(chosen, copy_host_tensors=copy_host_tensors)
