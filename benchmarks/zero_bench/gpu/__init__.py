"""``python -m zero_bench.gpu --out DIR``: what one GPU says about zero, in one command (``nox -s gpu``).

Sections, each run on its own so that one that fails is reported and the rest still run:
the environment (``zero env`` plus a matmul calibration), host<->device copy bandwidth, which
gloo collectives take CUDA tensors, GPT-2-medium training against plain PyTorch and FSDP2,
the CUDA test subset, and the largest model each system trains under one device budget.
``--dry-run`` runs every section on the CPU with tiny sizes (a test in the suite does), so the
command cannot rot while no GPU is at hand. See docs/benchmarks-gpu.md.
"""
