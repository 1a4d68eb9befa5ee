"""Symmetric absmax int8 with one fp32 scale per block: the wire format of the quantized collectives.

[Note: the int8 wire format]
A row of ``m`` values (one rank's shard in an all-gather, one destination's slice in a reduce-scatter) is cut
into ``ceil(m / block)`` blocks of ``block`` values (the last one shorter); a block that never crosses a row means
one rank's values never share a scale with another's. Each block keeps ``scale = max|x| / 127`` as fp32 and each
value ``round(x / scale)`` (to nearest, ties to even) as int8 in ``[-127, 127]``, so the error of a value is at most
``scale / 2 = max|x| / 254`` of its block and the block's largest value comes back exactly up to fp32 rounding. A
row travels as one uint8 buffer: the ``m`` codes, then the scales' bytes, ``m + 4 * ceil(m / block)`` bytes, so
one collective carries codes and scales together. A block of zeros has scale 0 and comes back as zeros. A block
holding an infinity or a NaN comes back as NaN throughout (its scale is not finite): a gradient that overflowed
still reads as not finite where a loss scaler looks for it, never as a finite number.
"""

from __future__ import annotations

import torch

__all__ = ["SCALE_BYTES", "dequantize_rows", "quantize_rows", "row_bytes"]

SCALE_BYTES = 4  # fp32 scales: a bf16 scale would round max|x| / 127 and push codes past 127
_QMAX = 127.0


def row_bytes(m: int, block: int) -> int:
    """Bytes one quantized row of ``m`` values takes on the wire: the codes, then one fp32 scale per block."""
    return m + SCALE_BYTES * -(-m // block)


def quantize_rows(x: torch.Tensor, out: torch.Tensor, *, block: int) -> None:
    """Quantize each row of ``x`` (``rows x m``, any floating dtype) into ``out`` (``rows x row_bytes(m)`` uint8)."""
    rows, m = x.shape
    blocks = -(-m // block)
    values = x.to(torch.float32)
    if blocks * block != m:  # zeros pad the last block: they change neither its absmax nor its codes
        values = torch.nn.functional.pad(values, (0, blocks * block - m))
    values = values.view(rows, blocks, block)
    scales = values.abs().amax(dim=-1, keepdim=True).div_(_QMAX)  # NaN and inf stay in the scale
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # a zero block: codes 0, no 0 / 0
    codes = torch.round(values / safe).clamp_(-_QMAX, _QMAX).nan_to_num_(0.0).to(torch.int8)
    out[:, :m].copy_(codes.view(rows, blocks * block)[:, :m].view(torch.uint8))
    out[:, m:].copy_(scales.view(rows, blocks).contiguous().view(torch.uint8))


def dequantize_rows(packed: torch.Tensor, m: int, *, block: int) -> torch.Tensor:
    """The fp32 values (``rows x m``) of quantized rows (``rows x row_bytes(m)`` uint8)."""
    rows = packed.shape[0]
    blocks = -(-m // block)
    codes = packed[:, :m].view(torch.int8).to(torch.float32)
    scales = packed[:, m:].contiguous().view(torch.float32)  # rows x blocks
    if blocks * block != m:
        codes = torch.nn.functional.pad(codes, (0, blocks * block - m))
    return codes.view(rows, blocks, block).mul_(scales.unsqueeze(-1)).view(rows, blocks * block)[:, :m]
