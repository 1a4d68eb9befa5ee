"""Exact bytes of what operators create while a mode is on: for tests and benchmarks that assert a peak."""

from __future__ import annotations

from zero_core.base._live_bytes import LiveBytes

__all__ = ["LiveBytes"]
