"""The bench's plots: step time against model-state bytes per rank, one panel per world size; and each row's
memory across one step."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from zero_bench.spread import rank_text, spread_s

MiB = 2**20
# Marker shape by stage, colour by system (a zero row's strategy with its placement and comm variant): a reader
# tells zero's rows from the references, and the stages apart, without reading a label.
STAGE_MARKERS = {1: "v", 2: "D", 3: "o"}
REFERENCE_STYLE = {"plain": ("0.35", "s"), "ddp": ("tab:red", "s"), "fsdp2": ("tab:orange", "^")}
ZERO_COLOURS = ("tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:cyan", "tab:olive", "tab:pink", "navy",
                "teal", "indigo", "darkgoldenrod", "slategray")


def family(r: dict[str, Any]) -> str:
    """A zero row's name without its stage (``chunk-s3-bucketed`` -> ``chunk-bucketed``): one colour each."""
    return re.sub(r"-s\d(?=-|$)", "", r["name"])


def _style(r: dict[str, Any], families: list[str]) -> tuple[Any, str]:
    config = r["config"]
    if config["kind"] != "zero":
        return REFERENCE_STYLE.get(config["kind"], ("0.5", "s"))
    colour = ZERO_COLOURS[families.index(family(r)) % len(ZERO_COLOURS)]
    return colour, STAGE_MARKERS.get(config.get("stage") or 3, "o")


def _dodged(xs: list[float], width: float = 0.012) -> list[float]:
    """Rows with the same model state (every stage-3 variant) side by side rather than on top of each other: each
    group of equal x spread over a band ``width`` of the axis wide per row, centred on the true value."""
    span = max(xs, default=1.0) or 1.0
    out = list(xs)
    groups: dict[float, list[int]] = {}
    for i, x in enumerate(xs):
        groups.setdefault(round(x / span, 3), []).append(i)
    for members in groups.values():
        for k, i in enumerate(members):
            out[i] = xs[i] + (k - (len(members) - 1) / 2) * width * span
    return out


