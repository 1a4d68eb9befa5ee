"""Symmetric absmax blocks of int8 or int4 codes with per-block scales: the wire formats of the quantized collectives.

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

[Note: the int4 wire format]
The same blocks with 15 levels: ``scale = max|x| / 7`` and codes ``round(x / scale)`` in ``[-7, 7]``, stored as
``code + 8`` in a nibble (1 to 15), two values a byte (value ``2i`` in the low nibble, ``2i + 1`` in the high
one; an odd row ends with the code 0). At half a byte a value an fp32 scale per 256 values would add 3% to the
payload, so the scales travel as bf16 (fp32's range, so no gradient's scale underflows as fp16's would), rounded
*up* to the next bf16: then ``|x| / scale <= 7`` still holds and no code clips, and the scale is at most
``2**-7`` (relative) above ``max|x| / 7``. A value is off by at most ``scale / 2 <= max|x| / 14 * (1 + 2**-7)``
of its block. A row is ``ceil(m / 2) + 2 * ceil(m / block)`` bytes: with blocks of 256, 0.126953125x of fp32's
bytes and 0.25390625x of bf16's (the payload is exactly a quarter of bf16's; the scales add 1/256). Zeros,
infinities and NaNs behave as in the int8 format.
"""

from __future__ import annotations

import torch

__all__ = ["BITS", "dequantize_rows", "quantize_rows", "row_bytes", "scale_bytes"]

BITS = (4, 8)
"""The code widths there is a wire format for."""

# int8: fp32 scales (a bf16 scale rounded to nearest would push codes past 127; the 4 bytes are 1.6% of int8's).
# int4: bf16 scales rounded up, see [Note: the int4 wire format].
_QMAX = {8: 127.0, 4: 7.0}
_SCALE_DTYPE = {8: torch.float32, 4: torch.bfloat16}


def scale_bytes(bits: int) -> int:
    """Bytes of one block's scale in the ``bits``-wide format."""
    return _SCALE_DTYPE[bits].itemsize


def _code_bytes(m: int, bits: int) -> int:
    return m if bits == 8 else -(-m // 2)


def row_bytes(m: int, block: int, bits: int = 8) -> int:
    """Bytes one quantized row of ``m`` values takes on the wire: the codes, then one scale per block."""
    return _code_bytes(m, bits) + scale_bytes(bits) * -(-m // block)


def _round_up_to_bf16(scales: torch.Tensor) -> torch.Tensor:
    """The least bf16 value at or above each (fp32, non-negative) scale, as fp32; infinities and NaNs as they are."""
    bits = scales.view(torch.int32)
    up = ((bits + 0xFFFF) & -0x10000).view(torch.float32)  # clear the 16 low bits after carrying into them
    return torch.where(scales.isfinite(), up, scales)


def quantize_rows(x: torch.Tensor, out: torch.Tensor, *, block: int, bits: int = 8) -> None:
    """Quantize each row of ``x`` (``rows x m``, any floating dtype) into ``out`` (``rows x row_bytes(m, block,
    bits)`` uint8)."""
    rows, m = x.shape
    blocks = -(-m // block)
    qmax = _QMAX[bits]
    values = x.to(torch.float32)
    if blocks * block != m:  # zeros pad the last block: they change neither its absmax nor its codes
        values = torch.nn.functional.pad(values, (0, blocks * block - m))
    values = values.view(rows, blocks, block)
    scales = values.abs().amax(dim=-1, keepdim=True).div_(qmax)  # NaN and inf stay in the scale
    if bits == 4:
        scales = _round_up_to_bf16(scales)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # a zero block: codes 0, no 0 / 0
    codes = torch.round(values / safe).clamp_(-qmax, qmax).nan_to_num_(0.0).view(rows, blocks * block)[:, :m]
    width = _code_bytes(m, bits)
    if bits == 8:
        out[:, :width].copy_(codes.to(torch.int8).view(torch.uint8))
    else:
        nibbles = codes.add(8.0).to(torch.uint8)
        if m % 2:
            nibbles = torch.nn.functional.pad(nibbles, (0, 1), value=8)  # the code 0
        pairs = nibbles.view(rows, width, 2)
        torch.bitwise_or(pairs[..., 0], pairs[..., 1] << 4, out=out[:, :width])
    out[:, width:].copy_(scales.view(rows, blocks).to(_SCALE_DTYPE[bits]).view(torch.uint8))


def dequantize_rows(packed: torch.Tensor, m: int, *, block: int, bits: int = 8) -> torch.Tensor:
    """The fp32 values (``rows x m``) of quantized rows (``rows x row_bytes(m, block, bits)`` uint8)."""
    rows = packed.shape[0]
    blocks = -(-m // block)
    width = _code_bytes(m, bits)
    if bits == 8:
        codes = packed[:, :width].view(torch.int8).to(torch.float32)
    else:
        low, high = packed[:, :width] & 15, packed[:, :width] >> 4
        codes = torch.stack((low, high), dim=-1).view(rows, 2 * width)[:, :m].to(torch.float32).sub_(8.0)
    # a copy: viewing bytes as scales needs them contiguous and aligned to the scale's size (they are a 64th or less)
    raw = torch.empty((rows, packed.shape[1] - width), dtype=torch.uint8, device=packed.device)
    raw.copy_(packed[:, width:])
    scales = raw.view(_SCALE_DTYPE[bits]).to(torch.float32)  # rows x blocks
    if blocks * block != m:
        codes = torch.nn.functional.pad(codes, (0, blocks * block - m))
    return codes.view(rows, blocks, block).mul_(scales.unsqueeze(-1)).view(rows, blocks * block)[:, :m]
