"""Figures for chapter 08: bandwidth curves and strategy bars."""

from __future__ import annotations

import matplotlib.pyplot as plt



def bandwidth_curves(rows, fits: dict | None = None, limit: float | None = None,
                     limit_label: str = "memory copy", title: str | None = None):
    """Collective benchmark results on log axes: time per call (left) and bus bandwidth (right).

    ``rows``: dicts with op, bytes, seconds and busbw (what the benchmark worker reports).
    ``fits``: op -> (alpha, beta) drawn as dashed lines alpha + beta * bytes on the left.
    ``limit``: a bandwidth in bytes/s drawn as a horizontal line on the right.
    """
    import numpy as np

    fig, (time_ax, bw_ax) = plt.subplots(1, 2, figsize=(11, 4))
    ops = list(dict.fromkeys(r["op"] for r in rows))
    for i, op in enumerate(ops):
        mine = sorted((r for r in rows if r["op"] == op), key=lambda r: r["bytes"])
        x = np.array([r["bytes"] for r in mine], dtype=float)
        color = f"C{i}"
        time_ax.loglog(x, [r["seconds"] for r in mine], "o-", color=color, label=op, markersize=4)
        bw_ax.loglog(x, [r["busbw"] / 1e9 for r in mine], "o-", color=color, label=op, markersize=4)
        if fits and op in fits:
            alpha, beta = fits[op]
            time_ax.loglog(x, alpha + beta * x, "--", color=color, alpha=0.7)
    if limit:
        bw_ax.axhline(limit / 1e9, color="black", linestyle=":", label=f"{limit_label} {limit / 1e9:.1f} GB/s")
    time_ax.set(xlabel="message size (bytes)", ylabel="seconds per call",
                title="time (dashed: fitted alpha + beta * bytes)")
    bw_ax.set(xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)", title="bus bandwidth")
    for ax in (time_ax, bw_ax):
        ax.grid(True, which="major", alpha=0.3)
    time_ax.legend(fontsize=8)
    bw_ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def step_time_curves(num_params, curves: dict, title: str | None = None, ylabel: str = "seconds per step"):
    """Predicted seconds per training step against model size, one line per label, log axes.

    ``curves``: label -> seconds (one per entry of ``num_params``). Labels that start with
    "compute" are drawn dashed (then dotted, ...) in grey, so communication and compute read apart.
    """
    fig, ax = plt.subplots(figsize=(7, 4.2))
    dashes = iter(["--", ":", "-."] * len(curves))
    for i, (label, seconds) in enumerate(curves.items()):
        compute = label.startswith("compute")
        ax.loglog(num_params, seconds, next(dashes) if compute else "o-", label=label, markersize=4,
                  color="0.3" if compute else f"C{i}")
    ax.set(xlabel="parameters", ylabel=ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def strategy_bars(rows, gpu_memory: float, budget: float | None = None, title: str | None = None):
    """The decision guide's figure: memory per GPU (left, against the GPU's memory) and
    communication and compute per step (right) for each strategy of
    ``costmodel.plan_parallelism``; the recommended one is marked with a star."""
    import numpy as np

    names = [("* " if r["recommended"] else "") + r["strategy"] for r in rows]
    y = np.arange(len(rows))
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 0.5 + 0.55 * len(rows)), sharey=True)
    mem = [r["memory"] / 1e9 for r in rows]
    mem_ax.barh(y, mem, color=["C2" if r["fits"] else "C3" for r in rows])
    mem_ax.axvline(gpu_memory / 1e9, color="black", label=f"GPU memory {gpu_memory / 1e9:.0f} GB")
    if budget:
        mem_ax.axvline(budget / 1e9, color="black", linestyle=":", label="left after activations")
    mem_ax.set_xscale("log")
    mem_ax.set(xlabel="model states per GPU (GB, log)", yticks=y)
    mem_ax.set_yticklabels(names)
    mem_ax.invert_yaxis()
    mem_ax.legend(fontsize=8, loc="lower right")
    comm = np.array([r["comm"] * 1e3 for r in rows])
    compute = np.array([r["compute"] * 1e3 for r in rows])
    time_ax.barh(y - 0.2, compute, height=0.4, color="0.6", label="compute")
    time_ax.barh(y + 0.2, comm, height=0.4, color="C0", label="communication (PP: bubble)")
    time_ax.set(xlabel="milliseconds per step")
    time_ax.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
