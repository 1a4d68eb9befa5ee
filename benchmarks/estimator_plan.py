"""Plan HSDP against full sharding for a 7B and a 70B model on 8 to 1024 GPUs (docs/estimator.md).

    python benchmarks/estimator_plan.py        # prints the Markdown tables pasted into the docs

Stage 3, bf16 compute, fp32 masters and Adam (8 bytes of state per master element), fp32 gradient
reduction (the default), ``zero_core.estimate`` from a parameter count. Nodes of 8 GPUs. Layouts:

* HSDP ``(R, 8)``: one shard group per node, ``R`` = nodes replicas;
* full sharding ``(1, W)``: every chunk over all ``W`` GPUs;
* for 70B, whose HSDP ``(R, 8)`` state does not fit an 80 GB GPU, also ``(W/32, 32)``: shard
  groups of 4 nodes.

"state" is model-state GiB per GPU; "sent" is what a GPU sends per step over every link, and
"inter-node" the part of it that crosses nodes, from :meth:`Estimate.inter_node_bytes` (rings
ordered by node, averaged over a node's GPUs: see its docstring). GiB are 2**30 bytes.
"""

from __future__ import annotations

from zero_core import Precision, ZeroConfig, estimate

GiB = 2**30
GPUS_PER_NODE = 8
GPUS = (8, 16, 64, 128, 512, 1024)
MODELS = (("7B", 7_000_000_000, (8,)), ("70B", 70_000_000_000, (8, 32)))
CONFIG = ZeroConfig(stage=3, precision=Precision(compute="bf16"))


def layouts(gpus: int, shard_sizes: tuple[int, ...]) -> list[tuple[str, tuple[int, int]]]:
    out = [(f"HSDP ({gpus // s}, {s})", (gpus // s, s)) for s in shard_sizes if gpus % s == 0 and gpus > s]
    return out + [(f"full (1, {gpus})", (1, gpus))]


def main() -> None:
    for name, psi, shard_sizes in MODELS:
        print(f"\n#### {name} ({psi:,} parameters), stage 3, bf16 compute, fp32 Adam master, {GPUS_PER_NODE}-GPU nodes\n")
        print("| GPUs | nodes | layout | state GiB/GPU | sent GiB/GPU/step | inter-node GiB/GPU/step | inter-node vs full |")
        print("|---|---|---|---|---|---|---|")
        for gpus in GPUS:
            cells = [(label, estimate(psi, mesh_shape=shape, config=CONFIG)) for label, shape in layouts(gpus, shard_sizes)]
            full = cells[-1][1].inter_node_bytes(GPUS_PER_NODE)
            for label, e in cells:
                inter = e.inter_node_bytes(GPUS_PER_NODE)
                ratio = "–" if full == 0 else f"{inter / full:.3f}"
                print(f"| {gpus} | {-(-gpus // GPUS_PER_NODE)} | {label} | {e.max_model_state_bytes / GiB:,.2f} "
                      f"| {e.total_bytes_sent / GiB:,.2f} | {inter / GiB:,.2f} | {ratio} |")

    gpus, psi = 1024, 7_000_000_000
    print(f"\n#### Inter-node GiB/GPU/step by precision: 7B on {gpus} GPUs, stage 3\n")
    print("| compute / reduce | HSDP (128, 8) | full (1, 1024) | HSDP vs full |")
    print("|---|---|---|---|")
    for compute, reduce in (("bf16", "fp32"), ("bf16", "bf16"), ("fp32", "fp32")):
        config = ZeroConfig(stage=3, precision=Precision(compute=None if compute == "fp32" else compute,
                                                         reduce=reduce))
        hsdp, full = (estimate(psi, mesh_shape=shape, config=config).inter_node_bytes(GPUS_PER_NODE)
                      for shape in ((gpus // GPUS_PER_NODE, GPUS_PER_NODE), (1, gpus)))
        print(f"| {compute} / {reduce} | {hsdp / GiB:.2f} | {full / GiB:.2f} | {hsdp / full:.3f} |")


if __name__ == "__main__":
    main()
