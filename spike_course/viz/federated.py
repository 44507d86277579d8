"""Figures for chapter 09: federated learning."""

from __future__ import annotations

import matplotlib.pyplot as plt



def site_classes(counts: dict, title: str | None = None):
    """Bars of how many samples of each class every site holds.

    ``counts``: panel title -> list (one per site) of per-class counts, e.g.
    {"IID": [site0_counts, site1_counts], "non-IID": [...]}.
    """
    import numpy as np

    fig, axes = plt.subplots(1, len(counts), figsize=(5.5 * len(counts), 3), squeeze=False, sharey=True)
    for ax, (name, sites) in zip(axes[0], counts.items()):
        sites = [np.asarray(c) for c in sites]
        classes = np.arange(len(sites[0]))
        width = 0.8 / len(sites)
        for k, c in enumerate(sites):
            ax.bar(classes + (k - (len(sites) - 1) / 2) * width, c, width, label=f"site {k} ({int(c.sum())})")
        ax.set(title=name, xlabel="class", xticks=classes)
        ax.margins(y=0.3)  # room for the legend above the bars
        ax.legend(fontsize=8, loc="upper center", ncols=min(len(sites), 4))
    axes[0][0].set_ylabel("samples")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def federated_curves(curves: dict, alone=None, title: str | None = None):
    """Test accuracy against communication: all-reduces of the model (left, log) and
    megabytes each rank sent (right, log). ``curves``: label -> [(all_reduces, bytes,
    accuracy), ...]; ``alone``: accuracies of sites trained without communication."""
    fig, (round_ax, bytes_ax) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for i, (label, points) in enumerate(curves.items()):
        points = [p for p in points if p[0] > 0]  # the start has sent nothing: no place on a log axis
        rounds, sent, acc = zip(*points)
        style = "s--" if label.startswith("DDP") else "o-"
        round_ax.plot(rounds, acc, style, color=f"C{i}", label=label, markersize=4)
        bytes_ax.plot([b / 1e6 for b in sent], acc, style, color=f"C{i}", label=label, markersize=4)
    if alone is not None:
        for ax in (round_ax, bytes_ax):
            ax.axhline(max(alone), color="0.5", linestyle=":", label="best site alone")
    round_ax.set(xscale="log", xlabel="all-reduces of the model (communication rounds)", ylabel="test accuracy")
    bytes_ax.set(xscale="log", xlabel="MB sent by each rank")
    for ax in (round_ax, bytes_ax):
        ax.grid(True, alpha=0.3)
    round_ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
