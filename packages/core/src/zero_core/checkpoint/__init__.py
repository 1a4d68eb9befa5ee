"""The model's state read or written whole: sharded checkpoints (sync and async), full state dicts,
``state_dict()``, streamed weights, Hugging Face folders, safetensors streaming, weight sources, gathered
parameters, offline consolidation.

It may import its own modules and the rooms below it (base, config, comm, chunks, interfaces, runtime, setup);
never a room above it (tests/test_import_graph.py, LAYERS).
"""
