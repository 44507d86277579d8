"""Figures for chapter 01: message timelines and all-reduce cost curves."""

from __future__ import annotations

import matplotlib.pyplot as plt



def message_timeline(trace, world_size: int | None = None, title: str | None = None, ax=None):
    """One horizontal line per rank, one arrow per message of an ``mpi_sim`` trace.

    An arrow leaves its sender's line at the message's send time and reaches the
    receiver's line at its arrival time (microseconds of simulated time); its colour is
    the message's tag, so the steps of an algorithm that tags its steps read apart.
    """
    import matplotlib.colors as mcolors

    trace = list(trace)
    n = world_size or (1 + max((max(m.source, m.dest) for m in trace), default=0))
    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 0.9 + 0.45 * n))
    else:
        fig = ax.figure
    end = max((m.arrival_time for m in trace), default=0.0) * 1e6 or 1.0
    for rank in range(n):
        ax.axhline(rank, color="0.8", linewidth=1, zorder=0)
    tags = sorted({m.tag for m in trace})
    colors = list(mcolors.TABLEAU_COLORS.values())
    for m in trace:
        color = colors[tags.index(m.tag) % len(colors)]
        ax.annotate("", xy=(m.arrival_time * 1e6, m.dest), xytext=(m.send_time * 1e6, m.source),
                    arrowprops=dict(arrowstyle="->", color=color, linewidth=1.2,
                                    shrinkA=0, shrinkB=0))
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_ylim(n - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(-0.02 * end, 1.02 * end)
    ax.set_xlabel("simulated time (microseconds)")
    ax.set_title(title or f"{len(trace)} messages, {sum(m.nbytes for m in trace):,} bytes")
    fig.tight_layout()
    return fig


def allreduce_cost_curves(nbytes: float, world_size: int, alpha: float, beta: float,
                          title: str | None = None):
    """Alpha-beta all-reduce times of naive, ring and tree (``costmodel.allreduce_time``):
    against the message size at ``world_size`` ranks (left), and against the world size
    for ``nbytes`` (right). The dot marks the chosen point on each curve."""
    import numpy as np

    from ..costmodel import ALLREDUCE_ALGORITHMS, allreduce_time

    sizes = np.logspace(2, 10, 81)
    worlds = np.arange(2, 129)
    fig, (size_ax, world_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for i, algorithm in enumerate(ALLREDUCE_ALGORITHMS):
        color = f"C{i}"
        size_ax.loglog(sizes, allreduce_time(sizes, world_size, algorithm, alpha, beta),
                       color=color, label=algorithm)
        size_ax.plot(nbytes, allreduce_time(nbytes, world_size, algorithm, alpha, beta), "o",
                     color=color)
        world_ax.loglog(worlds, [allreduce_time(nbytes, int(w), algorithm, alpha, beta) for w in worlds],
                        color=color, label=algorithm)
        world_ax.plot(world_size, allreduce_time(nbytes, world_size, algorithm, alpha, beta), "o",
                      color=color)
    size_ax.set(xlabel="message size (bytes)", ylabel="seconds", title=f"{world_size} ranks")
    world_ax.set(xlabel="world size (ranks)", ylabel="seconds", title=f"{nbytes:,.0f} bytes")
    for ax in (size_ax, world_ax):
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
