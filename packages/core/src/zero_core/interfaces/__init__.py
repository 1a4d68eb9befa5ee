"""What plugins implement and read: hook specifications, the placement policy and shard strategy interfaces,
meshes, registries and the plugin manager, zero-core's own plugin, and the read-only views a hook gets.

It may import its own modules and the rooms below it (base, config, comm, chunks); never a room above it
(tests/test_import_graph.py, LAYERS).
"""
