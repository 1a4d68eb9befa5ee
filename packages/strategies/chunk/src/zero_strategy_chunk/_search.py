"""Chunk-size search: the size that wastes the least space when packing greedily.

All candidates are simulated at once with numpy: for each parameter in packing order
every candidate either fits it into its open chunk or closes the chunk (wasting the
rest) and opens a new one. Parameters far larger than the rest (above mean + 3 sigma)
are left out of the search; they get chunks of their own when packing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zero_core.plugin import PlanError, round_up

__all__ = ["SearchResult", "outlier_threshold", "search_chunk_size"]


@dataclass(frozen=True, slots=True)
class SearchResult:
    """The chosen chunk size and the padding (in elements) it leaves when packing."""

    chunk_size: int
    waste: int
    candidates: int


def outlier_threshold(sizes: Sequence[int]) -> float:
    """Parameters larger than this get their own chunk and are left out of the search."""
    if len(sizes) < 2:
        return float("inf")
    arr = np.asarray(sizes, dtype=np.float64)
    return float(arr.mean() + 3 * arr.std())


def search_chunk_size(
    sizes: Sequence[int], *, world_size: int, min_chunk_size: int, interval: int, search_range: int
) -> SearchResult:
    """Search ``[start, start + search_range]`` in steps of ``interval`` for the least waste.

    ``start`` is the larger of ``min_chunk_size`` and the largest non-outlier parameter,
    rounded up to ``interval``; each candidate is rounded up to a multiple of
    ``world_size`` so that chunks shard evenly. The waste of a candidate is the space
    greedy sequential packing leaves empty, counting the last chunk trimmed to its
    content (rounded up to ``world_size``) and oversized parameters' padding.
    Ties go to the smallest size.
    """
    if not sizes:
        raise PlanError("cannot search a chunk size for zero parameters")
    total = int(sum(sizes))
    if total <= min_chunk_size:
        size = round_up(total, world_size)
        return SearchResult(size, size - total, 1)
    limit = outlier_threshold(sizes)
    regular = np.asarray([s for s in sizes if s <= limit], dtype=np.int64)
    outlier_padding = sum(round_up(s, world_size) - s for s in sizes if s > limit)
    largest = int(regular.max()) if regular.size else 0
    start = round_up(max(min_chunk_size, largest), interval)
    steps = search_range // interval + 1
    caps = np.asarray([round_up(start + k * interval, world_size) for k in range(steps)], dtype=np.int64)
    used = np.zeros_like(caps)
    waste = np.zeros_like(caps)
    for s in regular:
        fits = used + s <= caps
        waste += np.where(fits, 0, caps - used)
        used = np.where(fits, used + s, s)
    waste += (-used) % world_size  # the last chunk, trimmed to its content
    best = int(np.argmin(waste))  # argmin returns the first (smallest) of equal minima
    return SearchResult(int(caps[best]), int(waste[best]) + outlier_padding, len(caps))
