"""The configuration objects users pass to :func:`zero_core.shard` (``api``) and their file codec (JSON, TOML,
YAML).

It may import its own modules and the rooms below it (base); never a room above it
(tests/test_import_graph.py, LAYERS).
"""
