"""Building a sharded model: process groups and meshes, lazy initialisation and materialisation, setup-time
checks.

It may import its own modules and the rooms below it (base, config, comm, chunks, interfaces, runtime); never
a room above it (tests/test_import_graph.py, LAYERS).
"""
