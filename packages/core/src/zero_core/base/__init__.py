"""Errors, the state enums every room shares, and platform helpers: atomic files, devices, host memory, DTensor
idioms, install hints, live-byte counting, logging, the engine's accounting marks, the version.

It may import its own modules and nothing else of zero_core; never a room above it
(tests/test_import_graph.py, LAYERS).
"""
