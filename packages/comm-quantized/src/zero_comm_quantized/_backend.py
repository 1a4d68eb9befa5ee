"""The ``quantized`` comm backends: zero-comm's torch backend, with parameter all-gathers and gradient
reduce-scatters sent as int8 blocks with fp32 scales (``quantized*``) or int4 blocks with bf16 scales
(``quantized-int4*``).

[Note: what the quantized backends quantize]
Only the two collectives the runtime marks as lossy-capable (see [Note: collectives that may be lossy] in
``zero_core.comm.backend``): the all-gathers of parameter values for forward and backward (stage 3's gathers,
stages 1 and 2's after-step refresh of the full parameters) and the reduce-scatters of gradients. Master values
never pass through them: the optimizer steps the fp32 (or the model's dtype) master shard from the reduced
gradient, and that shard stays exactly what the optimizer wrote; checkpoints, ``full_tensor()``-style inspection,
HSDP's replica traffic, whole-tensor optimizer exchanges, broadcasts and the copies ``reshard_after_forward=<int>``
keeps are exact collectives. What is lossy is the copy each rank computes with (its weights, off by at most
``max|x| / 254`` of their block in int8, ``max|x| / 14 * (1 + 2**-7)`` in int4) and the summed gradient (each
rank's contribution off by at most that of its own block, summed in fp32 after dequantising). One rank
communicates nothing and quantizes nothing; integer tensors go exact.

The all-gather (ZeRO++'s qwZ): each rank quantizes its shard into one uint8 row (see [Note: the int8 wire format]
or [Note: the int4 wire format] in ``zero_comm_quantized._codec``), the rows are all-gathered by the torch
backend, and every rank dequantizes every row, its own included, so that all ranks compute with the same
weights. A gather in place (the input is
this rank's row of the output: stages 1 and 2 with the master in the full buffer) leaves the own row as it is,
because it may be the master itself.

The reduce-scatter (ZeRO++'s qgZ in one hop): each rank quantizes every destination's slice of its gradient in
its own blocks, an all-to-all hands rank ``r`` every rank's quantized copy of slice ``r``, and rank ``r``
dequantizes them and sums them in fp32 in rank order, then casts to the output's dtype. The bytes are those of a
ring reduce-scatter of the quantized payload, and unlike a ring of quantized partial sums no sum is quantized
twice. The input is free as soon as the call returns (it is quantized into a send buffer first), which the
pending says with ``input_released``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from zero_comm import TorchCommBackend
from zero_comm._torch_backend import check_reduce_scatter_sizes
from zero_comm_quantized._codec import BITS, dequantize_rows, quantize_rows, row_bytes
from zero_core import ConfigError
from zero_core.plugin import BufferPool, CollectiveKind, CommError, Pending

if TYPE_CHECKING:
    from zero_core import ZeroConfig

__all__ = ["Quantization", "QuantizedCommBackend", "QuantizedGradsCommBackend", "QuantizedInt4CommBackend",
           "QuantizedInt4GradsCommBackend", "QuantizedInt4ParamsCommBackend", "QuantizedParamsCommBackend"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Quantization:
    """What a quantized backend quantizes, to how many bits, and the block its scales cover.

    Attributes:
        block_size: Values per scale (a block never crosses one rank's row). Smaller blocks follow the values
            more closely and cost more scale bytes per value: ``4 / block_size`` in int8 (fp32 scales; 256 adds
            1.6% to int8's byte), ``2 / block_size`` in int4 (bf16 scales; 256 adds 1.6% to int4's 43/88 of a byte,
            and int4 stays within a quarter of bf16's bytes only with blocks of 177 or more).
        params: Quantize the parameters' all-gathers for forward and backward.
        grads: Quantize the gradients' reduce-scatters.
        params_bits: 8 (int8 codes, fp32 scales) or 4 (int4 codes, 11 in 43 bits, bf16 scales) for the parameters'
            all-gathers; see [Note: the int4 wire format] in ``zero_comm_quantized._codec`` and, before choosing
            4, the measurements in ``docs/comm/quantized.md``.
        grads_bits: 8 or 4, the same for the gradients' reduce-scatters (ZeRO++'s qgZ sends 4).
    """

    block_size: int = 256
    params: bool = True
    grads: bool = True
    params_bits: int = 8
    grads_bits: int = 8

    def __post_init__(self) -> None:
        block = self.block_size
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 2**24:
            raise ConfigError(f"Quantization.block_size must be an int from 1 to 2**24 values per scale, got {block!r}; "
                            "256 is ZeRO++'s choice.")
        for name in ("params", "grads"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"Quantization.{name} must be True or False, got {getattr(self, name)!r}.")
        for name in ("params_bits", "grads_bits"):
            bits = getattr(self, name)
            if isinstance(bits, bool) or bits not in BITS:
                raise ConfigError(f"Quantization.{name} must be 8 (int8, the default) or 4 (int4), got {bits!r}; "
                                  "there is no wire format for other widths.")
        if not (self.params or self.grads):
            raise ConfigError("Quantization(params=False, grads=False) quantizes nothing: use the 'torch' backend.")


class _Dequantizing:
    """A quantized all-gather in flight: ``wait()`` (once; idempotent) waits for the transfer, then dequantizes."""

    def __init__(self, inner: Pending | None, finish: Callable[[], None]) -> None:
        self._inner = inner
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> None:
        finish, self._finish = self._finish, None
        if finish is None:
            return
        if self._inner is not None:
            self._inner.wait()
            self._inner = None
        finish()


class QuantizedCommBackend(TorchCommBackend):
    """The torch backend with quantized parameter all-gathers and gradient reduce-scatters (per-block scales).

    See [Note: what the quantized backends quantize]. Registered as ``quantized`` (both), ``quantized-params``
    and ``quantized-grads`` in int8, and ``quantized-int4``, ``quantized-int4-params`` and
    ``quantized-int4-grads`` in int4, with 256 values per scale; :meth:`variant` makes one with other settings
    (int8 weights with int4 gradients, as ZeRO++ does, is ``Quantization(grads_bits=4)``).
    """

    name = "quantized"
    quantization: ClassVar[Quantization] = Quantization()

    def __init__(self, group: Any = None, *, timeout: timedelta = timedelta(minutes=5)) -> None:
        super().__init__(group, timeout=timeout)
        # The uint8 rows sent and received, a pool per collective: on CUDA the all-gathers and the reduce-scatters run on
        # streams of their own, and a buffer handed from one to the other could still be read by the first one's
        # kernels (within one stream, stream order keeps reuse safe). Thread-safe: the waiter thread gives back.
        self._gather_rows, self._reduce_rows = BufferPool(), BufferPool()

    @classmethod
    def variant(cls, name: str, quantization: Quantization) -> type[QuantizedCommBackend]:
        """A backend class named ``name`` with these settings; register it with :func:`zero_comm_quantized.plugin_for`."""
        if not isinstance(quantization, Quantization):
            raise ConfigError(f"variant() takes a Quantization, got {type(quantization).__name__}; "
                            "write Quantization(block_size=128).")
        return type(f"QuantizedCommBackend_{name}", (cls,), {"name": name, "quantization": quantization})

    def free(self) -> None:
        super().free()
        self._gather_rows, self._reduce_rows = BufferPool(), BufferPool()

    @property
    def buffer_bytes(self) -> int:
        pools = (self._gather_rows, self._reduce_rows)
        return super().buffer_bytes + sum(pool.nbytes + pool.lent for pool in pools)

    @classmethod
    def params_exact_at(cls, world_size: int) -> bool:
        return not (cls.quantization.params and world_size > 1)

    @classmethod
    def estimate_bytes_sent(cls, kind: CollectiveKind, numel_per_rank: int, *, element_size: int, world_size: int,
                            config: ZeroConfig) -> int:
        """One quantized row per rank (see [Note: the int8 wire format] and [Note: the int4 wire format] in
        ``zero_comm_quantized._codec``: ``row_bytes`` counts it), ring
        bytes: ``(world_size - 1)`` rows leave each rank. Collectives this backend leaves exact count as the torch
        backend's. The dtype is not known here: a floating one is assumed, which zero's chunks are."""
        q = cls.quantization
        quantized, bits = (q.params, q.params_bits) if kind is CollectiveKind.ALL_GATHER else (q.grads, q.grads_bits)
        if not quantized or world_size <= 1 or numel_per_rank == 0:
            return super().estimate_bytes_sent(kind, numel_per_rank, element_size=element_size, world_size=world_size,
                                               config=config)
        return (world_size - 1) * row_bytes(numel_per_rank, q.block_size, bits)

    def _quantizes(self, tensor: torch.Tensor, enabled: bool) -> bool:
        # decided by the call site's setting, the world and the dtype alone: the same on every rank for one call
        return enabled and self.world_size > 1 and tensor.dtype.is_floating_point and tensor.numel() > 0

    def all_gather_params(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Pending | None:
        if not self._quantizes(input, self.quantization.params):
            return self.all_gather(output, input, async_op=async_op)
        world, m, block = self.world_size, input.numel(), self.quantization.block_size
        bits = self.quantization.params_bits
        if output.numel() != m * world:
            raise CommError(f"all_gather output has {output.numel()} elements, expected world_size x input = "
                            f"{world} x {m}")
        width = row_bytes(m, block, bits)
        pool = self._gather_rows  # the one it came from, even if free() replaces it meanwhile
        send = pool.take(width, torch.uint8, input.device, zeroed=False)
        quantize_rows(input.detach().reshape(1, m), send.view(1, width), block=block, bits=bits)
        received = pool.take(width * world, torch.uint8, output.device, zeroed=False)
        rows = output.view(world, m)
        # a gather in place keeps its own row: it may be the master (see the interface's all_gather_params)
        own = rows[self.rank]
        in_place = input.data_ptr() == own.data_ptr() and input.untyped_storage().data_ptr() == output.untyped_storage().data_ptr()
        inner = self.all_gather(received, send, async_op=True)  # counted as an all-gather of the uint8 rows

        def dequantize() -> None:
            values = dequantize_rows(received.view(world, width), m, block=block, bits=bits)
            with torch.no_grad():
                if in_place:
                    for r in range(world):
                        if r != self.rank:
                            rows[r].copy_(values[r])
                else:
                    rows.copy_(values)
            pool.give(send)
            pool.give(received)

        pending = _Dequantizing(inner, dequantize)
        if async_op:
            return pending
        pending.wait()
        return None

    def reduce_scatter_grads(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Pending | None:
        if not self._quantizes(input, self.quantization.grads):
            return self.reduce_scatter(output, input, async_op=async_op)
        check_reduce_scatter_sizes(output, input, self.world_size)
        world, m, block = self.world_size, output.numel(), self.quantization.block_size
        bits = self.quantization.grads_bits
        width = row_bytes(m, block, bits)
        pool = self._reduce_rows
        send = pool.take(width * world, torch.uint8, input.device, zeroed=False)
        quantize_rows(input.detach().reshape(world, m), send.view(world, width), block=block, bits=bits)
        received = pool.take(width * world, torch.uint8, input.device, zeroed=False)
        # the bytes of a ring reduce-scatter of the quantized payload: (world - 1) rows leave this rank
        timer = self._record(CollectiveKind.REDUCE_SCATTER, width * world, input.device)
        work = dist.all_to_all_single(received, send, group=self.group, async_op=True)

        def add_up() -> None:
            total = dequantize_rows(received.view(world, width), m, block=block, bits=bits).sum(dim=0)  # fp32, in rank order
            with torch.no_grad():
                output.view(-1).copy_(total)
            pool.give(received)
            pool.give(send)

        pending = self._finish(work, f"quantized reduce_scatter of {input.numel()} elements", send, async_op, timer,
                               then=add_up)
        if pending is not None:
            pending.input_released = True  # type: ignore[attr-defined]  # quantized into ``send`` already
        return pending


class QuantizedParamsCommBackend(QuantizedCommBackend):
    """Int8 parameter all-gathers only; gradients are reduced exactly."""

    name = "quantized-params"
    quantization = Quantization(grads=False)


class QuantizedGradsCommBackend(QuantizedCommBackend):
    """Int8 gradient reduce-scatters only; parameters are gathered exactly."""

    name = "quantized-grads"
    quantization = Quantization(params=False)


class QuantizedInt4CommBackend(QuantizedCommBackend):
    """Int4 parameter all-gathers and int4 gradient reduce-scatters (bf16 scales); see [Note: the int4 wire
    format] and, for where it costs training quality, ``docs/comm/quantized.md``."""

    name = "quantized-int4"
    quantization = Quantization(params_bits=4, grads_bits=4)


class QuantizedInt4ParamsCommBackend(QuantizedCommBackend):
    """Int4 parameter all-gathers only; gradients are reduced exactly."""

    name = "quantized-int4-params"
    quantization = Quantization(grads=False, params_bits=4)


class QuantizedInt4GradsCommBackend(QuantizedCommBackend):
    """Int4 gradient reduce-scatters only (ZeRO++'s qgZ width); parameters are gathered exactly."""

    name = "quantized-int4-grads"
    quantization = Quantization(params=False, grads_bits=4)


BUILT_IN: tuple[type[QuantizedCommBackend], ...] = (QuantizedCommBackend, QuantizedParamsCommBackend,
                                                    QuantizedGradsCommBackend, QuantizedInt4CommBackend,
                                                    QuantizedInt4ParamsCommBackend, QuantizedInt4GradsCommBackend)
