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
