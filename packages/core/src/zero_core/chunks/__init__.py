"""Chunks: the flat buffer of parameters (``chunk``), its layout, gradients, slots and buffers, who may move it,
gather groups, and the data-plane collectives over them (``_collectives``).

It may import its own modules and the rooms below it (base, config, comm); never a room above it
(tests/test_import_graph.py, LAYERS).
"""
