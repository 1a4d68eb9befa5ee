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
The same blocks with 15 levels: ``scale = max|x| / 7`` and codes ``round(x / scale)`` in ``[-7, 7]``. The scales
travel as bf16 (fp32's range, so no gradient's scale underflows as fp16's would; an fp32 scale per 256 values would
add 3% to the payload), rounded *up* to the next bf16: then ``|x| / scale <= 7`` still holds and no code clips, and
the scale is at most ``2**-7`` (relative) above ``max|x| / 7``. A value is off by at most
``scale / 2 <= max|x| / 14 * (1 + 2**-7)`` of its block. Zeros, infinities and NaNs behave as in the int8 format
(a non-finite block's codes are 0, its scale is not finite, and it comes back as NaN throughout).

The codes travel in base 15, not as nibbles. 15 levels are ``log2(15) = 3.907`` bits of information, and a nibble
spends 4: two a byte are exactly a quarter of bf16's bytes, and the scales then put a row 1/256 above it. Eleven
codes make one integer ``v = sum((c_j + 7) * 15**j for j in 0..10)``, and ``15**11 = 8.65e12 < 2**43``, so 11
codes take 43 bits instead of 44; that bit saved per group pays for the scales. A row of ``m = 11 * q + r``
values (``0 <= r < 11``; group ``g`` holds values ``11g`` to ``11g + 10``) is one uint8 buffer of three parts:

1. the low 40 bits of every group's ``v``, five bytes each, least significant first: ``5 * q`` bytes, then the
   last, partial group of ``r`` codes (padded with the digit 0, i.e. the code -7, which adds nothing to ``v``), whose
   ``v < 15**r < 2**(8 * ceil(r / 2))`` fits in ``ceil(r / 2)`` bytes (two codes a byte, as many as nibbles take);
2. the 3 high bits (``v >> 40``, 0 to 7) of the ``q`` full groups, group ``g`` in bits ``3g`` to ``3g + 2`` of a
   little-endian bit string: ``ceil(3 * q / 8)`` bytes (a byte's unused high bits are 0);
3. the bf16 scales, one per block, as in int8.

That is ``5 * q + ceil(r / 2) + ceil(3 * q / 8) + 2 * ceil(m / block)`` bytes: with blocks of 256, 43/88 + 2/256 =
699/1408 = 0.49645 bytes a value (exactly, where ``m`` is a multiple of 2,816), 0.248224x of bf16's bytes and
0.124112x of fp32's. Whole groups, bytes and blocks cost a row at most a few bytes more, so a row is at most a
quarter of bf16's (``2 * row_bytes(m) <= m``) for every ``m >= 780``, and for some smaller ``m`` (256 is exactly a
quarter), none below 176. With another block size a value costs ``43/88 + 2/block`` bytes in the limit: a quarter of
bf16 from some ``m`` on for blocks of 177 values or more (``m >= 2,892`` at 192, ``m >= 252`` at 512), never for 176
or fewer. Against two codes a byte, a row is never larger but at ``m`` = 12 to 20 and 34 to 42 (even), by one byte.

Packing and unpacking are whole-tensor operations a digit column at a time (11 of them; no loop over values or
groups), exact in floating point because every number is a whole number below its format's mantissa (``v < 2**43``
in fp64; to unpack, each ``v`` is cut into thirds below ``15**4 < 2**16`` whose digits come out in fp32, every
quotient floored from ``x + 1/2``, half a step from any rounding), so the bytes hang on no device's rounding (no
matmul, where TF32 could enter, and no floor of a quotient that a reciprocal could round down; run on CPU only so
far); a group's 8 bytes are those of its int64, least significant first, on either byte order. The codes and scales are those the earlier layout sent
(nibbles ``code + 8``, two a byte, until December 2026): only the bytes differ, so training is unchanged.
"""

from __future__ import annotations

import sys

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


_GROUP = 11  # int4 codes per base-15 group: 15**11 < 2**43
_LOW_BYTES = 5  # a group's low 40 bits; the 3 above them travel apart, 8 groups to 3 bytes
_THIRDS = (range(0, 4), range(4, 8), range(8, 11))  # a group's digits unpacked together: each third below 15**4
_OFFSET = (15**_GROUP - 1) // 2  # sum(7 * 15**j): the digits are the codes + 7
_LITTLE_ENDIAN = sys.byteorder == "little"


def _code_bytes(m: int, bits: int) -> int:
    if bits == 8:
        return m
    full, rest = divmod(m, _GROUP)
    return _LOW_BYTES * full + -(-rest // 2) + -(-3 * full // 8)


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
        _pack_base15(codes, out[:, :width])
    out[:, width:].copy_(scales.view(rows, blocks).to(_SCALE_DTYPE[bits]).view(torch.uint8))


def dequantize_rows(packed: torch.Tensor, m: int, *, block: int, bits: int = 8) -> torch.Tensor:
    """The fp32 values (``rows x m``) of quantized rows (``rows x row_bytes(m, block, bits)`` uint8)."""
    rows = packed.shape[0]
    blocks = -(-m // block)
    width = _code_bytes(m, bits)
    if bits == 8:
        codes = packed[:, :width].view(torch.int8).to(torch.float32)
    else:
        codes = _unpack_base15(packed[:, :width], m)
    # a copy: viewing bytes as scales needs them contiguous and aligned to the scale's size (they are a 64th or less)
    raw = torch.empty((rows, packed.shape[1] - width), dtype=torch.uint8, device=packed.device)
    raw.copy_(packed[:, width:])
    scales = raw.view(_SCALE_DTYPE[bits]).to(torch.float32)  # rows x blocks
    if blocks * block != m:
        codes = torch.nn.functional.pad(codes, (0, blocks * block - m))
    # reshape: int4's codes may be a view into whole groups, which copies once
    return codes.reshape(rows, blocks, block).mul_(scales.unsqueeze(-1)).view(rows, blocks * block)[:, :m]


def _int64_bytes(values: torch.Tensor) -> torch.Tensor:
    """The 8 bytes of each int64, least significant first (``values.shape + (8,)`` uint8)."""
    raw = values.view(torch.uint8).view(*values.shape, 8)
    return raw if _LITTLE_ENDIAN else raw.flip(-1)


def _pack_base15(codes: torch.Tensor, out: torch.Tensor) -> None:
    """Write the int4 codes (``rows x m`` floating, whole numbers in ``[-7, 7]``) into ``out`` (``rows x
    _code_bytes(m, 4)`` uint8) as [Note: the int4 wire format] lays them out."""
    rows, m = codes.shape
    full, rest = divmod(m, _GROUP)
    groups = full + (rest > 0)
    # Horner's rule a column at a time, in fp64: whole numbers below 2**43 < 2**53, so every step is exact
    value = torch.empty((rows, groups), dtype=torch.float64, device=codes.device)
    parts = [(value[:, :full], codes[:, :_GROUP * full].reshape(rows, full, _GROUP))]
    if rest:  # the code -7 (the digit 0) pads the last group: its value stays below 15**rest, in ceil(rest / 2) bytes
        tail = torch.nn.functional.pad(codes[:, _GROUP * full:], (0, _GROUP - rest), value=-7.0)
        parts.append((value[:, full:], tail.view(rows, 1, _GROUP)))
    for part, digits in parts:
        part.copy_(digits[..., _GROUP - 1])
        for j in range(_GROUP - 2, -1, -1):
            part.mul_(15).add_(digits[..., j])
    data = _int64_bytes(value.add_(_OFFSET).to(torch.int64))  # rows x groups x 8; bytes 6 and 7 are 0
    out[:, :_LOW_BYTES * full].view(rows, full, _LOW_BYTES).copy_(data[:, :full, :_LOW_BYTES])
    low_bytes = _LOW_BYTES * full + -(-rest // 2)
    # the partial group's first ceil(rest / 2) bytes: the others are 0
    out[:, _LOW_BYTES * full:low_bytes].copy_(data[:, full:, :low_bytes - _LOW_BYTES * full].reshape(rows, -1))
    if full:
        octets = -(-full // 8)
        high = data[:, :full, _LOW_BYTES].to(torch.int64)  # bits 40 to 42: 0 to 7
        if octets * 8 != full:
            high = torch.nn.functional.pad(high, (0, octets * 8 - full))
        bits24 = (high.reshape(rows, octets, 8) << _shifts(3, 8, out.device)).sum(dim=-1)  # disjoint bits: a sum is an or
        triples = (bits24.unsqueeze(-1) >> _shifts(8, 3, out.device)) & 255  # rows x octets x 3
        out[:, low_bytes:].copy_(triples.view(rows, 3 * octets)[:, :out.shape[1] - low_bytes])  # the rest are 0


def _unpack_base15(packed: torch.Tensor, m: int) -> torch.Tensor:
    """The int4 codes (``rows x m`` fp32) of the code bytes of quantized rows (``rows x _code_bytes(m, 4)`` uint8)."""
    rows = packed.shape[0]
    full, rest = divmod(m, _GROUP)
    groups = full + (rest > 0)
    low_bytes = _LOW_BYTES * full + -(-rest // 2)
    data = torch.zeros((rows, groups, 8), dtype=torch.uint8, device=packed.device)  # each group's int64, bytes
    data[:, :full, :_LOW_BYTES] = packed[:, :_LOW_BYTES * full].view(rows, full, _LOW_BYTES)
    data[:, full:, :low_bytes - _LOW_BYTES * full] = packed[:, _LOW_BYTES * full:low_bytes].view(rows, 1, -1)
    if full:
        octets = -(-full // 8)
        high = packed[:, low_bytes:].to(torch.int64)
        if high.shape[1] != 3 * octets:
            high = torch.nn.functional.pad(high, (0, 3 * octets - high.shape[1]))
        bits24 = (high.view(rows, octets, 3) << _shifts(8, 3, packed.device)).sum(dim=-1)
        threes = (bits24.unsqueeze(-1) >> _shifts(3, 8, packed.device)) & 7  # rows x octets x 8
        data[:, :full, _LOW_BYTES] = threes.view(rows, 8 * octets)[:, :full]
    if not _LITTLE_ENDIAN:
        data = data.flip(-1).contiguous()
    value = data.view(torch.int64).view(rows, groups).to(torch.float64)  # below 2**43: exact
    # Cut each value into three numbers of at most 4 digits (below 15**4 < 2**16), then peel their digits in fp32.
    # Every quotient is floor((x + 1/2) * 15**-k): the true quotient of x + 1/2 is at least 1 / (2 * 15**k) from a
    # whole number, far more than the product's rounding (fp64 for the cuts, fp32 for the digits), so the floor is
    # the exact quotient of x on any device, whether its kernels divide or multiply by a reciprocal.
    top = torch.floor(value.add(0.5).mul_(15.0**-8))
    value.sub_(top * 15**8)
    middle = torch.floor(value.add(0.5).mul_(15.0**-4))
    value.sub_(middle * 15**4)
    codes = torch.empty((rows, groups, _GROUP), dtype=torch.float32, device=packed.device)
    for part, columns in zip((value, middle, top), _THIRDS, strict=True):
        number = part.to(torch.float32)
        for j in columns[:-1]:
            quotient = torch.floor(number.add(0.5).mul_(1 / 15))
            torch.add(number, quotient, alpha=-15, out=codes[..., j])
            number = quotient
        codes[..., columns[-1]] = number  # below 15: the last digit
    return codes.view(rows, groups * _GROUP)[:, :m].sub_(7.0)


def _shifts(step: int, count: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, step * count, step, dtype=torch.int64, device=device)
