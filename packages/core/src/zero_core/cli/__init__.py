"""The ``zero`` command line: the parser and one module per command.

It may import its own modules and the rooms below it (base, config, comm, chunks, interfaces, runtime, setup,
checkpoint, tools, top, testing); never a room above it (tests/test_import_graph.py, LAYERS).
"""
