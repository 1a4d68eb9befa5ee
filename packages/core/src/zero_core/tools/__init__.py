"""Tools around a run: the memory and traffic estimator, the DeepSpeed config importer (and its LR scheduler),
the environment report for bug reports.

It may import its own modules and the rooms below it (base, config, comm, chunks, interfaces, runtime, setup,
checkpoint); never a room above it (tests/test_import_graph.py, LAYERS).
"""
