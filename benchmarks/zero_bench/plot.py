"""Step time against peak memory per rank, one point per configuration (PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(records: list[dict[str, Any]], path: Path, *, title: str) -> bool:
    """Write the plot; ``False`` (and a note on stdout) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed; no plot written (pip install matplotlib, then rerun) [{path}]")
        return False
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for r in records:
        if r.get("median_step_s") is None:
            continue
        reference = r["config"]["kind"] != "zero"
        x, y = max(r["peak_memory_mib"]), 1000 * r["median_step_s"]
        ax.scatter([x], [y], marker="s" if reference else "o", s=60 if reference else 40,
                   color="tab:red" if reference else ("tab:blue" if r["losses_agree"] else "black"))
        ax.annotate(r["name"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("peak memory per rank (MiB; RSS on CPU, allocator peak on CUDA)")
    ax.set_ylabel("median step time (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


# Stacked bottom to top: what the ZeRO formulas count, then the working buffers, then the rest.
KIND_ORDER = ("params", "grads", "optimizer_states", "gathered", "gradient_buffers", "pool", "kept_copies")


def plot_memory(records: list[dict[str, Any]], path: Path, *, title: str) -> bool:
    """One panel per configuration: rank 0's memory across the sampled step (see zero_bench.timeline).

    Stacked areas are the system's own accounting by kind above the process at start, then ``other``
    (activations and temporaries: in-use bytes nobody accounts); the lines are the allocator's in-use
    bytes and the resident set. Vertical lines mark the phases of the step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed; no memory plot written (pip install matplotlib, then rerun) [{path}]")
        return False
    rows = [r for r in records if (r.get("memory_timeline") or [None])[0]]
    if not rows:
        return False
    cols = min(3, len(rows))
    nrows = -(-len(rows) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.6 * nrows), dpi=110, squeeze=False, sharey=True)
    colors = dict(zip(KIND_ORDER + ("other",), plt.get_cmap("tab10").colors))
    for ax, r in zip(axes.flat, rows):
        tl = r["memory_timeline"][0]
        t = [1000 * x for x in tl["t_s"]]
        cuda = tl.get("allocator") == "cuda"
        base = (tl.get("start_in_use_mib") or 0.0) if cuda else tl["start_rss_mib"]
        kinds = [k for k in KIND_ORDER if k in tl["by_kind_mib"]] + [k for k in tl["by_kind_mib"] if k not in KIND_ORDER]
        layers = [[base] * len(t)] + [tl["by_kind_mib"][k] for k in kinds]
        labels = ["at start"] + kinds
        if tl.get("in_use_mib") is not None:
            accounted = [sum(tl["by_kind_mib"][k][i] for k in kinds) for i in range(len(t))]
            start_in_use = tl["start_in_use_mib"] or 0.0
            layers.append([max(0.0, u - start_in_use - a) for u, a in zip(tl["in_use_mib"], accounted)])
            labels.append("other (activations)")
        ax.stackplot(t, *layers, labels=labels, alpha=0.75,
                     colors=["0.85"] + [colors.get(k, "0.5") for k in kinds] + [colors["other"]])
        if tl.get("in_use_mib") is not None and not cuda:
            shift = tl["start_rss_mib"] - (tl["start_in_use_mib"] or 0.0)  # in-use on the RSS scale: the same start
            ax.plot(t, [u + shift for u in tl["in_use_mib"]], color="black", lw=1.0, label="allocator in use")
        if cuda:
            ax.plot(t, tl["held_mib"], color="black", lw=1.0, ls="--", label="reserved")
        else:
            ax.plot(t, tl["rss_mib"], color="tab:red", lw=1.4, label="RSS")
        for at, phase in tl["phases"]:
            ax.axvline(1000 * at, color="0.4", lw=0.6, ls=":")
            ax.text(1000 * at, 1.0, phase, rotation=90, va="top", ha="right", fontsize=6, transform=ax.get_xaxis_transform())
        ax.set_title(f"{r['name']} (peak RSS {max(r['peak_memory_mib']):.0f} MiB)", fontsize=9)
        ax.set_xlabel("ms into the step", fontsize=8)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(rows):]:
        ax.axis("off")
    axes[0][0].set_ylabel("MiB (rank 0)")
    seen: dict[str, Any] = {}
    for ax in list(axes.flat)[:len(rows)]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    fig.legend(seen.values(), seen.keys(), loc="lower center", ncol=min(6, len(seen)), fontsize=7)
    fig.suptitle(f"memory across one step: {title}", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True
