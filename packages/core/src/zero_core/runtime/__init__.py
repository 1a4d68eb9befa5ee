"""The step: the engine, the units of gather and release and what modules hold, scheduling, gradient reduction,
the optimizer bridge, the loss scaler and whole-tensor optimizer steps.

It may import its own modules and the rooms below it (base, config, comm, chunks, interfaces); never a room
above it (tests/test_import_graph.py, LAYERS).
"""