def figure(records: list[dict[str, Any]], *, title: str) -> Any:
    """The comparison figure (a matplotlib ``Figure``; matplotlib must be importable).

    One panel per world size (rows on different ranks do not compare). Each timed row is a point: x is
    its model-state bytes per rank (parameters, gradients and optimizer states, the largest rank: what
    ZeRO changes; the torch runtime's few hundred MiB of resident memory are left out; rows of equal state
    stand side by side, a hair apart), y its median
    step time with a bar over its spread (:mod:`zero_bench.spread`). The point carries a number; the
    panel's legend names each number's row and its place among the panel's rows, a range such as
    ``2-4`` where the bars overlap (the order there is not measured). Both axes start at zero, so
    distances read as proportions. A row whose losses disagree with the reference is drawn hollow."""
    import matplotlib.pyplot as plt

    timed = [r for r in records if r.get("median_step_s") is not None]
    worlds = sorted({r["world_size"] for r in timed})
    families = sorted({family(r) for r in timed if r["config"]["kind"] == "zero"})
    panels = max(1, len(worlds))
    fig, axes = plt.subplots(1, panels, figsize=(7.2 * panels, 5.2), dpi=110, squeeze=False)
    for ax, world in zip(axes[0], worlds):
        rows = [r for r in timed if r["world_size"] == world]
        xs = _dodged([max(r["model_state_bytes"]) / MiB for r in rows])
        for number, (r, x) in enumerate(zip(rows, xs, strict=True), 1):
            colour, marker = _style(r, families)
            low, high = spread_s(r)
            y = 1000 * r["median_step_s"]
            hollow = r.get("losses_agree") is False
            ax.errorbar([x], [y], yerr=[[y - 1000 * low], [1000 * high - y]], fmt=marker, color=colour, ms=7,
                        mfc="none" if hollow else colour, capsize=3, lw=1,
                        label=f"{number}  {r['name']}  (place {rank_text(r)})")
            ax.annotate(str(number), (x, y), textcoords="offset points", xytext=(6, 3), fontsize=8)
        ax.set_xlim(left=0, right=1.1 * max(max(r["model_state_bytes"]) / MiB for r in rows))
        ax.set_ylim(bottom=0, top=1.1 * max(1000 * spread_s(r)[1] for r in rows))
        ax.set_xlabel("model-state MiB per rank (params + grads + optimizer states, largest rank)", fontsize=9)
        ax.set_ylabel("step ms: median, bar = spread", fontsize=9)
        ax.set_title(f"{world} rank{'s' if world > 1 else ''}: lower left is better", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(0.0, -0.16), fontsize=7.5, frameon=False, ncol=2,
                  title="number, row, place (a range: bars overlap)", title_fontsize=8)
    if not worlds:
        axes[0][0].text(0.5, 0.5, "no row ran", ha="center", va="center", transform=axes[0][0].transAxes)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot(records: list[dict[str, Any]], path: Path, *, title: str) -> bool:
    """Write :func:`figure` to ``path``; ``False`` (and a note on stdout) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed; no plot written (pip install matplotlib, then rerun) [{path}]")
        return False
    fig = figure(records, title=title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return True


# Stacked bottom to top: what the ZeRO formulas count, then the working buffers, then the rest.
KIND_ORDER = ("params", "grads", "optimizer_states", "gathered", "gradient_buffers", "pool", "kept_copies")


def plot_memory(records: list[dict[str, Any]], path: Path, *, title: str) -> bool:
    """One panel per configuration: rank 0's memory across the sampled step (see zero_bench.timeline), above the
    process at the step's start (the torch runtime's resident memory is hundreds of MiB the systems share; drawn,
    it leaves the model states a few pixels tall).

    Stacked areas are the system's own accounting by kind, then ``other`` (activations and temporaries: in-use
    bytes nobody accounts); the lines are the allocator's in-use bytes and the resident set, both above their
    values at the start. Vertical lines mark the phases of the step. Panels share no y-axis: each row is read
    against its own scale, the values are in its title and the table."""
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
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.6 * nrows), dpi=110, squeeze=False)
    colors = dict(zip(KIND_ORDER + ("other",), plt.get_cmap("tab10").colors))
    for ax, r in zip(axes.flat, rows):
        tl = r["memory_timeline"][0]
        t = [1000 * x for x in tl["t_s"]]
        cuda = tl.get("allocator") == "cuda"
        kinds = [k for k in KIND_ORDER if k in tl["by_kind_mib"]] + [k for k in tl["by_kind_mib"] if k not in KIND_ORDER]
        layers = [tl["by_kind_mib"][k] for k in kinds]
        labels = list(kinds)
        start_in_use = tl.get("start_in_use_mib") or 0.0
        if tl.get("in_use_mib") is not None:
            accounted = [sum(tl["by_kind_mib"][k][i] for k in kinds) for i in range(len(t))]
            layers.append([max(0.0, u - start_in_use - a) for u, a in zip(tl["in_use_mib"], accounted)])
            labels.append("other (activations)")
        if layers:
            ax.stackplot(t, *layers, labels=labels, alpha=0.75,
                         colors=[colors.get(k, "0.5") for k in kinds] + [colors["other"]])
        if tl.get("in_use_mib") is not None:
            ax.plot(t, [u - start_in_use for u in tl["in_use_mib"]], color="black", lw=1.0, label="allocator in use")
        if cuda:
            held0 = tl.get("start_held_mib") or 0.0
            ax.plot(t, [h - held0 for h in tl["held_mib"]], color="black", lw=1.0, ls="--", label="reserved")
        else:
            ax.plot(t, [x - tl["start_rss_mib"] for x in tl["rss_mib"]], color="tab:red", lw=1.4, label="RSS")
        for at, phase in tl["phases"]:
            ax.axvline(1000 * at, color="0.4", lw=0.6, ls=":")
            ax.text(1000 * at, 1.0, phase, rotation=90, va="top", ha="right", fontsize=6, transform=ax.get_xaxis_transform())
        states = sum(tl["by_kind_mib"][k][0] for k in ("params", "grads", "optimizer_states") if k in tl["by_kind_mib"])
        ax.set_title(f"{r['name']}: model states {states:.1f} MiB, peak RSS {max(r['peak_memory_mib']):.0f} MiB", fontsize=8)
        ax.set_xlabel("ms into the step", fontsize=8)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(rows):]:
        ax.axis("off")
    for row in axes:
        row[0].set_ylabel("MiB above the start (rank 0)", fontsize=8)
    seen: dict[str, Any] = {}
    for ax in list(axes.flat)[:len(rows)]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    fig.legend(seen.values(), seen.keys(), loc="lower center", ncol=min(6, len(seen)), fontsize=7)
    fig.suptitle(f"memory across one step, above the process at its start: {title}", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True
